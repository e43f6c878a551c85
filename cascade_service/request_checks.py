"""A request's checks that need what the coordinator serves: its vocabulary and its cascade's K-matrix
(the checks of each field alone are core.request's). Each raises ValueError naming the field."""

from __future__ import annotations

from collections.abc import Iterable

from .config import CascadeConfig
from .core.request import GenerationConfig
from .core.schedule import Schedule, ScheduleError


def check_vocabulary(vocab_size: int, field: str, ids: Iterable[int]) -> None:
    bad = next((t for t in ids if not 0 <= int(t) < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{field}: {bad} is outside the vocabulary [0, {vocab_size})")


def check_generation(vocab_size: int, cascade: CascadeConfig, gen: GenerationConfig) -> None:
    """What a request's settings name must exist here: its logit_bias's and prediction's token ids, and
    its own target row must make a valid K-matrix with the configured rows."""
    check_vocabulary(vocab_size, "logit_bias", [t for t, _ in gen.logit_bias])
    check_vocabulary(vocab_size, "prediction", gen.prediction)
    request_schedule(cascade, gen)


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
