"""The range of each field of a request, stated once: each check returns the value as stored or raises
a ValueError whose message starts with the field's name (the servicer turns it into INVALID_ARGUMENT
naming that field). Imports nothing, so every layer that checks a field (core.request's
GenerationConfig, core.sampling's SamplingParams off the wire, the CLI) can use it.
"""

from __future__ import annotations

import math
from typing import Any

from .policy import SPECULATION

MAX_NEW_TOKENS = 4096  # per request; the model's positions may allow fewer (Coordinator._fit)
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 20  # past any vocabulary here; a k at or above the vocabulary keeps every token
SEED_LIMIT = 2**63  # seeds in [0, 2**63): an int64 on the wire
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and not math.isnan(value)


def check_max_new_tokens(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got {value!r}")
    return value


def check_temperature(value: Any) -> float:
    if not _number(value) or not 0.0 <= value <= MAX_TEMPERATURE:
        raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {value!r}")
    return float(value)


def check_top_p(value: Any) -> float:
    if not _number(value) or not 0.0 < value <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {value!r}")
    return float(value)


def check_top_k(value: Any) -> int:
    """Keep the k most likely tokens; 0 keeps them all."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_K:
        raise ValueError(f"top_k must be in [0, {MAX_TOP_K}] (0: off), got {value!r}")
    return value


def check_min_p(value: Any) -> float:
    """Keep the tokens at least min_p times as likely as the most likely one; 0 keeps them all."""
    if not _number(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"min_p must be in [0, 1), got {value!r}")
    return float(value)


def check_seed(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**63), got {value!r}")
    return value


def check_stop_threshold(value: Any) -> float | None:
    """SpecDec++'s stopping threshold h for one request; None keeps each tier's configured one."""
    if value is None:
        return None
    if not _number(value) or not 0.0 < value < 1.0:
        raise ValueError(f"stop_threshold must be in (0, 1), got {value!r}")
    return float(value)


def check_speculation(mode: Any) -> str:
    """A request's speculation mode (core.policy.SPECULATION): "auto", "off" or "fixed"."""
    if not isinstance(mode, str) or mode not in SPECULATION:
        raise ValueError(f"speculation.mode must be one of {', '.join(SPECULATION)}, got {mode!r}")
    return mode


def check_stop(stop: Any) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = (stop,)  # one stop string, not its characters
    stop = tuple(stop)
    if len(stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters")
    return stop
