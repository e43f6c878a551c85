"""The policy of a request admitted where drafting loses at its load (`goodput.FloorModel.admit`)."""

from __future__ import annotations

from collections.abc import Callable

from ...core.policy import BlockPolicy, NoDrafts
from ..clock import waited, work_clock
from .goodput import FloorModel, Level

# One resting round in this many is timed into the level's plain cost (every one counts in the load): a
# round's clocks, the level and the EWMA were most of a resting round's 11-13 us at 64 streams, and p
# moves by a tenth of a round's difference a sample (goodput.SMOOTHING), so a quarter of the rounds keep
# it as current where most requests rest (hundreds of rounds a second).
PLAIN_SAMPLE = 4


class RestingFloor(NoDrafts):
    """A request admitted where drafting loses (`FloorModel.admit`): every round plain, as speculation
    "off" runs, but counted in the load (its rounds are in flight like any other) so the level that
    decides the next requests stays the machine's, and one round in PLAIN_SAMPLE timed as a floor times
    its plain rounds (from the round's begin to the next's; never the prompt's round) into the level's
    plain cost p: where most requests rest (at 16 and 64 streams at T = 1), they are most of the level's
    plain rounds, and p is then theirs too rather than only the few floors' (speculation "off" costs
    less a round than a floor's plain round, which carries the floor's bookkeeping).

    `inner`: load adaptation's policy where the request was admitted while its trial runs the "plain" arm
    (engine.policies.floor); its rounds begin and end there too, so the trial's load and its epochs count
    them as the rounds they are, and nothing else of it runs (no source is ever asked)."""

    def __init__(
        self,
        model: FloorModel,
        greedy: bool = True,
        scope: str = "",
        clock: Callable[[], float] = waited,
        compute: Callable[[], float] | None = None,
        inner: BlockPolicy | None = None,
    ):
        self.model, self.greedy, self.scope, self.clock, self.inner = model, greedy, scope, clock, inner
        self.compute = work_clock(clock, compute)
        self.rounds = 0
        self._began = self._began_work = 0.0
        self._timed: Level | None = None  # the level a timed round under way began at

    def begin(self, committed: int = 0, remaining: int = 0) -> None:
        self.rounds += 1
        if self._timed is not None:  # the last round was timed: it ran from its begin to this one's
            self.model.plain(self._timed, self.clock() - self._began, self.compute() - self._began_work)
            self._timed = None
        if self.rounds % PLAIN_SAMPLE == 0:  # the prompt's round (the first) never is
            self._timed = self.model.at(self.greedy, self.model.level(), self.scope)
            self._began, self._began_work = self.clock(), self.compute()
        self.model.started(self)
        if self.inner is not None:
            self.inner.begin(committed, remaining)

    def observe(self, drafted: int, accepted: int) -> None:
        self.model.ended(self)
        if self.inner is not None:
            self.inner.observe(drafted, accepted)
