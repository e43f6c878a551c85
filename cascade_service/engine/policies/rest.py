"""The policy of a request admitted where drafting loses at its load (`goodput.FloorModel.admit`)."""

from __future__ import annotations

from ...core.policy import NoDrafts
from .goodput import FloorModel


class RestingFloor(NoDrafts):
    """A request admitted where drafting loses (`FloorModel.admit`): every round plain, as speculation
    "off" runs, but counted in the load (its rounds are in flight like any other) so the level that
    decides the next requests stays the machine's."""

    def __init__(self, model: FloorModel):
        self.model = model

    def begin(self, committed: int = 0, remaining: int = 0) -> None:
        self.model.started(self)

    def observe(self, drafted: int, accepted: int) -> None:
        self.model.ended(self)
