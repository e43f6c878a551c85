"""The coordinator: session -> cascade -> stream of tokens -> stats. Knows only protocols.

One wiring-independent object runs requests: the tiers come from a factory (`core.tier.Tier`s: in-process
models, or `transport.remote.RemoteTier`s over Ray Serve), sessions from any `SessionStore`. The gRPC edge
(`api/servicer.py`) and the Ray Serve ingress (`serving/app.py`) both call it.
"""

from __future__ import annotations

import functools
import hashlib
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import CascadeConfig
from .core.adaptive import StopperFactory
from .core.cascade import build_cascade
from .core.decode import decode
from .core.encdec import check_request, decoder_context
from .core.policy import NoDrafts, PolicyFactory
from .core.request import GenerationConfig
from .core.stats import CascadeStats, EngineTime
from .core.tier import Release, Scope, Tier, affinity_key
from .engine.clock import CURRENT_CLOCK
from .engine.loop import TaskLoop
from .intake import MAX_PROMPT_TOKENS, Asked, Intake, Request, decode_state
from .metrics import Metrics, RequestTimes
from .output import Chunk, Output
from .sessions import SessionNotFound, SessionStore, check_access, check_session_id

__all__ = ["MAX_PROMPT_TOKENS", "Cancelled", "Chunk", "Coordinator", "Request", "Tokenizer", "cache_salt"]

# A request's scope (its id, prefix-cache salt, routing key) -> {model tier name: its Tier for it}
TierFactory = Callable[[Scope], "dict[str, Tier]"]
# (API key's owner id ("" without keys), the request's context) -> {statistical drafter name: its Tier
# for one request}: the wiring's MaG and suffix decoding that run in this process (engine.leaves.Leaves).
LeafFactory = Callable[[str, Sequence[int]], "dict[str, Tier]"]


def smallest_context(positions: Iterable[int | None]) -> int | None:
    """The positions every model tier holds, from each tier's own (None: it names no limit): the
    smallest, since every tier scores the whole context. None when no tier names one."""
    return min((p for p in positions if p), default=None)


class Cancelled(Exception):
    """The caller went away (it cancelled, or its deadline passed): the request stopped between rounds."""


def _never() -> bool:
    return False


