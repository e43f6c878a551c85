"""How much a request drafts each round, decided above the algorithm: load adaptation (`load`, its trial
of ways to draft: `trial`), the floor under it (`floor`, on the goodput of each source: `goodput`). The
cascade reaches them only through `core.policy.BlockPolicy`; every wiring builds them with
`build_policies`, so the in-process engine, the standalone server and the Ray app run the same ones.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...core.policy import ARMS, FIXED, BlockPolicy, PolicyFactory
from ..clock import PassTimer
from .floor import GoodputFloor
from .goodput import DEFAULTS, EXPLORE, REST, FloorModel, FloorSettings
from .load import DraftBudget, load_policies
from .rest import RestingFloor


def build_policies(
    max_block: int,
    adapt_to_load: bool,
    floor: bool,
    arms: Sequence[str] | None = None,
    timer: PassTimer | None = None,
) -> PolicyFactory | None:
    """A request's speculation policy: load adaptation where `adapt_to_load` (its trial among `arms`,
    all of core.policy.ARMS when None; its cost model from `timer`, the target's passes where they run
    in this process, else a timer that sees none), under the floor where `floor`. None: the K-matrix as
    configured."""
    policies = load_policies(timer or PassTimer(), max_block, arms or ARMS) if adapt_to_load else None
    return floor_policies(policies) if floor else policies


def floor_policies(
    inner: PolicyFactory | None, settings: FloorSettings = DEFAULTS, model: FloorModel | None = None
) -> PolicyFactory:
    """The coordinator's policy per request, given whether it is greedy and its scope (its API key's
    salt): the floor over `inner`'s policy (load adaptation), or over the K-matrix as configured where
    `inner` is None; plain from its first round where drafting loses at its load (`FloorModel.admit`) or
    where load adaptation's trial runs its "plain" arm (its rounds still counted in the trial), the
    evidence they share (`model`; a new one where None)."""
    model = model if model is not None else FloorModel(settings)

    def policy(greedy: bool, scope: str = "") -> BlockPolicy:
        below = inner(greedy, scope) if inner is not None else FIXED
        if isinstance(below, DraftBudget) and below.keeps_plain():  # nothing would draft: no floor to run
            return RestingFloor(model, greedy, scope, inner=below)
        start = model.admit(greedy, scope)
        if start == REST:
            return RestingFloor(model, greedy, scope)
        floor = GoodputFloor(model, greedy, below, scope=scope)
        floor.explores = start == EXPLORE
        return floor

    return policy
