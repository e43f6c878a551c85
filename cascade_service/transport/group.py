"""What one tier server does: draft or review whole blocks for many requests, each with its KV cache.

Plain Python, no Ray: `serving.tier_deployment` wraps it in a Ray deployment, `transport.server` in a gRPC
server. Calls arrive and replies leave as `transport.codec` bytes (`transport.host.TierHost` rebuilds
each call's context), never pickled client data; the same `core.local` tiers as in process do the work.
KV caches (and grammar states: transport.grammars) are soft state, kept under the request id (LRU,
bounded); a call that finds none (another replica served the previous round, a restart, an eviction)
builds a fresh one from the full context the call carries: a miss costs a prefill, never a token.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .. import __version__
from ..api.tier.v1 import tier_pb2 as pb
from ..config import MAG, CascadeConfig, ConfigError, ModelTierConfig, ServingConfig
from ..core.adaptive import AdaptiveLength, DraftStopper
from ..core.cascade import RequestState, build_cascade
from ..core.local import ModelTier, StatisticalTier
from ..core.mag import BigramTable, MaxGram
from ..core.schedule import Schedule
from ..core.stats import CascadeStats
from ..core.tier import DraftReply, DraftRequest, ReviewRequest, Tier
from ..models.acceptance_head import HeadCache
from ..models.hf import HFModel, HFScorer
from ..runtime.assemble import TierFacts
from ..startup import tier_device, where
from .grammars import TierGrammars
from .host import TierHost, UnknownTier

MAX_CACHED_REQUESTS = 256  # per replica; beyond it the least recently used request's cache is dropped
# The most tokens a call's block may hold (a draft's limit, a review's block): a K-matrix row's sum,
# entries at most core.schedule.MAX_ENTRY each, fits many times over; more is a hostile call.
MAX_BLOCK = 1024


class TierServer:
    """One model tier serving block calls. Calls for different request ids may run concurrently (each
    request has its own scorer, the shared state is locked); one request's calls come one at a time."""

    def __init__(self, tier: ModelTierConfig, max_cached_requests: int = MAX_CACHED_REQUESTS):
        self.tier = tier
        tier_device(tier)  # a device this machine lacks fails here, naming the tier, before the weights load
        self.model = HFModel.for_tier(tier)
        self.max_cached = max_cached_requests
        self._scorers: OrderedDict[str, HFScorer] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_misses = 0
        self.heads = HeadCache(self.model.device)  # acceptance heads for adaptive draft length
        self.grammars = TierGrammars(tier, self.model.vocab_size, max_cached_requests)

    def info(self, system: bool) -> pb.TierInfo:
        """This tier as the tier API describes it (`system`: it runs its sub-cascade in one call)."""
        facts = TierFacts.of(self.model)
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
        _check_ids(tokens, vocab, "context.tokens")
        if isinstance(request, DraftRequest):
            block, blocks = request.limit, "limit"
        else:
            block, blocks = len(request.block.tokens), "block.tokens"
            _check_ids(request.block.tokens, vocab, "block.tokens")
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


def _batched_passes(model: HFModel) -> int:
    if model.batcher is None:
        return 0
    sizes = dict(model.batcher.batch_sizes)  # a copy: the batcher's worker thread adds to it meanwhile
    return sum(passes for size, passes in sizes.items() if size > 1)


@dataclass(frozen=True)
class SubCascade:
    """A group member's sub-cascade, fixed at deployment: `tiers` is the member first, then every tier
    below it ("mag" last if used); `k_matrix` its part of the K-matrix; `leniency` its inner reviews';
    `fill` how its rows fill a block, as the whole cascade's do (core.schedule.FILLS)."""

    tiers: tuple[str, ...]
    k_matrix: tuple[tuple[int, ...], ...]
    leniency: float
    fill: str = "entry"

    def schedule(self) -> Schedule:
        return Schedule.parse([list(row) for row in self.k_matrix], list(self.tiers[1:]), fill=self.fill)


