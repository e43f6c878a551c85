"""Fixtures the access tests share (test_auth.py, test_serve_access.py)."""

from __future__ import annotations

import pytest

from ..helpers.access import self_signed_cert, write_keys


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    return write_keys(tmp_path_factory.mktemp("keys") / "api_keys.txt")


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 / localhost: (cert file, key file, cert PEM bytes)."""
    pytest.importorskip("cryptography")
    return self_signed_cert(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def config_file(tiny_family, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(f"tiers:\n  target: {{path: {tiny_family['target']}}}\n  drafters: [mag]\n")
    return path
