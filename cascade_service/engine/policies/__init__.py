"""How much a request drafts each round, decided above the algorithm: load adaptation (`load`, its trial
of ways to draft: `trial`), the floor under it (`floor`, on the goodput of each source: `goodput`). The
cascade reaches them only through `core.policy.BlockPolicy`; every wiring builds them with
`build_policies`, so the in-process engine, the standalone server and the Ray app run the same ones.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...core.policy import ARMS, PolicyFactory
from ..clock import PassTimer
from .floor import floor_policies
from .load import load_policies


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
