"""Intake: a request's checks that need what the coordinator serves (its vocabulary, its cascade's
K-matrix, its tokenizer; the checks of each field alone are core.request's), each a ValueError naming
the field, and the per-request state they lead to (its sampling, its generator, its policy, its grammar).
The configuration (config/) only describes; what a request runs with is built here."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch

from .config import CascadeConfig
from .core.adaptive import AdaptiveLength, StopperFactory
from .core.cascade import RequestState
from .core.grammar import GrammarMask, grammar_tokenizer
from .core.local import StatisticalTier
from .core.policy import OFF, SPECULATION, PolicyFactory
from .core.prediction import PREDICTION, PredictionProposer
from .core.request import GenerationConfig, check_stop_threshold
from .core.sampling import SamplingParams
from .core.schedule import Schedule, ScheduleError
from .core.stats import CascadeStats


def check_vocabulary(vocab_size: int, field: str, ids: Iterable[int]) -> None:
    bad = next((t for t in ids if not 0 <= int(t) < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{field}: {bad} is outside the vocabulary [0, {vocab_size})")


def check_generation(vocab_size: int, cascade: CascadeConfig, gen: GenerationConfig, tokenizer: Any = None) -> None:
    """What a request's settings name must exist here: its logit_bias's and prediction's token ids, and
    its own target row must make a valid K-matrix with the configured rows."""
    check_vocabulary(vocab_size, "logit_bias", [t for t, _ in gen.logit_bias])
    check_vocabulary(vocab_size, "prediction", gen.prediction)
    request_schedule(cascade, gen)
    if gen.response_format is not None:
        if tokenizer is None:
            raise ValueError("response_format: this server has no tokenizer to constrain the output with")
        gen.response_format.grammar()  # compiles and validates it: a bad one is refused before any work


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


def prepare_state(
    state: RequestState,
    gen: GenerationConfig,
    context_length: int,
    policies: PolicyFactory | None,
    tokenizer: Any,
    vocab_size: int,
) -> None:
    """What a request's settings make of its state, once its context is known."""
    if state.sampling.penalized:  # presence and frequency count the output, which starts here
        state.sampling = replace(state.sampling, output_start=context_length)
    # A request's own row runs as given: load adaptation would price blocks its evidence never saw.
    mode = "fixed" if gen.target_row is not None and gen.speculation == "auto" else gen.speculation
    state.policy = SPECULATION[mode](policies, state.sampling.greedy, state.cache_salt)
    if state.policy is OFF:  # plain decoding: no drafter, the prediction included
        state.prediction = None
    if gen.response_format is not None:
        state.grammar = GrammarMask(grammar_tokenizer(tokenizer), gen.response_format, vocab_size, context_length)


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


def request_state(
    gen: GenerationConfig,
    stats: CascadeStats,
    vocab_size: int,
    eos_ids: frozenset[int],
    adaptive: dict[str, AdaptiveLength] | None = None,
    make_stopper: StopperFactory | None = None,
) -> RequestState:
    """The shared state of one request's cascade, from its generation settings."""
    v = gen.verification
    stats.verification = v.describe()
    state = RequestState(
        sampling_of(gen, rows=v.needs_rows),
        torch.Generator().manual_seed(gen.seed),
        stats,
        vocab_size,
        eos_ids,
        v,
        with_stop_threshold(adaptive or {}, gen.stop_threshold),
        make_stopper,
    )
    state.logprobs = gen.logprobs
    if gen.prediction:
        state.prediction = StatisticalTier(PredictionProposer(gen.prediction), vocab_size, PREDICTION)
        stats.tier(PREDICTION)
    return state


def with_stop_threshold(adaptive: dict[str, AdaptiveLength], threshold: float | None) -> dict[str, AdaptiveLength]:
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
