"""What one tier server does: draft or review whole blocks for many requests, each with its KV cache.

Plain Python, no Ray: `serving.tier_deployment` wraps it in a Ray deployment, `tierhost.server` in a gRPC
server. Calls arrive and replies leave as `transport.codec` bytes (`tierhost.host.TierHost` rebuilds
each call's context), never pickled client data; the same `core.local` tiers as in process do the work.
KV caches (and grammar states: transport.grammars) are soft state, kept under the request id (LRU,
bounded); a call that finds none (another replica served the previous round, a restart, an eviction)
builds a fresh one from the full context the call carries: a miss costs a prefill, never a token.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from .. import __version__
from ..config import MAG, ConfigError, ModelTierConfig
from ..core.cascade import RequestState, build_cascade
from ..core.local import StatisticalTier
from ..core.placement import request_generator
from ..core.proposers.mag import MaxGram
from ..core.stats import CascadeStats
from ..core.tier import DraftReply, DraftRequest, ReviewRequest, Tier
from ..engine.core import EngineCore, queue_of
from ..models.hf import HFModel
from ..proto.tier.v1 import tier_pb2 as pb
from .host import TierHost, UnknownTier
from .modeltier import MAX_BLOCK, MAX_CACHED_REQUESTS, TierServer, check_ids
from .subcascade import SubCascade


def _batched_passes(model: HFModel) -> int:
    if model.batcher is None:
        return 0
    sizes = dict(queue_of(model).batch_sizes)  # a copy: the batcher's worker thread adds to it meanwhile
    return sum(passes for size, passes in sizes.items() if size > 1)


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
        core: EngineCore | None = None,
    ):
        """`core`: the process's engine core, which loads the models and runs their passes (a new
        one when None: a process that serves only this group)."""
        self.core = core or EngineCore(name="tier")
        self.loop = self.core.loop  # where its calls run (tierhost.server, serving.tier_deployment)
        self.servers = {t.name: TierServer(t, self.core, max_cached_requests) for t in tiers}
        self.heads = self.core.heads()
        self.bigram = self.core.bigram(bigram) if bigram else None
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
                check_ids(request.context.tokens, self.mag_vocab, "context.tokens")
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

    def system_draft(self, name: str, request: DraftRequest) -> DraftReply:
        """Member `name`'s whole system for one draft, in this process."""
        sub, schedule = self.systems[name]
        rid = request.request_id
        stats = CascadeStats(name)
        head = self.servers[name].model
        state = RequestState(
            request.sampling,
            request_generator(request.seed),
            stats,
            head.vocab_size,
            request.eos_ids,
            adaptive=dict(request.adaptive),
            make_stopper=self.heads.stopper,
            request_id=rid,
            cache_salt=request.cache_salt,
            seed=request.seed,
            keyed=request.keyed,
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
        """The server is going away: its models leave the engine loop."""
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
    """A group member's whole sub-cascade as the tier a draft call routes to (`TierGroup.system_draft`)."""

    system = True

    def __init__(self, group: TierGroup, name: str):
        self.group, self.name = group, name

    def draft(self, request: DraftRequest) -> DraftReply:
        return self.group.system_draft(self.name, request)

    def review(self, request: ReviewRequest) -> Any:
        raise TypeError("a sub-cascade reviews through its head tier")

    def release(self, request: Any) -> None:
        """Its tiers' caches are released by the group."""
