"""The coordinator: session -> cascade -> stream of tokens -> stats. Knows only protocols.

One wiring-independent object runs requests: the tiers come from a factory (`core.tier.Tier`s: in-process
models, or `transport.remote.RemoteTier`s over Ray Serve), sessions from any `SessionStore`. The gRPC edge
(`api/servicer.py`) and the Ray Serve ingress (`serving/app.py`) both call it.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .config import CascadeConfig
from .core.adaptive import StopperFactory
from .core.cascade import build_cascade
from .core.decode import decode
from .core.encdec import check_request, decoder_context
from .core.policy import OFF, PolicyFactory
from .core.prediction import prediction_ids
from .core.request import GenerationConfig, check_stop
from .core.stats import CascadeStats, EngineTime
from .core.tier import Release, Scope, Tier, affinity_key
from .core.verify import Verification
from .intake import (
    check_generation,
    check_vocabulary,
    prepare_state,
    request_schedule,
    request_state,
    with_stop_threshold,
)
from .metrics import Metrics, RequestTimes
from .output import TextStream
from .scheduling.loop import EngineLoop
from .scheduling.passes import CURRENT_CLOCK
from .sessions import SessionNotFound, SessionStore, check_access, check_session_id

MAX_PROMPT_TOKENS = 32_768

# A request's scope (its id, prefix-cache salt, routing key) -> {model tier name: its Tier for it}
TierFactory = Callable[[Scope], "dict[str, Tier]"]
# (API key's owner id ("" without keys), the request's context) -> {statistical drafter name: its Tier
# for one request}: the wiring's MaG and suffix decoding that run in this process (runtime.leaves.Leaves).
LeafFactory = Callable[[str, Sequence[int]], "dict[str, Tier]"]


def smallest_context(positions: Iterable[int | None]) -> int | None:
    """The positions every model tier holds, from each tier's own (None: it names no limit): the
    smallest, since every tier scores the whole context. None when no tier names one."""
    return min((p for p in positions if p), default=None)


class Cancelled(Exception):
    """The caller went away (it cancelled, or its deadline passed): the request stopped between rounds."""


def _never() -> bool:
    return False


@dataclass(frozen=True)
class GenerateParams:
    """A validated request; every bad value was turned into a ValueError naming its field."""

    prompt_ids: tuple[int, ...]
    gen: GenerationConfig
    session_id: str | None = None
    stop: tuple[str, ...] = ()
    owner: str = ""  # the caller's owner id (rpc.auth); a session is used only by its owner
    # The client set max_new_tokens (it must then fit the model's context, or the request is refused);
    # a server default is cut to what fits instead.
    explicit_max_new_tokens: bool = False


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # on the last chunk: "eos", "length" or "stop"
    stats: CascadeStats | None = None  # on the last chunk
    session_length: int = 0  # on the last chunk of a session request
    logprobs: list = field(default_factory=list)  # per token, when asked for (core.review.TokenLogprob)


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
    # the floor (scheduling.floor) over load adaptation (scheduling.load) or the K-matrix; None: the K-matrix.
    policies: PolicyFactory | None = None
    # Positions the smallest model tier holds (its max_position_embeddings); None: no limit known. A
    # request's context (session history + prompt) plus its new tokens must fit.
    max_context: int | None = None
    # Prometheus metrics of finished requests (metrics.py); None: none recorded.
    metrics: Metrics | None = None
    # An encoder-decoder target's decoder start token (core.encdec); None: decoder-only.
    decoder_start: int | None = None
    # The engine loop its requests run in (its wiring's engine core's, runtime.core), where front ends
    # submit them; None: a coordinator no front end serves (a test's, one called in a task directly).
    loop: EngineLoop | None = None

    # --- requests ----------------------------------------------------------------------------------

    def params(
        self,
        *,
        prompt: str = "",
        prompt_ids: Sequence[int] = (),
        session_id: str = "",
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        logit_bias: Mapping[int, float] | None = None,
        penalties: Mapping[str, float] | None = None,
        prediction: str | Sequence[int] | None = None,
        seed: int | None = None,
        stop: Sequence[str] = (),
        verification: Verification | None = None,
        stop_threshold: float | None = None,
        speculation: str | None = None,
        target_row: Sequence[int] | None = None,
        logprobs: int | None = None,
        response_format: Any = None,  # core.grammar.ResponseFormat
        owner: str = "",
    ) -> GenerateParams:
        """Validate one request's fields (ValueError names the field) and apply the server defaults."""
        ids = self._prompt_ids(prompt, prompt_ids)
        self._check_prompt_length(len(ids))
        check_request(self.decoder_start, ids, session=bool(session_id))
        if session_id:
            check_session_id(session_id)
        elif not ids:
            raise ValueError("prompt: empty (give prompt, prompt_token_ids or a session_id with history)")
        stop = check_stop(stop)
        overrides: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "logit_bias": logit_bias,
            **(penalties or {}),  # repetition_penalty, presence_penalty, frequency_penalty: as given
            "prediction": prediction_ids(self.tokenizer.encode, prediction) if prediction is not None else None,
            "seed": seed,
            "verification": verification,
            "stop_threshold": stop_threshold,
            "speculation": speculation,
            "target_row": tuple(target_row) if target_row is not None else None,
            "logprobs": logprobs,
            "response_format": response_format,
        }
        gen = replace(self.defaults, **{k: v for k, v in overrides.items() if v is not None})  # checks each field
        check_generation(self.vocab_size, self.cascade, gen, self.tokenizer.source)
        with_stop_threshold(self.cascade.adaptive, gen.stop_threshold)  # one no tier can use fails here
        params = GenerateParams(
            tuple(int(t) for t in ids), gen, session_id or None, stop, owner, max_new_tokens is not None
        )
        return self._fit(params, 0) if not session_id else params  # a session's history is read in stream()

    def request(self, prompt_ids: Sequence[int], gen: GenerationConfig, owner: str = "") -> GenerateParams:
        """A validated request from token ids and whole generation settings (in-process callers:
        `Engine.generate`, bench, tune), checked as `params` checks a served one."""
        ids = self._prompt_ids("", prompt_ids)
        self._check_prompt_length(len(ids))
        check_request(self.decoder_start, ids, session=False)
        if not ids:
            raise ValueError("prompt: empty (give at least one token)")
        with_stop_threshold(self.cascade.adaptive, gen.stop_threshold)
        check_generation(self.vocab_size, self.cascade, gen, self.tokenizer.source)
        return self._fit(GenerateParams(tuple(int(t) for t in ids), gen, owner=owner, explicit_max_new_tokens=True), 0)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt (or session) taken: one position must be left for a new token."""
        return MAX_PROMPT_TOKENS if self.max_context is None else min(MAX_PROMPT_TOKENS, self.max_context - 1)

    def _check_prompt_length(self, n: int) -> None:
        if n > self.max_prompt_tokens:
            held = "" if self.max_context is None else f" (the model holds {self.max_context} positions)"
            raise ValueError(f"prompt: {n} tokens, more than the limit of {self.max_prompt_tokens}{held}")

    def _fit(self, params: GenerateParams, history: int) -> GenerateParams:
        """`params` with its context (history + prompt) and new tokens within the model's positions:
        ValueError naming the field when the client's own numbers do not fit; a server default of
        max_new_tokens is cut to what is left."""
        if self.max_context is None:
            return params
        context = history + len(params.prompt_ids)
        if context >= self.max_context:
            raise ValueError(
                f"prompt: the session's {history} tokens plus the prompt's {len(params.prompt_ids)} "
                f"leave no room in the model's context of {self.max_context} positions"
            )
        room = self.max_context - context
        wanted = params.gen.max_new_tokens
        if wanted <= room:
            return params
        if params.explicit_max_new_tokens:
            what = (
                f"the session's {history} tokens plus the prompt's {len(params.prompt_ids)}"
                if history
                else f"the prompt's {len(params.prompt_ids)} tokens"
            )
            raise ValueError(
                f"max_new_tokens: {what} plus max_new_tokens {wanted} exceed the model's context of "
                f"{self.max_context} positions (at most {room} new tokens fit)"
            )
        return replace(params, gen=replace(params.gen, max_new_tokens=room))

    def stream(self, params: GenerateParams, cancelled: Callable[[], bool] = _never) -> Iterator[Chunk]:
        """Yield text/token chunks as target rounds finish; the last one has finish_reason and stats.

        `cancelled` is asked after every target round: once it says True the decode stops there, every
        tier frees the request's KV cache, the session is left as it was, and Cancelled is raised. So a
        client that hangs up or runs out of time costs at most the round already under way.
        """
        record = check_access(self.store.get(params.session_id), params.owner) if params.session_id else None
        context = list(record.token_ids if record else ()) + list(params.prompt_ids)
        if not context:
            raise ValueError("prompt: empty (the session has no history yet)")
        context = decoder_context(context, self.decoder_start)  # an encoder-decoder target: + its start token
        if record is not None:
            params = self._fit(params, len(record.token_ids))  # before any work
        request_id = uuid.uuid4().hex
        stats = CascadeStats(self.cascade.target.name)
        salt = cache_salt(params.owner)
        scope = Scope(request_id, salt, affinity_key(salt, params.session_id, context))
        tiers = self.tiers(scope) | (self.leaves(params.owner, context) if self.leaves is not None else {})
        text = TextStream(self.tokenizer.decode, params.stop)
        out: list[int] = []
        new: list[int] = []
        finish = "length"
        clock = _Clock(self.metrics)
        task = CURRENT_CLOCK.get()  # the engine loop task this request runs in (None elsewhere)
        mark = task.mark() if task is not None else None  # a task may run several requests (bench)
        try:
            for new in self._decode(request_id, salt, tiers, context, params.gen, stats):
                clock.tokens(len(new))
                if cancelled():
                    raise Cancelled(f"the request was cancelled after {len(out)} tokens")
                cut = text.feed(new)
                if cut is not None:
                    new, finish = new[:cut], "stop"
                elif new and new[-1] in self.eos_ids:
                    finish = "eos"
                out += new
                if finish != "length":
                    break  # this round's tokens go out with the last chunk
                delta = text.take(final=False)
                if new or delta:
                    yield Chunk(new, delta, logprobs=stats.logprobs[len(out) - len(new) : len(out)])
                new = []
        finally:
            clock.stop()
            # Every tier the request had: model tiers free their KV caches (a remote tier its replica's,
            # if it called it), suffix decoding hands the request's sequence to its key's trie.
            done = Release(request_id, tuple(context + out))  # their prefix caches keep what they hold of it
            for tier in tiers.values():
                tier.release(done)
        stats.generated = len(out)
        session_length = 0
        if record is not None:
            updated = self.store.append(record.session_id, list(params.prompt_ids) + out, record.version)
            session_length = len(updated.token_ids)
        if task is not None and mark is not None:
            stats.engine = EngineTime(*task.since(mark))
        clock.finished(stats, len(context), finish)
        tail = stats.logprobs[len(out) - len(new) : len(out)]
        yield Chunk(new, text.take(final=True), finish, stats, session_length, tail)

    def generate(self, params: GenerateParams, cancelled: Callable[[], bool] = _never) -> Chunk:
        tokens: list[int] = []
        texts: list[str] = []
        logprobs: list = []
        last = Chunk([], "")
        for chunk in self.stream(params, cancelled):
            tokens += chunk.token_ids
            texts.append(chunk.text)
            logprobs += chunk.logprobs
            last = chunk
        return Chunk(tokens, "".join(texts), last.finish_reason, last.stats, last.session_length, logprobs)

    def _decode(
        self,
        request_id: str,
        salt: str,
        tiers: dict[str, Tier],
        context: list[int],
        gen: GenerationConfig,
        stats: CascadeStats,
    ):
        state = request_state(gen, stats, self.vocab_size, self.eos_ids, self.cascade.adaptive, self.make_stopper)
        state.request_id, state.cache_salt = request_id, salt
        prepare_state(state, gen, len(context), self.policies, self.tokenizer.source, self.vocab_size)
        missing = [d.name for d in self.cascade.drafters if d.name not in tiers]
        if missing:  # a wiring fault, not the caller's: no tier (or no leaves) for a drafter of the config
            raise RuntimeError(f"no tier for drafter {missing[0]!r} in this coordinator")
        drafters = [tiers[d.name] for d in self.cascade.drafters]
        system = build_cascade(
            tiers[self.cascade.target.name],
            drafters,
            request_schedule(self.cascade, gen),
            self.cascade.leniency,
            state,
            None if state.policy is OFF else self.cascade.lookup,  # no drafts: no lookup to pay for either
        )
        yield from decode(system, context, gen.max_new_tokens, state)

    def _prompt_ids(self, prompt: str, prompt_ids: Sequence[int]) -> list[int]:
        if prompt and prompt_ids:
            raise ValueError("prompt: give prompt or prompt_token_ids, not both")
        ids = list(prompt_ids) if prompt_ids else (self.tokenizer.encode(prompt) if prompt else [])
        check_vocabulary(self.vocab_size, "prompt_token_ids", ids)
        return ids

    # --- sessions ----------------------------------------------------------------------------------

    def create_session(self, session_id: str = "", prompt: str = "", prompt_ids: Sequence[int] = (), owner: str = ""):
        check_request(self.decoder_start, (), session=True)
        ids = self._prompt_ids(prompt, prompt_ids)
        self._check_prompt_length(len(ids))  # a session no request could continue is refused up front
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
