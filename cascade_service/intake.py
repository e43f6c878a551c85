"""Intake: one request, built once from whatever front end took it (gRPC, HTTP, the SDK's in-process
call) and validated once, with everything its decode reads: its schedule, adaptive draft lengths with
its stop threshold applied, sampling, stop rule and compiled grammar (`Request`, made by `Intake`).

The checks that need what the coordinator serves (its vocabulary, its cascade's K-matrix, its
tokenizer, its models' positions) are here, each a ValueError naming the field; the checks of each
field alone are core.request's. A decode then builds the request's mutable state (its generator, its
block policy, its grammar matcher) from the immutable request (`decode_state`). The configuration
(config/) only describes; what a request runs with is built here."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

from .config import CascadeConfig
from .core.adaptive import AdaptiveLength, StopperFactory
from .core.cascade import RequestState
from .core.encdec import check_request
from .core.grammar import GrammarMask, grammar_tokenizer
from .core.local import StatisticalTier
from .core.placement import request_generator
from .core.policy import OFF, SPECULATION, PolicyFactory
from .core.proposers.prediction import PREDICTION, PredictionProposer, prediction_ids
from .core.request import GenerationConfig, check_stop, check_stop_threshold
from .core.sampling import SamplingParams
from .core.schedule import Schedule, ScheduleError
from .core.stats import CascadeStats
from .core.verify import Verification

MAX_PROMPT_TOKENS = 32_768


@dataclass(frozen=True)
class StopRule:
    """What ends a request before its length: a stop string in its text (cut just before it), or one
    of the target's end-of-sequence tokens."""

    strings: tuple[str, ...] = ()
    eos_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Request:
    """A validated request (every bad value was a ValueError naming its field) and what its decode
    runs with, worked out once, where it was built. The derived fields follow from `gen` and the
    server, so they take no part in equality."""

    prompt_ids: tuple[int, ...]
    gen: GenerationConfig
    schedule: Schedule = field(compare=False)  # its K-matrix: the configured one, or with its own target row
    # The tiers' adaptive draft lengths with its SpecDec++ stop threshold applied (read-only).
    adaptive: Mapping[str, AdaptiveLength] = field(compare=False)
    sampling: SamplingParams = field(compare=False)  # as every tier applies it (rows where verification needs them)
    stop: StopRule = StopRule()
    # The mode it runs (core.policy.SPECULATION): "auto" becomes "fixed" under its own target row, since
    # load adaptation would price blocks its evidence never saw.
    speculation: str = field(default="auto", compare=False)
    grammar: str | None = field(default=None, compare=False)  # its response format, compiled (core.grammar)
    session_id: str | None = None
    owner: str = ""  # the caller's owner id (rpc.auth); a session is used only by its owner
    # The client set max_new_tokens (it must then fit the model's context, or the request is refused);
    # a server default is cut to what fits instead.
    explicit_max_new_tokens: bool = False


@dataclass(frozen=True)
class Asked:
    """A served request as its client sent it, from any front end (gRPC, HTTP, a test): each setting
    None where the client left it to the server's defaults. Built once at the edge (the front end's
    one conversion) and turned into a `Request` by `Intake.served`, which checks every field."""

    prompt: str = ""
    prompt_ids: Sequence[int] = ()
    session_id: str = ""
    stop: Sequence[str] = ()
    prediction: str | Sequence[int] | None = None
    owner: str = ""
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    logit_bias: Mapping[int, float] | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    verification: Verification | None = None
    stop_threshold: float | None = None
    speculation: str | None = None
    target_row: Sequence[int] | None = None
    logprobs: int | None = None
    response_format: Any = None  # core.grammar.ResponseFormat

    def settings(self) -> dict[str, Any]:
        """The generation settings the client set: GenerationConfig's fields over the server's defaults."""
        given = {name: getattr(self, name) for name in SETTINGS}
        if given["target_row"] is not None:
            given["target_row"] = tuple(given["target_row"])
        return {name: value for name, value in given.items() if value is not None}


# Asked's fields that are GenerationConfig's of the same name, taken as sent (the prediction is turned
# into token ids first; the rest say what to continue and for whom)
SETTINGS = tuple(
    f.name for f in fields(Asked) if f.name in {g.name for g in fields(GenerationConfig)} and f.name != "prediction"
)


