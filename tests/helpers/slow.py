"""A coordinator whose target is slowed down, with a record of when each request released its tiers."""

from __future__ import annotations

import threading
import time

DELAY_S = 0.02  # added to each of the target's forward passes


class SlowScorer:
    """A scorer whose forward passes take DELAY_S longer; counts them."""

    def __init__(self, inner):
        self.inner = inner
        self.passes = 0

    def logits(self, ctx, n):
        time.sleep(DELAY_S)
        self.passes += 1
        return self.inner.logits(ctx, n)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class SlowTarget:
    """The target tier with its passes slowed (SlowScorer); records when the request released it."""

    def __init__(self, tier, requests):
        tier.scorer = self.scorer = SlowScorer(tier.scorer)
        self.tier, self.requests = tier, requests
        self.name, self.system = tier.name, tier.system

    @property
    def passes(self):
        return self.scorer.passes

    def draft(self, request):
        return self.tier.draft(request)

    def review(self, request):
        return self.tier.review(request)

    def release(self, request):
        self.requests.released.append((time.monotonic(), self.passes))
        self.requests.done.set()
        self.tier.release(request)


class Requests:
    """What the coordinator did with each request: its slowed target, and when it released its tiers."""

    def __init__(self, coordinator):
        self.targets: list[SlowTarget] = []
        self.released: list[tuple[float, int]] = []  # (time, target passes at release)
        self.done = threading.Event()
        make, name = coordinator.tiers, coordinator.cascade.target.name

        def tiers(scope):
            made = make(scope)
            made[name] = SlowTarget(made[name], self)
            self.targets.append(made[name])
            return made

        coordinator.tiers = tiers
