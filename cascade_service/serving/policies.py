"""The Ray app coordinator's block policies: load adaptation as the Ray app can run it, under the floor.

Kept apart from the app's deployments (serving.app), which only ask for them.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config import CascadeConfig, ConfigError, ServingConfig
from ..core.policy import PolicyFactory
from ..engine.policies import build_policies

RAY_ARMS = ("full", "lookup", "plain")


def coordinator_policies(cascade: CascadeConfig, serving: ServingConfig) -> PolicyFactory | None:
    """The coordinator's policy per request (engine.policies.build_policies): load adaptation where
    serving.adapt_to_load says, under the floor where serving.floor says (both on by default); None: the
    K-matrix as configured.

    Load adaptation here runs without the "budget" arm: its cost model needs the target's batched passes
    and each request's share of the drafters' ones, which live in other replicas; the trial of the
    other arms only needs each round's wall time, which the coordinator sees (every tier's reply and
    queueing included)."""
    arms = ray_arms(serving.load_arms) if serving.adapt_to_load else None
    return build_policies(cascade.max_block(), serving.adapt_to_load, serving.floor, arms)


def ray_arms(arms: Sequence[str] | None) -> tuple[str, ...]:
    """serving.load_arms as the Ray app runs them: RAY_ARMS when None; the "budget" arm is refused."""
    if arms is not None and "budget" in arms:
        raise ConfigError(
            "serving.load_arms: the Ray app cannot run the 'budget' arm (its cost model needs "
            f"the tiers' passes in the coordinator's process); choose among {list(RAY_ARMS)}"
        )
    return tuple(arms) if arms else RAY_ARMS
