"""The range of each field of a request, stated once: each check returns the value as stored or raises
a ValueError whose message starts with the field's name (the servicer turns it into INVALID_ARGUMENT
naming that field). Imports nothing, so every layer that checks a field (core.request's
GenerationConfig, core.sampling's SamplingParams off the wire, the CLI) can use it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from .policy import SPECULATION

MAX_NEW_TOKENS = 4096  # per request; the model's positions may allow fewer (Coordinator._fit)
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 20  # past any vocabulary here; a k at or above the vocabulary keeps every token
MAX_LOGIT_BIAS = 1024  # entries of a request's logit_bias: each travels with every tier call
MAX_PREDICTION_TOKENS = 32768  # as long as the longest prompt
MAX_PENALTY = 2.0  # presence and frequency penalties, as OpenAI's API
MAX_REPETITION_PENALTY = 10.0
MAX_DRAFTERS = 16
MAX_ROW_ENTRY = 64  # tokens one drafter adds to a target block in a request's own row
MAX_TOP_LOGPROBS = 20
MAX_BIAS = 100.0  # |bias| at most, as OpenAI's API: 100 bans or forces a token
SEED_LIMIT = 2**63  # seeds in [0, 2**63): an int64 on the wire
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def is_number(value: Any) -> bool:
    """An int or a float, not NaN, and not a bool (which Python counts as an int): what every numeric
    field anywhere (a request, a config, a CLI flag) accepts before its range is checked."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and not math.isnan(value)


def is_integer(value: Any) -> bool:
    """An int and not a bool (True is 1 to Python, never a count to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def unpaired(first: tuple[str, Any], second: tuple[str, Any]) -> str | None:
    """The error when exactly one of two settings that only work together is given (a TLS certificate
    and its key), each a (name, value) pair; None when both or neither are."""
    if (first[1] is None) != (second[1] is None):
        return f"{first[0]} and {second[0]} go together"
    return None


def check_max_new_tokens(value: Any) -> int:
    if not is_integer(value) or not 1 <= value <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got {value!r}")
    return value


def check_temperature(value: Any) -> float:
    if not is_number(value) or not 0.0 <= value <= MAX_TEMPERATURE:
        raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {value!r}")
    return float(value)


def check_top_p(value: Any) -> float:
    if not is_number(value) or not 0.0 < value <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {value!r}")
    return float(value)


def check_top_k(value: Any) -> int:
    """Keep the k most likely tokens; 0 keeps them all."""
    if not is_integer(value) or not 0 <= value <= MAX_TOP_K:
        raise ValueError(f"top_k must be in [0, {MAX_TOP_K}] (0: off), got {value!r}")
    return value


def check_min_p(value: Any) -> float:
    """Keep the tokens at least min_p times as likely as the most likely one; 0 keeps them all."""
    if not is_number(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"min_p must be in [0, 1), got {value!r}")
    return float(value)


def check_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (or its items) -> sorted ((id, bias), ...): added to the logits of every tier
    before anything else, greedy included. Ids are checked against the vocabulary by the coordinator."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (Mapping, Sequence)):
        raise ValueError(f"logit_bias must map token ids to numbers, got {type(value).__name__}")
    if len(value) > MAX_LOGIT_BIAS:  # before reading a huge one
        raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens, got {len(value)}")
    pairs = list(value.items()) if isinstance(value, Mapping) else list(value)
    out: dict[int, float] = {}
    for pair in pairs:
        token, bias = pair if isinstance(pair, tuple) and len(pair) == 2 else (pair, float("nan"))
        if not is_integer(token) or token < 0:
            raise ValueError(f"logit_bias: token ids must be non-negative integers, got {token!r}")
        if not is_number(bias) or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise ValueError(f"logit_bias: the bias of token {token} must be in [-100, 100], got {bias!r}")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def check_prediction(value: Any) -> tuple[int, ...]:
    """A request's predicted output as token ids (checked against the vocabulary by the coordinator)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"prediction must be token ids, got {type(value).__name__}")
    if len(value) > MAX_PREDICTION_TOKENS:
        raise ValueError(f"prediction holds at most {MAX_PREDICTION_TOKENS} tokens, got {len(value)}")
    if not all(is_integer(t) and t >= 0 for t in value):
        raise ValueError("prediction: token ids must be non-negative integers")
    return tuple(value)


def check_penalty(name: str, value: Any) -> float:
    """OpenAI's presence_penalty and frequency_penalty: in [-2, 2], 0 off."""
    if not is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
        raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
    return float(value)


def check_repetition_penalty(value: Any) -> float:
    """transformers' repetition_penalty: in (0, 10], 1 off; above 1 discourages tokens already seen."""
    if not is_number(value) or not 0.0 < value <= MAX_REPETITION_PENALTY:
        raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {value!r}")
    return float(value)


def check_target_row(value: Any) -> tuple[int, ...] | None:
    """A request's K-matrix row for the target (speculation.target_row): tokens per drafter per block;
    its length and reachability are checked against the cascade by the coordinator."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) > MAX_DRAFTERS:
        raise ValueError(f"speculation.target_row must be a list of at most {MAX_DRAFTERS} integers, got {value!r}")
    if not all(is_integer(k) and 0 <= k <= MAX_ROW_ENTRY for k in value):
        raise ValueError(
            f"speculation.target_row: each entry must be an integer in [0, {MAX_ROW_ENTRY}], got {value!r}"
        )
    return tuple(value)


def check_logprobs(value: Any) -> int:
    """-1: no logprobs; 0..20: each output token's logprob with this many alternatives (OpenAI's bound)."""
    if not is_integer(value) or not -1 <= value <= MAX_TOP_LOGPROBS:
        raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] alternatives (or -1: none), got {value!r}")
    return value


def check_seed(value: Any) -> int:
    if not is_integer(value) or not 0 <= value < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**63), got {value!r}")
    return value


def check_stop_threshold(value: Any) -> float | None:
    """SpecDec++'s stopping threshold h for one request; None keeps each tier's configured one."""
    if value is None:
        return None
    if not is_number(value) or not 0.0 < value < 1.0:
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
