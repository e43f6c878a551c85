"""Tier servers (cascade.tier.v1.Tier) on loopback for tests, and configs that reach them by address."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from cascade_service.cli.tier import tier_group
from cascade_service.config import CascadeConfig, Config, MaGConfig, ModelTierConfig, make_cascade
from cascade_service.core.tier import Tier
from cascade_service.engine.loop import TaskLoop
from cascade_service.tierhost.host import TierHost
from cascade_service.tierhost.server import TierServer, start_tier_server


def tiny_cascade(family: dict[str, Path], k_matrix=None, leniency: float = 1.5, mag: bool = True) -> CascadeConfig:
    """target <- close <- mid (<- MaG) of the tiny family, every tier local."""
    tiers = {n: ModelTierConfig(n, str(family[n])) for n in ("target", "close", "mid")}
    drafters = [tiers["close"], tiers["mid"], *([MaGConfig()] if mag else [])]
    default = [[4, 2, 0], [0, 2, 6], [0, 0, 6]] if mag else [[4, 2], [0, 3]]
    return make_cascade(tiers["target"], drafters, k_matrix or default, leniency)


def serve_group(cascade: CascadeConfig, names: Sequence[str], **options) -> TierServer:
    """A tier server for `names` of the cascade on a free loopback port, as `cascade-service tier` builds it."""
    return start_tier_server(tier_group(Config(cascade), list(names)), **options)


def addressed(cascade: CascadeConfig, servers: dict[str, TierServer | Sequence[TierServer]]) -> CascadeConfig:
    """The cascade with each named tier reached at its server(s) by address instead of loaded."""

    def address(name: str) -> tuple[str, ...]:
        found = servers[name]
        group = found if isinstance(found, Sequence) else [found]
        return tuple(f"127.0.0.1:{s.port}" for s in group)

    target = cascade.target
    if target.name in servers:
        target = replace(target, address=address(target.name))
    drafters = [replace(d, address=address(d.name)) if d.name in servers else d for d in cascade.drafters]
    return replace(cascade, target=target, drafters=tuple(drafters))


@contextmanager
def running(*servers: TierServer) -> Iterator[None]:
    try:
        yield
    finally:
        for server in servers:
            server.stop()


class HostedTiers:
    """In-process tiers behind a `TierHost`, served as a tier server serves its group (for toy models):
    `register(tier, request_id)` hosts one request's tier; calls for it are routed to it."""

    mag_vocab = None

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.loop = TaskLoop("hosted-tiers")  # where a tier server runs its calls
        self.tiers: dict[tuple[str, str], Tier] = {}
        self.host = TierHost(lambda name, request: self.tiers[(name, request.request_id)])

    def register(self, tier: Tier, request_id: str) -> None:
        self.tiers[(tier.name, request_id)] = tier

    def draft(self, data: bytes) -> bytes:
        return self.host.draft(data)

    def review(self, data: bytes) -> bytes:
        return self.host.review(data)

    def release(self, data: bytes) -> bool:
        request_id = self.host.release(data).request_id
        return bool([self.tiers.pop(key) for key in list(self.tiers) if key[1] == request_id])

    def info(self) -> dict:
        return {}

    def close(self) -> None:
        self.loop.close()


@contextmanager
def beside_plain(cascade: CascadeConfig, **options) -> Iterator[tuple]:
    """A standalone server of `cascade` (start_standalone's `options`) and a plain one of the same models,
    stopped on the way out: (served, plain), for side-by-side runs."""
    from cascade_service.standalone import start_standalone

    served = start_standalone(Config(cascade), **options)
    plain = start_standalone(Config(cascade), plain=True)
    try:
        yield served, plain
    finally:
        served.stop(0.0)
        plain.stop(0.0)
