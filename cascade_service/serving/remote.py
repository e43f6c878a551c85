"""The coordinator's side of a remote tier: a `BlockTier` that sends whole blocks over a transport.

`invoke(method, message) -> reply` is the only thing it knows about the transport (a Ray Serve
deployment handle in `serving.app`, a direct call in tests), so the cascade in `core/` runs unchanged
against remote tiers. Each call carries the full context: the replica that answers may not be the one
that answered last round, and the context lets it rebuild its KV cache (see `serving.tier`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ..core.adaptive import AdaptiveLength
from ..core.review import Verdict
from ..core.sampling import SamplingParams
from ..core.stats import CascadeStats, TierCounters, absorb
from ..core.types import Context, Draft
from ..core.verify import Verification
from .wire import rows_in, rows_out

Invoke = Callable[[str, dict[str, Any]], dict[str, Any]]


class RemoteTier:
    """One request's view of a remote model tier (implements `core.cascade.BlockTier`)."""

    def __init__(self, name: str, request_id: str, invoke: Invoke):
        self.name = name
        self.request_id = request_id
        self.invoke = invoke
        self.hops = 0
        self.hop_s = 0.0  # wall time of calls, transport included

    def draft_block(self, ctx: Context, k: int, sampling: SamplingParams, seed: int,
                    eos_ids: frozenset[int], counters: TierCounters, adaptive: AdaptiveLength | None = None) -> Draft:
        message = {**self._base(ctx, sampling, seed), "k": k, "eos_ids": sorted(eos_ids)}
        if adaptive is not None:  # the stopper runs in the replica, beside the hidden states it reads
            message["adaptive"] = adaptive.to_dict()
        reply = self._call("draft", message, counters)
        tokens = [int(t) for t in reply["tokens"]]
        return Draft(tokens, [float(p) for p in reply["token_probs"]], rows_in(reply["dists"]), [self.name] * len(tokens))

    def review_block(self, ctx: Context, block: Draft, leniency: float, sampling: SamplingParams,
                     seed: int, counters: TierCounters, verification: Verification | None = None) -> Verdict:
        message = {**self._base(ctx, sampling, seed), "leniency": leniency, "block": {
            "tokens": block.tokens, "token_probs": block.token_probs, "dists": rows_out(block.dists)}}
        if verification is not None:
            message["verification"] = {"rule": verification.rule, "alpha": verification.alpha,
                                       "beta": verification.beta}
        reply = self._call("review", message, counters)
        return Verdict(int(reply["accepted"]), int(reply["token"]), [float(p) for p in reply["token_probs"]],
                       rows_in(reply["dists"]), int(reply.get("off_target", 0)), float(reply.get("tv", 0.0)),
                       float(reply.get("ll_loss", 0.0)))

    def release(self) -> None:
        self.invoke("release", {"request_id": self.request_id})

    def _base(self, ctx: Context, sampling: SamplingParams, seed: int) -> dict[str, Any]:
        return {"tier": self.name, "request_id": self.request_id, "tokens": ctx.tokens, "stable": ctx.stable,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "rows": sampling.rows, "seed": seed}

    def _call(self, method: str, message: dict[str, Any], counters: TierCounters) -> dict[str, Any]:
        start = time.perf_counter()
        reply = self.invoke(method, message)
        elapsed = time.perf_counter() - start
        self.hops += 1
        self.hop_s += elapsed
        counters.hops += 1
        counters.calls += int(reply["calls"])
        counters.tokens_processed += int(reply["tokens_processed"])
        counters.time_s += elapsed
        return reply


class RemoteSystem(RemoteTier):
    """A drafter tier whose sub-cascade runs in its replica (implements `core.cascade.SystemTier`).

    `tiers` names the sub-cascade (this tier first, then every tier below it, "mag" last if used) and
    `k_matrix` is its part of the K-matrix; the replica hosts all of them.
    """

    def __init__(self, name: str, request_id: str, invoke: Invoke, tiers: list[str], k_matrix: list[list[int]],
                 leniency: float):
        super().__init__(name, request_id, invoke)
        self.sub = {"tiers": tiers, "k_matrix": k_matrix, "leniency": leniency}

    def system_draft(self, ctx: Context, want: int, limit: int, sampling: SamplingParams, seed: int,
                     eos_ids: frozenset[int], stats: CascadeStats,
                     adaptive: dict[str, AdaptiveLength] | None = None) -> Draft:
        start = time.perf_counter()
        message = {**self._base(ctx, sampling, seed), **self.sub, "want": want, "limit": limit,
                   "eos_ids": sorted(eos_ids)}
        inside = {t: a.to_dict() for t, a in (adaptive or {}).items() if t in self.sub["tiers"]}
        if inside:
            message["adaptive"] = inside
        reply = self.invoke("system", message)
        self.hops += 1
        self.hop_s += time.perf_counter() - start
        absorb(stats, reply["stats"])
        stats.tier(self.name).hops += 1
        tokens = [int(t) for t in reply["tokens"]]
        return Draft(tokens, [float(p) for p in reply["token_probs"]], rows_in(reply["dists"]), [self.name] * len(tokens))


