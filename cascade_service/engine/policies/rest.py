"""The policy of a request admitted where drafting loses at its load (`goodput.FloorModel.admit`)."""

from __future__ import annotations

from collections.abc import Callable

from ...core.policy import NoDrafts
from ..clock import waited, work_clock
from .goodput import FloorModel, Level


class RestingFloor(NoDrafts):
    """A request admitted where drafting loses (`FloorModel.admit`): every round plain, as speculation
    "off" runs, but counted in the load (its rounds are in flight like any other) so the level that
    decides the next requests stays the machine's, and timed as a floor times its plain rounds (from one
    round's begin to the next's, the prompt's round aside) into the level's plain cost p: where most
    requests rest (at 16 and 64 streams at T = 1), they are most of the level's plain rounds, and p is
    then theirs too rather than only the few floors' (speculation "off" costs less a round than a
    floor's plain round, which carries the floor's bookkeeping)."""

    def __init__(
        self,
        model: FloorModel,
        greedy: bool = True,
        scope: str = "",
        clock: Callable[[], float] = waited,
        compute: Callable[[], float] | None = None,
    ):
        self.model, self.greedy, self.scope, self.clock = model, greedy, scope, clock
        self.compute = work_clock(clock, compute)
        self.rounds = 0
        self._began = self._began_work = 0.0
        self._here: tuple[int, Level] | None = None  # the level its round under way began at

    def begin(self, committed: int = 0, remaining: int = 0) -> None:
        now, work = self.clock(), self.compute()
        if self.rounds > 1 and self._here is not None:  # the last round ran from its begin to this one's
            self.model.plain(self._here[1], now - self._began, work - self._began_work)
        self._began, self._began_work = now, work
        self.rounds += 1
        level = self.model.level()
        if self._here is None or self._here[0] != level:
            self._here = (level, self.model.at(self.greedy, level, self.scope))
        self.model.started(self)

    def observe(self, drafted: int, accepted: int) -> None:
        self.model.ended(self)