@dataclass
class Tokenizer:
    """What the coordinator needs of a tokenizer (a `transformers` tokenizer fits)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    source: Any = None  # the `transformers` tokenizer behind them, where there is one (structured output)


@dataclass
class Coordinator:
    cascade: CascadeConfig
    tokenizer: Tokenizer
    vocab_size: int
    eos_ids: frozenset[int]
    tiers: TierFactory
    store: SessionStore
    defaults: GenerationConfig = field(default_factory=GenerationConfig)
    # The statistical drafters that run here; a config whose MaG or suffix decoding runs here needs them.
    leaves: LeafFactory | None = None
    param_costs: dict[str, float] = field(default_factory=dict)  # drafter params / target params (SWI)
    make_stopper: StopperFactory | None = None  # SpecDec++ at a reviewing tier local to this process
    # The target's block policy per request, given whether it is greedy and its scope (its API key's salt):
    # the floor (engine.policies.floor) over load adaptation (engine.policies.load) or the K-matrix; None: the K-matrix.
    policies: PolicyFactory | None = None
    # Positions the smallest model tier holds (its max_position_embeddings); None: no limit known. A
    # request's context (session history + prompt) plus its new tokens must fit.
    max_context: int | None = None
    # Prometheus metrics of finished requests (metrics.py); None: none recorded.
    metrics: Metrics | None = None
    # An encoder-decoder target's decoder start token (core.encdec); None: decoder-only.
    decoder_start: int | None = None
    # The engine loop its requests run in (its wiring's engine core's, engine.core), where front ends
    # submit them; None: a coordinator no front end serves (a test's, one called in a task directly).
    loop: TaskLoop | None = None

    # --- requests ----------------------------------------------------------------------------------

    @functools.cached_property
    def intake(self) -> Intake:
        """What this coordinator's requests are built for and checked against (intake.Intake), made once:
        what it reads of the coordinator does not change after it is built."""
        return Intake(
            self.cascade,
            self.vocab_size,
            self.eos_ids,
            self.tokenizer.encode,
            self.tokenizer.source,
            self.defaults,
            self.max_context,
            self.decoder_start,
            check_session_id,
        )

    def params(self, **asked: Any) -> Request:
        """A served request from its fields as a client sends them (intake.Asked's; ValueError names the
        field), the server's defaults filled in: built and validated once (intake.Intake.served)."""
        return self.intake.served(Asked(**asked))

    def request(self, prompt_ids: Sequence[int], gen: GenerationConfig, owner: str = "") -> Request:
        """A validated request from token ids and whole generation settings (in-process callers:
        `InProcess.generate`, bench, tune), checked as `params` checks a served one."""
        return self.intake.given(prompt_ids, gen, owner)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt (or session) taken: one position must be left for a new token."""
        return self.intake.max_prompt_tokens

    def stream(self, request: Request, cancelled: Callable[[], bool] = _never) -> Iterator[Chunk]:
        """Yield text/token chunks as target rounds finish; the last one has finish_reason and stats.

        `cancelled` is asked after every target round: once it says True the decode stops there, every
        tier frees the request's KV cache, the session is left as it was, and Cancelled is raised. So a
        client that hangs up or runs out of time costs at most the round already under way.
        """
        run = _Run(self, request)
        try:
            for new in run.rounds(cancelled):
                chunk = run.output.feed(new)
                if chunk is not None:
                    yield chunk
                if run.output.done:
                    break  # this round's tokens go out with the last chunk
        finally:
            run.release()
        stats, session_length = run.finish()
        yield run.output.end(stats, session_length)

    def generate(self, request: Request, cancelled: Callable[[], bool] = _never) -> Chunk:
        """The whole reply as one chunk: the tokens and text a stream of the request would send, made
        once by the decode (no chunk per round)."""
        run = _Run(self, request)
        try:
            for new in run.rounds(cancelled):
                run.output.add(new)
                if run.output.done:
                    break
        finally:
            run.release()
        return run.output.whole(*run.finish())

    def decode_rounds(
        self,
        request_id: str,
        salt: str,
        tiers: dict[str, Tier],
        context: list[int],
        request: Request,
        stats: CascadeStats,
    ) -> Iterator[list[int]]:
        """The request's rounds of committed tokens (core.decode), over a cascade built from its fields."""
        state = decode_state(
            request,
            stats,
            (request_id, salt),
            len(context),
            self.policies,
            self.tokenizer.source,
            self.vocab_size,
            self.make_stopper,
        )
        missing = [d.name for d in self.cascade.drafters if d.name not in tiers]
        if missing:  # a wiring fault, not the caller's: no tier (or no leaves) for a drafter of the config
            raise RuntimeError(f"no tier for drafter {missing[0]!r} in this coordinator")
        # A policy that never lets anything draft (speculation "off", a request the floor rests from its
        # first round) gets the target alone: no drafter's system to build, no lookup to pay for.
        plain = isinstance(state.policy, NoDrafts)
        drafters = [] if plain else [tiers[d.name] for d in self.cascade.drafters]
        system = build_cascade(
            tiers[self.cascade.target.name],
            drafters,
            request.schedule,
            self.cascade.leniency,
            state,
            None if plain else self.cascade.lookup,
        )
        return decode(system, context, request.gen.max_new_tokens, state)

    # --- sessions ----------------------------------------------------------------------------------

    def create_session(self, session_id: str = "", prompt: str = "", prompt_ids: Sequence[int] = (), owner: str = ""):
        check_request(self.decoder_start, (), session=True)
        # a session no request could continue is refused up front (the prompt's own checks)
        ids = self.intake.prompt(prompt, prompt_ids, session=False)
        if session_id:
            check_session_id(session_id)
        return self.store.create(ids, session_id or None, owner)

    def get_session(self, session_id: str, owner: str = ""):
        """The session, if `owner` owns it (SessionForbidden otherwise)."""
        check_session_id(session_id)
        return check_access(self.store.get(session_id), owner)

    def delete_session(self, session_id: str, owner: str = "") -> bool:
        """Delete the session if `owner` owns it; False if there was none."""
        check_session_id(session_id)
        try:
            check_access(self.store.get(session_id), owner)
        except SessionNotFound:
            return False
        return self.store.delete(session_id)


