"""Simulated rounds of one request under the floor (engine.policies.floor), on a clock of our own: each
round's cost and acceptance per source are given, so a test states what drafting earns and reads
what the floor made of it."""

from __future__ import annotations

from cascade_service.core.policy import FIXED
from cascade_service.engine.policies.floor import FloorModel, GoodputFloor

from .trials import Clock  # the fake clock the trial's tests share

PLAIN_S = 1.0  # a plain round's cost, in the clock's units


class Request:
    """One request's rounds: each drafting source's round costs `cost[source]` (plus `catch_up` per token
    it is behind) and keeps `accept[source]` of the `k` drafts it is capped at; a plain round costs PLAIN_S."""

    def __init__(
        self,
        model: FloorModel,
        greedy: bool = True,
        inner=FIXED,
        prompt: int = 100,
        budget: int = 10_000,
        explores: bool = False,
    ):
        self.clock = Clock()
        self.work = Clock()  # its own work: its shares of the passes and its Python (engine.clock.charged)
        self.floor = GoodputFloor(model, greedy, inner, clock=self.clock, compute=self.work)
        self.floor.explores = explores  # as FloorModel.admit admits one request in EXPLORE_EVERY
        self.committed = prompt
        self.end = prompt + budget  # max_new_tokens
        self.sources: list[str | None] = []
        self.read = {"lookup": 0, "model": 0}

    def round(
        self,
        cost: dict,
        accept: dict,
        k: int = 4,
        hit: bool = False,
        catch_up: float = 0.0,
        work: dict | None = None,
        stall: float = 0.0,
    ) -> str | None:
        """`work[source]` (None: a plain round): its own work where that is not all of its wait; `stall`:
        seconds the round also lost (a garbage collection, the host's other work), in its wait and work."""
        floor = self.floor
        floor.begin(self.committed, self.end - self.committed)
        source, drafted = None, 0
        if hit and floor.allows("lookup"):
            drafted = floor.cap("lookup", k, k)
            source = "lookup" if drafted else None
        if source is None and floor.allows("model"):
            drafted = floor.cap("model", k, 16)
            source = "model" if drafted else None
        accepted = min(accept.get(source, 0), drafted)
        spent = (PLAIN_S if source is None else cost[source]) + stall
        if source is not None:
            spent += catch_up * max(0, self.committed - self.read[source] - 1)
            self.read[source] = self.committed + accepted + 1
        self.clock.t += spent
        self.work.t += work[source] + stall if work is not None else spent
        floor.observe(drafted, accepted)
        self.committed += accepted + 1
        self.sources.append(source)
        return source

    def plain_time(self) -> float:
        return (self.committed - 100) * PLAIN_S


BAD = ({"model": 1.6}, {"model": 0})  # a model round that keeps nothing: 1 token for 1.6 plain steps
GOOD = ({"model": 1.6}, {"model": 3})  # 4 tokens for 1.6 plain steps: 2.5x


def run(request: Request, rounds: int, shape=BAD, **kw) -> Request:
    for _ in range(rounds):
        request.round(*shape, **kw)
    return request


IN_FLIGHT: list[GoodputFloor] = []  # held here: the model keeps a round's floor weakly


def at_load(rounds_in_flight: int) -> FloorModel:
    """A model where `rounds_in_flight` - 1 other requests stay in a round (level log2 of it)."""
    model = FloorModel()
    IN_FLIGHT[:] = [GoodputFloor(model, True, FIXED, clock=Clock()) for _ in range(rounds_in_flight - 1)]
    for other in IN_FLIGHT:
        other.begin(10)
    model._load = float(rounds_in_flight)
    return model
