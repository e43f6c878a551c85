"""What one tier replica does: draft or review whole blocks for many requests, each with its KV cache.

Plain Python (no Ray): `serving.app` wraps it in a deployment. Messages are dicts of plain values and
numpy arrays, never pickled client data: the coordinator is the only caller.

KV caches are soft state. A request's scorer is kept under its request id (LRU, bounded); a call that
finds none (another replica served the previous round, the replica restarted, the entry was evicted)
builds a fresh scorer, which rebuilds the cache from the full context the call carries. So a miss
costs one prefill and never changes a token.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from ..config import ConfigError, ModelTierConfig
from ..core.adaptive import AdaptiveLength
from ..core.cascade import (
    RequestState,
    build_cascade,
    draft_autoregressive,
    score_and_review,
)
from ..core.mag import BigramTable, MaxGram
from ..core.review import rule_for
from ..core.sampling import SamplingParams
from ..core.schedule import Schedule
from ..core.stats import CascadeStats, TierCounters, stats_delta
from ..core.types import Context, Draft
from ..core.verify import Verification, final_rule
from ..models.acceptance_head import HeadCache
from ..models.hf import HFModel, HFScorer
from ..runtime.assemble import TierFacts
from ..startup import tier_device, where
from .wire import rows_in, rows_out

MAG_NAME = "mag"
MAX_CACHED_REQUESTS = 256  # per replica; beyond it the least recently used request's cache is dropped


class TierServer:
    """One model tier serving block calls. Calls for different request ids may run concurrently (each
    request has its own scorer, the shared state is locked); one request's calls come one at a time."""

    def __init__(self, tier: ModelTierConfig, max_cached_requests: int = MAX_CACHED_REQUESTS):
        self.tier = tier
        tier_device(tier)  # a device this machine lacks fails here, naming the tier, before the weights load
        self.model = HFModel.load(tier.path, dtype=tier.dtype, device=tier.device, name=tier.name)
        self.max_cached = max_cached_requests
        self._scorers: OrderedDict[str, HFScorer] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_misses = 0
        self.heads = HeadCache(self.model.device)  # acceptance heads for adaptive draft length

    def info(self) -> dict[str, Any]:
        return {"name": self.tier.name, **TierFacts.of(self.model).info()}

    def draft(self, msg: dict[str, Any]) -> dict[str, Any]:
        """msg: request_id, tokens, stable, k, temperature, top_p, seed, eos_ids -> a Draft as a dict."""
        ctx, sampling, generator = _context(msg), _sampling(msg), _generator(msg)
        scorer, counters = self.scorer(msg["request_id"]), TierCounters()
        before = scorer.tokens_processed
        stopper = None
        if msg.get("adaptive"):
            stopper = self.heads.stopper(AdaptiveLength(**msg["adaptive"]), self.model.config.hidden_size)
        draft = draft_autoregressive(scorer, ctx, int(msg["k"]), sampling, generator,
                                     frozenset(msg.get("eos_ids", ())), self.model.vocab_size, counters, stopper)
        return {"tokens": draft.tokens, "token_probs": draft.token_probs, "dists": rows_out(draft.dists),
                **_usage(counters, scorer.tokens_processed - before)}

    def review(self, msg: dict[str, Any]) -> dict[str, Any]:
        """msg: request_id, tokens, stable, block (tokens, token_probs, dists), leniency, sampling -> a Verdict."""
        ctx, sampling, generator = _context(msg), _sampling(msg), _generator(msg)
        block = msg["block"]
        # CPU rows off the wire; score_and_review moves them to this tier's device (core.placement).
        dists = rows_in(block.get("dists"))
        draft = Draft(list(block["tokens"]), list(block["token_probs"]), dists, [""] * len(block["tokens"]))
        scorer, counters = self.scorer(msg["request_id"]), TierCounters()
        before = scorer.tokens_processed
        verify = msg.get("verification")  # the target's review of a request with a lossy rule
        rule = final_rule(sampling.greedy, Verification(**verify)) if verify else rule_for(sampling.greedy)
        verdict = score_and_review(scorer, ctx, draft, rule, float(msg["leniency"]), sampling, generator, counters)
        return {"accepted": verdict.accepted, "token": verdict.token, "token_probs": verdict.token_probs,
                "dists": rows_out(verdict.dists), "off_target": verdict.off_target, "tv": verdict.tv,
                "ll_loss": verdict.ll_loss,
                **_usage(counters, scorer.tokens_processed - before)}

    def release(self, request_id: str) -> bool:
        """Drop a finished request's KV cache; True if this replica held one."""
        with self._lock:
            return self._scorers.pop(request_id, None) is not None

    def cached_requests(self) -> int:
        with self._lock:
            return len(self._scorers)

    def scorer(self, request_id: str) -> HFScorer:
        """This request's scorer (KV cache), made fresh on a miss."""
        with self._lock:
            scorer = self._scorers.pop(request_id, None)
            if scorer is None:
                self.cache_misses += 1
                scorer = self.model.scorer()
            self._scorers[request_id] = scorer  # most recently used last
            while len(self._scorers) > self.max_cached:
                self._scorers.popitem(last=False)
            return scorer


def _context(msg: dict[str, Any]) -> Context:
    tokens = [int(t) for t in msg["tokens"]]
    return Context(tokens, int(msg["stable"]))


def _sampling(msg: dict[str, Any]) -> SamplingParams:
    return SamplingParams(float(msg.get("temperature", 0.0)), float(msg.get("top_p", 1.0)), bool(msg.get("rows", False)))