@dataclass(frozen=True)
class Intake:
    """What requests are built for: the served cascade, its target's vocabulary and end-of-sequence
    ids, the tokenizer, the server's defaults and the positions every model tier holds."""

    cascade: CascadeConfig
    vocab_size: int
    eos_ids: frozenset[int]
    encode: Callable[[str], list[int]]
    tokenizer: Any  # the `transformers` tokenizer (structured output); None: none here
    defaults: GenerationConfig
    max_context: int | None  # None: no limit known
    decoder_start: int | None  # an encoder-decoder target's decoder start token; None: decoder-only
    check_session: Callable[[str], None]  # a session id's form (the session store's rule)

    def served(self, asked: Asked) -> Request:
        """A served request from what its client sent. The checks run in one order (the prompt, the
        session id, the stop strings, each setting, then what the settings name here), so a request
        with several faults is refused for the same one every time."""
        ids = self.prompt(asked.prompt, asked.prompt_ids, session=bool(asked.session_id))
        if asked.session_id:
            self.check_session(asked.session_id)
        elif not ids:
            raise ValueError("prompt: empty (give prompt, prompt_token_ids or a session_id with history)")
        stops = check_stop(asked.stop)
        settings = asked.settings()
        if asked.prediction is not None:
            settings["prediction"] = prediction_ids(self.encode, asked.prediction)
        gen = replace(self.defaults, **settings)  # checks each field
        explicit = asked.max_new_tokens is not None
        request = self.build(ids, gen, stops, asked.session_id or None, asked.owner, explicit)
        return self.fit(request, 0) if not asked.session_id else request  # a session's history is read at its decode

    def given(self, prompt_ids: Sequence[int], gen: GenerationConfig, owner: str = "") -> Request:
        """A request from token ids and whole generation settings (in-process callers: `InProcess.generate`,
        bench, tune), checked as `served` checks a served one."""
        ids = self.prompt("", prompt_ids, session=False)
        if not ids:
            raise ValueError("prompt: empty (give at least one token)")
        return self.fit(self.build(ids, gen, (), None, owner, True), 0)

    def build(
        self,
        ids: Sequence[int],
        gen: GenerationConfig,
        stop: tuple[str, ...],
        session_id: str | None,
        owner: str,
        explicit_max_new_tokens: bool,
    ) -> Request:
        """The request from checked ids and settings: what the settings name must exist here, and what
        a decode reads of them is worked out now, once."""
        schedule, grammar = check_generation(self.vocab_size, self.cascade, gen, self.tokenizer)
        adaptive = with_stop_threshold(self.cascade.adaptive, gen.stop_threshold)  # one no tier can use fails here
        # A request's own row runs as given: load adaptation would price blocks its evidence never saw.
        mode = "fixed" if gen.target_row is not None and gen.speculation == "auto" else gen.speculation
        return Request(
            tuple(int(t) for t in ids),
            gen,
            schedule,
            MappingProxyType(adaptive),
            sampling_of(gen, rows=gen.verification.needs_rows),
            StopRule(stop, self.eos_ids),
            mode,
            grammar,
            session_id,
            owner,
            explicit_max_new_tokens,
        )

    def prompt(self, prompt: str, prompt_ids: Sequence[int], session: bool) -> list[int]:
        """The prompt's token ids (text is tokenized), checked against the vocabulary, the longest
        prompt and the target's kind."""
        if prompt and prompt_ids:
            raise ValueError("prompt: give prompt or prompt_token_ids, not both")
        ids = list(prompt_ids) if prompt_ids else (self.encode(prompt) if prompt else [])
        check_vocabulary(self.vocab_size, "prompt_token_ids", ids)
        self.check_prompt_length(len(ids))
        check_request(self.decoder_start, ids, session=session)
        return ids

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt (or session) taken: one position must be left for a new token."""
        return MAX_PROMPT_TOKENS if self.max_context is None else min(MAX_PROMPT_TOKENS, self.max_context - 1)

    def check_prompt_length(self, n: int) -> None:
        if n > self.max_prompt_tokens:
            held = "" if self.max_context is None else f" (the model holds {self.max_context} positions)"
            raise ValueError(f"prompt: {n} tokens, more than the limit of {self.max_prompt_tokens}{held}")

    def fit(self, request: Request, history: int) -> Request:
        """`request` with its context (history + prompt) and new tokens within the model's positions:
        ValueError naming the field when the client's own numbers do not fit; a server default of
        max_new_tokens is cut to what is left."""
        if self.max_context is None:
            return request
        context = history + len(request.prompt_ids)
        if context >= self.max_context:
            raise ValueError(
                f"prompt: the session's {history} tokens plus the prompt's {len(request.prompt_ids)} "
                f"leave no room in the model's context of {self.max_context} positions"
            )
        room = self.max_context - context
        wanted = request.gen.max_new_tokens
        if wanted <= room:
            return request
        if request.explicit_max_new_tokens:
            what = (
                f"the session's {history} tokens plus the prompt's {len(request.prompt_ids)}"
                if history
                else f"the prompt's {len(request.prompt_ids)} tokens"
            )
            raise ValueError(
                f"max_new_tokens: {what} plus max_new_tokens {wanted} exceed the model's context of "
                f"{self.max_context} positions (at most {room} new tokens fit)"
            )
        # Only the length changes: what was derived from the settings holds for the shorter request.
        return replace(request, gen=replace(request.gen, max_new_tokens=room))


def check_vocabulary(vocab_size: int, field: str, ids: Iterable[int]) -> None:
    bad = next((t for t in ids if not 0 <= int(t) < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{field}: {bad} is outside the vocabulary [0, {vocab_size})")


def check_generation(
    vocab_size: int, cascade: CascadeConfig, gen: GenerationConfig, tokenizer: Any = None
) -> tuple[Schedule, str | None]:
    """What a request's settings name must exist here: its logit_bias's and prediction's token ids, its
    own target row must make a valid K-matrix with the configured rows, and its response format must
    compile. Returns that K-matrix and the compiled grammar (None without a response format)."""
    check_vocabulary(vocab_size, "logit_bias", [t for t, _ in gen.logit_bias])
    check_vocabulary(vocab_size, "prediction", gen.prediction)
    schedule = request_schedule(cascade, gen)
    if gen.response_format is None:
        return schedule, None
    if tokenizer is None:
        raise ValueError("response_format: this server has no tokenizer to constrain the output with")
    return schedule, gen.response_format.grammar()  # a bad one is refused before any work


def request_schedule(cascade: CascadeConfig, gen: GenerationConfig) -> Schedule:
    """The K-matrix a request runs: the configured one, or it with the request's own target row (the
    rows below stay the configured ones: a drafter served as a sub-cascade runs its own)."""
    configured = cascade.schedule
    if gen.target_row is None:
        return configured
    try:
        rows = [list(gen.target_row), *configured.to_lists()[1:]]
        return Schedule.parse(rows, configured.drafters, fill=configured.fill.name)
    except ScheduleError as exc:
        raise ValueError(f"speculation.target_row: {exc}") from None


def sampling_of(gen: GenerationConfig, rows: bool = False) -> SamplingParams:
    """A request's sampling settings, as every tier applies them."""
    return SamplingParams(
        gen.temperature,
        gen.top_p,
        rows=rows,
        top_k=gen.top_k,
        min_p=gen.min_p,
        logit_bias=gen.logit_bias,
        repetition_penalty=gen.repetition_penalty,
        presence_penalty=gen.presence_penalty,
        frequency_penalty=gen.frequency_penalty,
    )


