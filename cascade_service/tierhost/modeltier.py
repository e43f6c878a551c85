"""One model tier a tier server hosts: its requests' KV caches (soft state, LRU under the request id),
its acceptance heads and grammar states, the checks a hostile call meets; and where a Ray replica
runs it (`replica_tier`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace

import torch

from ..config import ConfigError, ModelTierConfig
from ..core.adaptive import AdaptiveLength, DraftStopper
from ..core.local import ModelTier
from ..core.tier import DraftRequest, ReviewRequest
from ..engine.core import EngineCore
from ..models.hf import HFScorer
from ..proto.tier.v1 import tier_pb2 as pb
from ..startup import tier_device, where
from .grammars import TierGrammars

MAX_CACHED_REQUESTS = 256  # per replica; beyond it the least recently used request's cache is dropped
# The most tokens a call's block may hold (a draft's limit, a review's block): a K-matrix row's sum,
# entries at most core.schedule.MAX_ENTRY each, fits many times over; more is a hostile call.
MAX_BLOCK = 1024


class TierServer:
    """One model tier serving block calls. Calls for different request ids may run concurrently (each
    request has its own scorer, the shared state is locked); one request's calls come one at a time."""

    def __init__(self, tier: ModelTierConfig, core: EngineCore, max_cached_requests: int = MAX_CACHED_REQUESTS):
        self.tier = tier
        tier_device(tier)  # a device this machine lacks fails here, naming the tier, before the weights load
        self.model = core.model(tier)
        self.max_cached = max_cached_requests
        self._scorers: OrderedDict[str, HFScorer] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_misses = 0
        self.heads = core.heads(self.model.device)  # acceptance heads for adaptive draft length
        self.grammars = TierGrammars(tier, self.model.vocab_size, max_cached_requests)

    def info(self, system: bool) -> pb.TierInfo:
        """This tier as the tier API describes it (`system`: it runs its sub-cascade in one call)."""
        facts = self.model.facts()
        return pb.TierInfo(
            name=self.tier.name,
            vocab_size=facts.vocab_size,
            num_parameters=facts.num_parameters,
            eos_token_ids=facts.eos_token_ids,
            max_positions=facts.max_positions or 0,
            device=facts.device,
            system=system,
            max_block=MAX_BLOCK,
            encoder_decoder=facts.decoder_start is not None,
            decoder_start=facts.decoder_start or 0,
        )

    def check(self, request: DraftRequest | ReviewRequest) -> None:
        """A call this tier can take: its tokens in the vocabulary, its block and context within limits.
        ValueError names the field; the tier keeps serving."""
        vocab, tokens = self.model.vocab_size, request.context.tokens
        check_ids(tokens, vocab, "context.tokens")
        if isinstance(request, DraftRequest):
            block, blocks = request.limit, "limit"
        else:
            block, blocks = len(request.block.tokens), "block.tokens"
            check_ids(request.block.tokens, vocab, "block.tokens")
            dists = request.block.dists
            if dists is not None and dists.shape[1] != vocab:
                raise ValueError(
                    f"block.dists: {dists.shape[1]} columns, but tier {self.tier.name!r} has {vocab} tokens"
                )
        if block > MAX_BLOCK:
            raise ValueError(f"{blocks}: {block} tokens in one block; at most {MAX_BLOCK}")
        if not tokens:
            raise ValueError("context.tokens: empty; a call extends at least one token")
        limit = self.model.max_positions
        if limit is not None and len(tokens) + (request.want if isinstance(request, DraftRequest) else block) > limit:
            raise ValueError(
                f"context.tokens: {len(tokens)} tokens and a block of {block} exceed tier "
                f"{self.tier.name!r}'s {limit} positions"
            )

    def request_tier(self, request_id: str, salt: str = "") -> ModelTier:
        """This request's tier: its scorer (KV cache; a new one starts from its salt's cached
        prefixes), with this replica's acceptance heads and its grammar state."""
        grammar = self.grammars.of(request_id)
        return ModelTier(self.scorer(request_id, salt), self.model.vocab_size, self._stopper, grammar)

    def _stopper(self, spec: AdaptiveLength) -> DraftStopper:
        return self.heads.stopper(spec, self.model.config.hidden_size)

    def release(self, request_id: str, tokens: Sequence[int] = ()) -> bool:
        """Drop a finished request's KV cache (what it holds of its final `tokens` stays in the
        prefix cache); True if this replica held one."""
        with self._lock:
            scorer = self._scorers.pop(request_id, None)
        self.grammars.drop(request_id)
        if scorer is not None and tokens:
            scorer.finish(tokens)
        return scorer is not None

    def cached_requests(self) -> int:
        with self._lock:
            return len(self._scorers)

    def scorer(self, request_id: str, salt: str = "") -> HFScorer:
        """This request's scorer (KV cache), made fresh on a miss."""
        with self._lock:
            scorer = self._scorers.pop(request_id, None)
            if scorer is None:
                self.cache_misses += 1
                scorer = self.model.scorer(salt)
            self._scorers[request_id] = scorer  # most recently used last
            while len(self._scorers) > self.max_cached:
                self._scorers.popitem(last=False)
            return scorer


def replica_tier(tier: ModelTierConfig, gpus: Sequence[int], deployment: str) -> ModelTierConfig:
    """The tier as a Ray replica runs it: on the GPUs Ray gave the replica.

    gpus: the torch indices, in this process, of the GPUs Ray assigned the replica (Ray narrows
    CUDA_VISIBLE_DEVICES to them, so 0..n-1 unless told not to). Given none, the configured device
    stands. Given some, the tier follows them: cpu, auto and cuda run on the first, cuda:N on the N-th
    (a group of tiers may spread over its replica's GPUs), and an N beyond them fails, naming the tier.
    """
    if not gpus:
        if tier.device.startswith("cuda"):
            tier_device(
                tier,
                hint=f"; its deployment {deployment} was given no GPU "
                f"(serving.deployments.{deployment}.ray_actor_options.num_gpus)",
            )
        return tier
    index = (torch.device(tier.device).index or 0) if tier.device.startswith("cuda") else 0
    if index >= len(gpus):
        raise ConfigError(
            f"{where(tier, 'device')}: {tier.device}, but its deployment {deployment} was given "
            f"{len(gpus)} GPU{'' if len(gpus) == 1 else 's'}"
        )
    return replace(tier, device=f"cuda:{gpus[index]}")


def check_ids(tokens: Sequence[int], vocab: int, field: str) -> None:
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"{field}: token id {bad} outside the vocabulary [0, {vocab})")
