"""What one tier replica does: draft or review whole blocks for many requests, each with its KV cache.

Plain Python (no Ray): `serving.app` wraps it in a deployment. Calls arrive and replies leave as
`transport.codec` bytes, never pickled client data: the coordinator is the only caller. The work is
done by the same `core.local` tiers the in-process wiring uses.

KV caches are soft state. A request's scorer is kept under its request id (LRU, bounded); a call that
finds none (another replica served the previous round, the replica restarted, the entry was evicted)
builds a fresh scorer, which rebuilds the cache from the full context the call carries. So a miss
costs one prefill and never changes a token.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config import MAG, CascadeConfig, ConfigError, ModelTierConfig, ServingConfig
from ..core.adaptive import AdaptiveLength, DraftStopper
from ..core.cascade import RequestState, build_cascade
from ..core.local import MaGTier, ModelTier
from ..core.mag import BigramTable, MaxGram
from ..core.schedule import Schedule
from ..core.stats import CascadeStats
from ..core.tier import DraftReply, DraftRequest, Tier
from ..models.acceptance_head import HeadCache
from ..models.hf import HFModel, HFScorer
from ..runtime.assemble import TierFacts
from ..startup import tier_device, where
from ..transport.codec import (
    decode_draft_request,
    decode_release,
    decode_review_request,
    encode_draft_reply,
    encode_review_reply,
)

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

    def request_tier(self, request_id: str) -> ModelTier:
        """This request's tier: its scorer (KV cache), with this replica's acceptance heads."""
        return ModelTier(self.scorer(request_id), self.model.vocab_size, self._stopper)

    def _stopper(self, spec: AdaptiveLength) -> DraftStopper:
        return self.heads.stopper(spec, self.model.config.hidden_size)

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


def _batched_passes(model: HFModel) -> int:
    if model.batcher is None:
        return 0
    sizes = dict(model.batcher.batch_sizes)  # a copy: the batcher's worker thread adds to it meanwhile
    return sum(passes for size, passes in sizes.items() if size > 1)


@dataclass(frozen=True)
class SubCascade:
    """A group member's sub-cascade, fixed at deployment: `tiers` is the member first, then every tier
    below it ("mag" last if used); `k_matrix` its part of the K-matrix; `leniency` its inner reviews'."""

    tiers: tuple[str, ...]
    k_matrix: tuple[tuple[int, ...], ...]
    leniency: float

    @classmethod
    def of(cls, spec: Mapping[str, Any]) -> SubCascade:
        return cls(tuple(spec["tiers"]), tuple(tuple(row) for row in spec["k_matrix"]), float(spec["leniency"]))

    def schedule(self) -> Schedule:
        return Schedule.parse([list(row) for row in self.k_matrix], list(self.tiers[1:]))


