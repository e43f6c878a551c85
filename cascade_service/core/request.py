"""One request's generation settings, checked once, where they are made.

Every way in builds a `GenerationConfig`: the config file and the CLI (`config.make_generation`), the
gRPC servicer and the Ray app (`Coordinator.params`, with the server's defaults filled in), and
in-process callers. Its checks are the one statement of each field's range, and each error is a
ValueError whose message starts with the field's name, which the servicer turns into
INVALID_ARGUMENT naming that field (api.status). The limits that depend on the model (prompt and
new tokens against its positions) and on the cascade (a stop threshold needs an acceptance head)
are checked by the coordinator, which knows both.

The SDK does not repeat these checks: it sends what it is given and raises the server's field
violations, so a client never refuses what a newer server would take.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # core.verify imports torch; this module does not need it to check numbers
    from .verify import Verification

MAX_NEW_TOKENS = 4096  # per request; the model's positions may allow fewer (Coordinator._fit)
MAX_TEMPERATURE = 100.0
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


def check_stop(stop: Any) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = (stop,)  # one stop string, not its characters
    stop = tuple(stop)
    if len(stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters")
    return stop


def _exact() -> Verification:
    from .verify import EXACT

    return EXACT


@dataclass(frozen=True)
class GenerationConfig:
    """How one request generates. Construction checks every field (ValueError naming it)."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0  # the request's sampling seed
    verification: Verification = field(default_factory=_exact)  # the final verifier's rule; exact by default
    # SpecDec++'s stopping threshold h in (0, 1) for this request, at every tier with an acceptance
    # head (schedule.adaptive, rule specdec); None keeps each tier's configured threshold.
    stop_threshold: float | None = None

    def __post_init__(self) -> None:
        # Numbers from YAML or JSON arrive as ints where floats are meant: stored as floats, so that
        # equal settings compare equal whatever way they came in.
        checked = {
            "max_new_tokens": check_max_new_tokens(self.max_new_tokens),
            "temperature": check_temperature(self.temperature),
            "top_p": check_top_p(self.top_p),
            "seed": check_seed(self.seed),
            "stop_threshold": check_stop_threshold(self.stop_threshold),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)