def decode_state(
    request: Request,
    stats: CascadeStats,
    scope: tuple[str, str],
    context_length: int,
    policies: PolicyFactory | None,
    tokenizer: Any,
    vocab_size: int,
    make_stopper: StopperFactory | None = None,
) -> RequestState:
    """One decode's mutable state, from the immutable request: its generator, its block policy, its
    prediction drafter and grammar matcher. `scope`: (request id, prefix-cache salt)."""
    gen = request.gen
    stats.verification = gen.verification.describe()
    sampling = request.sampling
    if sampling.penalized:  # presence and frequency count the output, which starts here
        sampling = replace(sampling, output_start=context_length)
    state = RequestState(
        sampling,
        request_generator(gen.seed),
        stats,
        vocab_size,
        request.stop.eos_ids,
        gen.verification,
        dict(request.adaptive),
        make_stopper,
    )
    state.request_id, state.cache_salt = scope
    # A lossless sampled request draws by position, so its seed alone fixes its output (core.sampling `race`)
    state.seed, state.keyed = gen.seed, not sampling.greedy and gen.verification.rule == "exact"
    state.logprobs = gen.logprobs
    state.policy = SPECULATION[request.speculation](policies, sampling.greedy, state.cache_salt)
    if gen.prediction:
        stats.tier(PREDICTION)  # counted even when it cannot draft: the reply names it either way
        if state.policy is not OFF:  # plain decoding: no drafter, the prediction included
            state.prediction = StatisticalTier(PredictionProposer(gen.prediction), vocab_size, PREDICTION)
    if gen.response_format is not None:  # the matcher compiles from the grammar cached at intake
        state.grammar = GrammarMask(grammar_tokenizer(tokenizer), gen.response_format, vocab_size, context_length)
    return state


def with_stop_threshold(adaptive: Mapping[str, AdaptiveLength], threshold: float | None) -> dict[str, AdaptiveLength]:
    """The tiers' adaptive draft lengths with a request's SpecDec++ threshold applied.

    Raises ValueError naming `stop_threshold` when it is out of (0, 1) or no tier has an acceptance
    head to apply it to: a request must not believe it changed something that does not exist.
    """
    threshold = check_stop_threshold(threshold)
    if threshold is None:
        return dict(adaptive)
    if not any(spec.rule == "specdec" for spec in adaptive.values()):
        raise ValueError(
            "stop_threshold: no tier of this cascade has an acceptance head (schedule.adaptive with rule specdec)"
        )
    return {
        tier: replace(spec, threshold=float(threshold)) if spec.rule == "specdec" else spec
        for tier, spec in adaptive.items()
    }