class _Run:
    """One decode of a request: its context (session history + prompt), tiers, output and clock; its
    rounds, then every tier released and the session updated."""

    def __init__(self, coordinator: Coordinator, request: Request):
        c = self.coordinator = coordinator
        self.record = check_access(c.store.get(request.session_id), request.owner) if request.session_id else None
        context = list(self.record.token_ids if self.record else ()) + list(request.prompt_ids)
        if not context:
            raise ValueError("prompt: empty (the session has no history yet)")
        self.context = decoder_context(context, c.decoder_start)  # an encoder-decoder target: + its start token
        if self.record is not None:
            request = c.intake.fit(request, len(self.record.token_ids))  # before any work
        self.request = request
        self.request_id = uuid.uuid4().hex
        self.stats = CascadeStats(c.cascade.target.name)
        self.salt = cache_salt(request.owner)
        scope = Scope(self.request_id, self.salt, affinity_key(self.salt, request.session_id, self.context))
        self.tiers = c.tiers(scope) | (c.leaves(request.owner, self.context) if c.leaves is not None else {})
        self.output = Output(c.tokenizer.decode, request.stop.strings, request.stop.eos_ids, self.stats.logprobs)
        self.task = CURRENT_CLOCK.get()  # the engine loop task this request runs in (None elsewhere)
        self.mark = self.task.mark() if self.task is not None else None  # a task may run several requests (bench)
        self.clock = _Clock(c.metrics)

    def rounds(self, cancelled: Callable[[], bool]) -> Iterator[list[int]]:
        """Each target round's committed tokens; Cancelled once `cancelled()` says so after a round."""
        for new in self.coordinator.decode_rounds(
            self.request_id, self.salt, self.tiers, self.context, self.request, self.stats
        ):
            self.clock.tokens(len(new))
            if cancelled():
                raise Cancelled(f"the request was cancelled after {len(self.output.tokens)} tokens")
            yield new

    def release(self) -> None:
        self.clock.stop()
        # Every tier the request had: model tiers free their KV caches (a remote tier its replica's,
        # if it called it), suffix decoding hands the request's sequence to its key's trie.
        done = Release(self.request_id, tuple(self.context + self.output.tokens))  # prefix caches keep what they hold
        for tier in self.tiers.values():
            tier.release(done)

    def finish(self) -> tuple[CascadeStats, int]:
        """After a decode that ended well: the session updated, the stats and metrics complete; (stats,
        the session's length, 0 without one)."""
        stats, out = self.stats, self.output.tokens
        stats.generated = len(out)
        session_length = 0
        if self.record is not None:
            updated = self.coordinator.store.append(
                self.record.session_id, list(self.request.prompt_ids) + out, self.record.version
            )
            session_length = len(updated.token_ids)
        if self.task is not None and self.mark is not None:
            stats.engine = EngineTime(*self.task.since(self.mark))
        self.clock.finished(stats, len(self.context), self.output.finish)
        return stats, session_length


class _Clock:
    """A request's timings for its metrics: running while it decodes, first token, gaps, end to end.
    Times run from the start of its decode; the front end records the time it queued before."""

    def __init__(self, metrics: Metrics | None):
        self.metrics = metrics
        self.start = self.last = time.monotonic()
        self.first: float | None = None
        self.gaps: list[tuple[float, int]] = []
        self.running = metrics is not None
        if metrics is not None:
            metrics.running.inc()

    def tokens(self, n: int) -> None:
        if not n or self.metrics is None:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now - self.start
        else:
            self.gaps.append((now - self.last, n))
        self.last = now

    def stop(self) -> None:
        if self.running and self.metrics is not None:
            self.metrics.running.dec()
            self.running = False

    def finished(self, stats: CascadeStats, prompt_tokens: int, finish: str) -> None:
        if self.metrics is not None:
            times = RequestTimes(0.0, self.first, self.gaps, time.monotonic() - self.start)
            self.metrics.request(stats, prompt_tokens, times, finish)


def cache_salt(owner: str) -> str:
    """The prefix-cache scope of an API key's requests (models.kvpool): a digest of its owner id, so
    no tier learns the id; "" (one shared space) without keys."""
    return hashlib.sha256(owner.encode()).hexdigest()[:32] if owner else ""
