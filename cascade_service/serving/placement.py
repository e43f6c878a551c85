"""Each deployment's Ray Serve options: what the config asks for, over the app's bounded defaults."""

from __future__ import annotations

from typing import Any

from ..config import ServingConfig
from .routing import ROUTER_PATH
from .tier_deployment import DEFAULT_MAX_ONGOING

# Local default: tiers take turns within a request, so a fraction of a CPU each lets the whole app
# fit a 2-core machine; a cluster config gives real resources per deployment. Passive OpenMP waits:
# an idle tier's torch threads would otherwise spin for a while after each forward pass, taking the
# cores the next tier in the round needs. User code on the replica's own loop and sync methods run
# inline: each handoff between threads costs a context switch per hop, and the sync methods left
# (info, counters, release) return at once; what blocks (a tier's block calls; on the coordinator, a
# colocated tier's passes and the session store) goes to the replica's own thread pool, so the loop
# stays free to take concurrent calls. The coordinator's decodes run in its engine loop (engine/loop.py).
LOCAL_ACTOR_OPTIONS = {
    "num_cpus": 0.25,
    "runtime_env": {
        "env_vars": {
            "OMP_WAIT_POLICY": "PASSIVE",
            "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
            "RAY_SERVE_RUN_SYNC_IN_THREADPOOL": "0",
        }
    },
}

DEFAULT_MAX_QUEUED = 64  # per deployment handle; `serving.deployments.<name>.max_queued_requests` overrides


def deployment_options(serving: ServingConfig, name: str, local: bool) -> dict[str, Any]:
    """The Ray Serve options of deployment `name`: the config's serving.deployments.<name> over bounded
    queues, the drain's grace period, and (local) fractional CPUs."""
    options = {k: v for k, v in serving.deployments.get(name, {}).items()}
    # Bounded queues: a replica works on max_ongoing_requests at once and holds at most
    # max_queued_requests more per caller; past that, callers get RESOURCE_EXHAUSTED instead of
    # memory growing without bound (Serve's own default queue is unbounded). The replica sizes its
    # thread pool from max_ongoing_requests as set here; a Serve config file that sets it again leaves
    # the pool as it is (its threads start only as calls need them, so a larger pool costs nothing).
    options.setdefault("max_ongoing_requests", DEFAULT_MAX_ONGOING)
    options.setdefault("max_queued_requests", DEFAULT_MAX_QUEUED)
    # A replica being stopped (a redeploy, a scale-down, `serve` on SIGTERM) lets its calls in flight
    # finish for this long, then cancels them; each ends with a status.
    options.setdefault("graceful_shutdown_timeout_s", serving.shutdown_grace_s)
    # Calls go to the replica that holds their request's KV (serving.routing).
    options.setdefault("request_router_config", {"request_router_class": ROUTER_PATH})
    if local:
        options.setdefault("ray_actor_options", dict(LOCAL_ACTOR_OPTIONS))
    return options