class TierGroup:
    """The model tiers one replica hosts (usually one), plus MaG when a member runs its sub-cascade.

    `systems` names the members that run their whole sub-cascade (they reviewing the members and MaG
    below them) for one draft, in this process: one call where separate deployments would need one
    per block of each tier. It is fixed at deployment, with each sub-cascade's schedule parsed once.
    """

    def __init__(
        self,
        tiers: list[ModelTierConfig],
        bigram: str | None = None,
        max_ngram: int = 16,
        max_cached_requests: int = MAX_CACHED_REQUESTS,
        systems: Mapping[str, SubCascade] | None = None,
    ):
        self.servers = {t.name: TierServer(t, max_cached_requests) for t in tiers}
        self.heads = HeadCache()
        self.bigram = BigramTable.load(bigram) if bigram else None
        self.max_ngram = max_ngram
        self.max_cached = max_cached_requests
        self.systems = {name: (sub, sub.schedule()) for name, sub in (systems or {}).items()}
        for name, (sub, _) in self.systems.items():
            missing = [t for t in sub.tiers if t != MAG and t not in self.servers]
            if missing or sub.tiers[0] != name:
                raise ConfigError(f"sub-cascade of {name!r}: {', '.join(missing) or sub.tiers[0]} not in this group")
        self._mags: OrderedDict[str, MaxGram] = OrderedDict()
        self._lock = threading.Lock()
        self.calls = 0  # block calls served (draft, review): shows whether work goes on

    def counters(self) -> dict[str, int]:
        """What an operator watches: calls served, requests holding a KV cache, cache misses, and the
        forward passes that concurrent requests shared (batch size > 1; 0 while batching is off)."""
        return {
            "calls": self.calls,
            "cached_requests": self.cached_requests(),
            "cache_misses": sum(server.cache_misses for server in self.servers.values()),
            "batched_passes": sum(_batched_passes(server.model) for server in self.servers.values()),
        }

    def info(self) -> dict[str, Any]:
        return {name: server.info() for name, server in self.servers.items()}

    def draft(self, data: bytes) -> bytes:
        """A DraftRequest -> a DraftReply (transport.codec); a system member runs its sub-cascade."""
        name, request = decode_draft_request(data)
        self._count()
        if name in self.systems:
            return encode_draft_reply(self._system(name, request))
        return encode_draft_reply(self._server(name).request_tier(request.request_id).draft(request))

    def review(self, data: bytes) -> bytes:
        """A ReviewRequest -> a ReviewReply (transport.codec)."""
        name, request = decode_review_request(data)
        self._count()
        return encode_review_reply(self._server(name).request_tier(request.request_id).review(request))

    def release(self, data: bytes) -> bool:
        """A ReleaseRequest: drop the request's caches; True if this replica held any."""
        request_id = decode_release(data).request_id
        with self._lock:
            had_mag = self._mags.pop(request_id, None) is not None
        return any([server.release(request_id) for server in self.servers.values()]) or had_mag

    def cached_requests(self) -> int:
        with self._lock:
            mags = len(self._mags)
        return sum(server.cached_requests() for server in self.servers.values()) + mags

    def _server(self, name: str) -> TierServer:
        server = self.servers.get(name)
        if server is None:
            raise ValueError(f"tier: {name!r} is not served here (this replica has {', '.join(self.servers)})")
        return server

    def _count(self) -> None:
        with self._lock:
            self.calls += 1

    def _system(self, name: str, request: DraftRequest) -> DraftReply:
        """Member `name`'s whole system for one draft, in this process."""
        sub, schedule = self.systems[name]
        rid = request.request_id
        stats = CascadeStats(name)
        head = self.servers[name].model
        state = RequestState(
            request.sampling,
            torch.Generator().manual_seed(request.seed),
            stats,
            head.vocab_size,
            request.eos_ids,
            adaptive=dict(request.adaptive),
            make_stopper=self.heads.stopper,
            request_id=rid,
        )
        tiers: list[Tier] = [
            MaGTier(self._mag(rid), head.vocab_size) if n == MAG else self.servers[n].request_tier(rid)
            for n in sub.tiers
        ]
        system = build_cascade(tiers[0], tiers[1:], schedule, sub.leniency, state, strict_top=False)
        reply = system.draft(request)
        for tier in stats.tiers:  # every tier inside is listed, as the coordinator's own stats list theirs
            reply.usage.tier(tier)
        for reviewer in stats.reviews:
            reply.usage.reviewer(reviewer)
        return reply

    def _mag(self, request_id: str) -> MaxGram:
        with self._lock:
            mag = self._mags.pop(request_id, None) or MaxGram(self.bigram, self.max_ngram)
            self._mags[request_id] = mag
            while len(self._mags) > self.max_cached:
                self._mags.popitem(last=False)
            return mag


def system_heads(cascade: CascadeConfig, serving: ServingConfig) -> dict[str, SubCascade]:
    """Group members whose whole sub-cascade lies in their group (+ MaG), with that sub-cascade."""
    names = [t.name for t in cascade.tiers]
    k = cascade.schedule.to_lists()
    heads = {}
    for group in serving.groups:
        for name in group:
            h = names.index(name)
            below = set(names[h + 1 :])
            if h == 0 or cascade.schedule.is_leaf(h) or not below <= set(group) | {MAG}:
                continue
            reach, todo = set(), [h]
            while todo:  # every tier the sub-cascade reaches from h
                r = todo.pop()
                for c, _ in cascade.schedule.row(r) if r < len(k) else []:
                    if c + 1 not in reach:
                        reach.add(c + 1)
                        todo.append(c + 1)
            if {names[i] for i in reach} == below:
                heads[name] = SubCascade(tuple(names[h:]), tuple(tuple(row[h:]) for row in k[h:]), cascade.leniency)
    return heads


def check_adaptive_reviewers(cascade: CascadeConfig, serving: ServingConfig) -> None:
    """SpecDec++ at a reviewing tier reads that tier's hidden states, so its review must run where the
    cascade above it runs: colocated with the coordinator, or with its whole sub-cascade in its group."""
    names = [t.name for t in cascade.tiers]
    systems = system_heads(cascade, serving)
    for tier in cascade.adaptive:
        r = names.index(tier)
        if not cascade.schedule.is_leaf(r) and tier not in serving.colocate and tier not in systems:
            raise ConfigError(
                f"schedule.adaptive.{tier}: a reviewing tier with an acceptance head must be in "
                "serving.colocate, or in a serving.groups group that holds its whole sub-cascade"
            )