def _generator(msg: dict[str, Any]) -> torch.Generator:
    return torch.Generator().manual_seed(int(msg.get("seed", 0)))



def replica_tier(tier: ModelTierConfig, gpus: Sequence[int], deployment: str) -> ModelTierConfig:
    """The tier as a Ray replica runs it: on the GPUs Ray gave the replica.

    gpus: the torch indices, in this process, of the GPUs Ray assigned the replica (Ray narrows
    CUDA_VISIBLE_DEVICES to them, so 0..n-1 unless told not to). Given none, the configured device
    stands. Given some, the tier follows them: cpu, auto and cuda run on the first, cuda:N on the N-th
    (a group of tiers may spread over its replica's GPUs), and an N beyond them fails, naming the tier.
    """
    if not gpus:
        if tier.device.startswith("cuda"):
            tier_device(tier, hint=f"; its deployment {deployment} was given no GPU "
                                   f"(serving.deployments.{deployment}.ray_actor_options.num_gpus)")
        return tier
    index = (torch.device(tier.device).index or 0) if tier.device.startswith("cuda") else 0
    if index >= len(gpus):
        raise ConfigError(f"{where(tier, 'device')}: {tier.device}, but its deployment {deployment} was given "
                          f"{len(gpus)} GPU{'' if len(gpus) == 1 else 's'}")
    return replace(tier, device=f"cuda:{gpus[index]}")


def _usage(counters: TierCounters, processed: int) -> dict[str, Any]:
    return {"calls": counters.calls, "tokens_processed": processed, "time_s": counters.time_s}


def _batched_passes(model: HFModel) -> int:
    if model.batcher is None:
        return 0
    sizes = dict(model.batcher.batch_sizes)  # a copy: the batcher's worker thread adds to it meanwhile
    return sum(passes for size, passes in sizes.items() if size > 1)


class TierGroup:
    """The model tiers one replica hosts (usually one), plus MaG when a member runs its sub-cascade.

    `system` runs a member's whole system (it reviewing the members and MaG below it) for one draft,
    in this process: one call where separate deployments would need one per block of each tier.
    """

    def __init__(self, tiers: list[ModelTierConfig], bigram: str | None = None, max_ngram: int = 16,
                 max_cached_requests: int = MAX_CACHED_REQUESTS):
        self.servers = {t.name: TierServer(t, max_cached_requests) for t in tiers}
        self.heads = HeadCache()
        self.bigram = BigramTable.load(bigram) if bigram else None
        self.max_ngram = max_ngram
        self.max_cached = max_cached_requests
        self._mags: OrderedDict[str, MaxGram] = OrderedDict()
        self._lock = threading.Lock()
        self.calls = 0  # block calls served (draft, review, system): shows whether work goes on

    def counters(self) -> dict[str, int]:
        """What an operator watches: calls served, requests holding a KV cache, cache misses, and the
        forward passes that concurrent requests shared (batch size > 1; 0 while batching is off)."""
        return {"calls": self.calls, "cached_requests": self.cached_requests(),
                "cache_misses": sum(server.cache_misses for server in self.servers.values()),
                "batched_passes": sum(_batched_passes(server.model) for server in self.servers.values())}

    def info(self) -> dict[str, Any]:
        return {name: server.info() for name, server in self.servers.items()}

    def draft(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._count()
        return self.servers[msg["tier"]].draft(msg)

    def review(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._count()
        return self.servers[msg["tier"]].review(msg)

    def _count(self) -> None:
        with self._lock:
            self.calls += 1

    def release(self, request_id: str) -> bool:
        with self._lock:
            had_mag = self._mags.pop(request_id, None) is not None
        return any([server.release(request_id) for server in self.servers.values()]) or had_mag

    def cached_requests(self) -> int:
        with self._lock:
            mags = len(self._mags)
        return sum(server.cached_requests() for server in self.servers.values()) + mags

    def system(self, msg: dict[str, Any]) -> dict[str, Any]:
        """msg: request_id, tokens, stable, want, limit, sampling, seed, eos_ids, and the sub-cascade:
        `tiers` (the member first, then the tiers below it, "mag" last if used), `k_matrix`, `leniency`."""
        self._count()
        names = list(msg["tiers"])
        sampling, request_id = _sampling(msg), msg["request_id"]
        stats = CascadeStats(names[0])
        adaptive = {t: AdaptiveLength(**a) for t, a in msg.get("adaptive", {}).items()}
        state = RequestState(sampling, _generator(msg), stats, self.servers[names[0]].model.vocab_size,
                             frozenset(msg.get("eos_ids", ())), adaptive=adaptive, make_stopper=self.heads.stopper)
        tiers = [self._mag(request_id) if n == MAG_NAME else self.servers[n].scorer(request_id) for n in names]
        schedule = Schedule.parse(msg["k_matrix"], names[1:])
        system = build_cascade(tiers[0], tiers[1:], schedule, float(msg["leniency"]), state, strict_top=False)
        draft = system.draft(_context(msg), int(msg["want"]), int(msg["limit"]))
        return {"tokens": draft.tokens, "token_probs": draft.token_probs, "dists": rows_out(draft.dists),
                "stats": stats_delta(stats)}

    def _mag(self, request_id: str) -> MaxGram:
        with self._lock:
            mag = self._mags.pop(request_id, None) or MaxGram(self.bigram, self.max_ngram)
            self._mags[request_id] = mag
            while len(self._mags) > self.max_cached:
                self._mags.popitem(last=False)
            return mag
