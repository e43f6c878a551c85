"""A request's checks that need what the coordinator serves (its vocabulary, its cascade's K-matrix, its
tokenizer; the checks of each field alone are core.request's), each a ValueError naming the field, and
the per-request state they lead to."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from ..core.cascade import RequestState
from ..core.grammar import GrammarMask, grammar_tokenizer
from ..core.policy import OFF, SPECULATION, PolicyFactory
from ..core.request import GenerationConfig
from ..core.schedule import Schedule, ScheduleError
from . import CascadeConfig


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
