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
import time
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from ..config import ModelTierConfig
from ..core.cascade import draft_autoregressive, score_and_review
from ..core.review import rule_for
from ..core.sampling import SamplingParams
from ..core.stats import TierCounters
from ..core.types import Context, Draft
from ..models.hf import HFModel, HFScorer

MAX_CACHED_REQUESTS = 256  # per replica; beyond it the least recently used request's cache is dropped


class TierServer:
    """One model tier serving block calls; thread-safe per request id."""

    def __init__(self, tier: ModelTierConfig, max_cached_requests: int = MAX_CACHED_REQUESTS):
        self.tier = tier
        self.model = HFModel.load(tier.path, dtype=tier.dtype, device=tier.device, name=tier.name)
        self.max_cached = max_cached_requests
        self._scorers: OrderedDict[str, HFScorer] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_misses = 0

    def info(self) -> dict[str, Any]:
        return {"name": self.tier.name, "vocab_size": self.model.vocab_size,
                "num_parameters": self.model.num_parameters, "eos_token_ids": sorted(self.model.eos_token_ids)}

    def draft(self, msg: dict[str, Any]) -> dict[str, Any]:
        """msg: request_id, tokens, stable, k, temperature, top_p, seed, eos_ids -> a Draft as a dict."""
        ctx, sampling, generator = _context(msg), _sampling(msg), _generator(msg)
        scorer, counters = self._scorer(msg["request_id"]), TierCounters()
        before = scorer.tokens_processed
        draft = draft_autoregressive(scorer, ctx, int(msg["k"]), sampling, generator,
                                     frozenset(msg.get("eos_ids", ())), self.model.vocab_size, counters)
        return {"tokens": draft.tokens, "token_probs": draft.token_probs, "dists": _array(draft.dists),
                **_usage(counters, scorer.tokens_processed - before)}

    def review(self, msg: dict[str, Any]) -> dict[str, Any]:
        """msg: request_id, tokens, stable, block (tokens, token_probs, dists), leniency, sampling -> a Verdict."""
        ctx, sampling, generator = _context(msg), _sampling(msg), _generator(msg)
        block = msg["block"]
        dists = None if block.get("dists") is None else torch.from_numpy(np.asarray(block["dists"]))
        draft = Draft(list(block["tokens"]), list(block["token_probs"]), dists, [""] * len(block["tokens"]))
        scorer, counters = self._scorer(msg["request_id"]), TierCounters()
        before = scorer.tokens_processed
        verdict = score_and_review(scorer, ctx, draft, rule_for(sampling.greedy), float(msg["leniency"]),
                                   sampling, generator, counters)
        return {"accepted": verdict.accepted, "token": verdict.token, "token_probs": verdict.token_probs,
                "dists": _array(verdict.dists), **_usage(counters, scorer.tokens_processed - before)}

    def release(self, request_id: str) -> bool:
        """Drop a finished request's KV cache; True if this replica held one."""
        with self._lock:
            return self._scorers.pop(request_id, None) is not None

    def cached_requests(self) -> int:
        with self._lock:
            return len(self._scorers)

    def _scorer(self, request_id: str) -> HFScorer:
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
    return SamplingParams(float(msg.get("temperature", 0.0)), float(msg.get("top_p", 1.0)))


def _generator(msg: dict[str, Any]) -> torch.Generator:
    return torch.Generator().manual_seed(int(msg.get("seed", 0)))


def _array(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().to(torch.float32).cpu().numpy()


def _usage(counters: TierCounters, processed: int) -> dict[str, Any]:
    return {"calls": counters.calls, "tokens_processed": processed, "time_s": counters.time_s}
