"""Shared fixtures: the tiny random-weight model family (built once per test session, no downloads)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from .helpers.deprecations import deprecations_fail
from .redis_server import RedisServer


@pytest.fixture(scope="session")
def tiny_family_factory(tmp_path_factory) -> Callable[[str], dict[str, Path]]:
    """`factory(arch)` -> {"target", "close", "mid", "unrelated"} model dirs; built once per arch."""
    # Imported here so collecting tests that never touch models does not import transformers.
    from cascade_service.zoo.tiny import build_family

    built: dict[str, dict[str, Path]] = {}

    def factory(arch: str = "llama") -> dict[str, Path]:
        if arch not in built:
            built[arch] = build_family(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch)
        return built[arch]

    return factory


@pytest.fixture(scope="session")
def tiny_family(tiny_family_factory) -> dict[str, Path]:
    """The llama tiny family: {"target", "close", "mid", "unrelated"} -> local model dir."""
    return tiny_family_factory("llama")


@pytest.fixture(scope="session")
def redis_server():
    """One real redis-server on a free loopback port for the whole test session (no persistence)."""
    with RedisServer() as server:
        yield server


def pytest_configure(config):
    # Tests run many tiny tensor ops; with torch's default thread pool, a busy second core makes each
    # op stall on OpenMP barriers (measured: 1 ms instead of 3 us). One thread is faster and steadier.
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def test_zoo_home(tmp_path_factory) -> Path:
    """A $CASCADE_SERVICE_HOME holding the trained `test` zoo (built once per session, < 60 s)."""
    from cascade_service.zoo.build import build_zoo

    home = tmp_path_factory.mktemp("cascade-home")
    build_zoo("test", home / "zoo" / "test", progress=False)
    return home


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item):
    # Inside pytest's own warning capture (a tryfirst wrapper, so outside this one): a deprecated API
    # our code calls fails the test (tests/helpers/deprecations.py says why filters alone miss it).
    with deprecations_fail():
        return (yield)
