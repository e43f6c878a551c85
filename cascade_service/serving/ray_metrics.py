"""The service's metrics in Ray's metrics system, from a Ray Serve replica (see `metrics`)."""

from __future__ import annotations

import ray
from ray.util import metrics as ray_metrics

from ..metrics import Metrics, default_metrics

KINDS = {"counter": ray_metrics.Counter, "gauge": ray_metrics.Gauge, "histogram": ray_metrics.Histogram}


def mirror_to_ray(metrics: Metrics | None = None) -> None:
    """This process's metrics (or `metrics`) recorded in Ray's too, from now on; a second call does nothing.
    Each node's metrics agent exports them for the cluster's Prometheus as `ray_cascade_*`. Outside a Ray
    worker (a replica's class made by hand, in a test) there is no agent: nothing changes."""
    if ray.is_initialized():
        (metrics or default_metrics()).mirror(KINDS)