class TierGroup:
    """The model tiers one server hosts (usually one), plus MaG when a member runs its sub-cascade or
    `mag` asks to serve it as a tier of its own.

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
        mag: bool = False,
        mag_vocab: int | None = None,
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
        self.serves_mag = mag
        self._mags: OrderedDict[str, MaxGram] = OrderedDict()
        self._lock = threading.Lock()
        self.calls = 0  # block calls served (draft, review): shows whether work goes on
        self.host = TierHost(self._route, max_cached_requests)
        # MaG's vocabulary, for checking its calls: the group's models' (or the config's, when alone).
        self.mag_vocab = next((s.model.vocab_size for s in self.servers.values()), mag_vocab)

    def counters(self) -> dict[str, int]:
        """What an operator watches: calls served, requests holding a KV cache, cache misses, and the
        forward passes that concurrent requests shared (batch size > 1; 0 while batching is off)."""
        return {
            "calls": self.calls,
            "cached_requests": self.cached_requests(),
            "cache_misses": sum(server.cache_misses for server in self.servers.values()),
            "batched_passes": sum(_batched_passes(server.model) for server in self.servers.values()),
        }

    def info(self) -> pb.InfoReply:
        """What this group hosts, typed as the tier API's InfoReply (what a tier server's Info answers
        and a tier deployment's handle carries, encoded): each model tier's facts, and MaG's."""
        tiers = [server.info(system=name in self.systems) for name, server in self.servers.items()]
        if self.serves_mag:
            tiers.append(pb.TierInfo(name=MAG, vocab_size=self.mag_vocab or 0, device="cpu", max_block=MAX_BLOCK))
        return pb.InfoReply(tiers=tiers, version=__version__)

    def draft(self, data: bytes) -> bytes:
        """A DraftRequest -> a DraftReply (transport.codec); a system member runs its sub-cascade."""
        self._count()
        return self.host.draft(data)

    def review(self, data: bytes) -> bytes:
        """A ReviewRequest -> a ReviewReply (transport.codec)."""
        self._count()
        return self.host.review(data)

    def release(self, data: bytes) -> bool:
        """A ReleaseRequest: drop the request's caches; True if this replica held any."""
        release = self.host.release(data)
        request_id = release.request_id
        with self._lock:
            had_mag = self._mags.pop(request_id, None) is not None
        return any([server.release(request_id, release.tokens) for server in self.servers.values()]) or had_mag

    def _route(self, name: str, request: DraftRequest | ReviewRequest) -> Tier:
        """The tier that serves `request` (its context whole), after checking the call."""
        rid = request.request_id
        if not rid:
            raise ValueError("request_id: empty; every call names its request (its KV cache lives under it)")
        if name == MAG and self.serves_mag:
            if not isinstance(request, DraftRequest):
                raise ValueError("tier: 'mag' drafts but cannot review")
            if self.mag_vocab is not None:
                _check_ids(request.context.tokens, self.mag_vocab, "context.tokens")
            if request.limit > MAX_BLOCK:
                raise ValueError(f"limit: {request.limit} tokens in one block; at most {MAX_BLOCK}")
            return StatisticalTier(self._mag(rid), self.mag_vocab or 0)
        server = self._server(name)
        server.check(request)
        if name in self.systems and isinstance(request, DraftRequest):
            return _System(self, name)
        return server.request_tier(rid, request.cache_salt)

    def cached_requests(self) -> int:
        with self._lock:
            mags = len(self._mags)
        return sum(server.cached_requests() for server in self.servers.values()) + mags

    def _server(self, name: str) -> TierServer:
        server = self.servers.get(name)
        if server is None:
            hosted = [*self.servers, *([MAG] if self.serves_mag else [])]
            raise UnknownTier(f"tier: {name!r} is not served here (this server has {', '.join(hosted)})")
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
            cache_salt=request.cache_salt,
        )
        tiers: list[Tier] = [
            StatisticalTier(self._mag(rid), head.vocab_size)
            if n == MAG
            else self.servers[n].request_tier(rid, request.cache_salt)
            for n in sub.tiers
        ]
        system = build_cascade(tiers[0], tiers[1:], schedule, sub.leniency, state, strict_top=False)
        reply = system.draft(request)
        for tier in stats.tiers:  # every tier inside is listed, as the coordinator's own stats list theirs
            reply.usage.tier(tier)
        for reviewer in stats.reviews:
            reply.usage.reviewer(reviewer)
        return reply

    def close(self) -> None:
        """Stop the models' batching threads (the server is going away)."""
        for server in self.servers.values():
            if server.model.batcher is not None:
                server.model.batcher.close()

    def cached_contexts(self) -> int:
        return len(self.host.contexts)

    def _mag(self, request_id: str) -> MaxGram:
        with self._lock:
            mag = self._mags.pop(request_id, None) or MaxGram(self.bigram, self.max_ngram)
            self._mags[request_id] = mag
            while len(self._mags) > self.max_cached:
                self._mags.popitem(last=False)
            return mag


class _System:
    """A group member's whole sub-cascade as the tier a draft call routes to (`TierGroup._system`)."""

    system = True

    def __init__(self, group: TierGroup, name: str):
        self.group, self.name = group, name

    def draft(self, request: DraftRequest) -> DraftReply:
        return self.group._system(self.name, request)

    def review(self, request: ReviewRequest) -> Any:
        raise TypeError("a sub-cascade reviews through its head tier")

    def release(self, request: Any) -> None:
        """Its tiers' caches are released by the group."""


def _check_ids(tokens: Sequence[int], vocab: int, field: str) -> None:
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"{field}: token id {bad} outside the vocabulary [0, {vocab})")


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
                rows = tuple(tuple(row[h:]) for row in k[h:])
                heads[name] = SubCascade(tuple(names[h:]), rows, cascade.leniency, cascade.schedule.fill.name)
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
