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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .limits import (  # noqa: F401 - each field's check, used where requests are made
    MAX_NEW_TOKENS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    SEED_LIMIT,
    check_logit_bias,
    check_logprobs,
    check_max_new_tokens,
    check_min_p,
    check_penalty,
    check_prediction,
    check_repetition_penalty,
    check_seed,
    check_speculation,
    check_stop,
    check_stop_threshold,
    check_target_row,
    check_temperature,
    check_top_k,
    check_top_p,
)

if TYPE_CHECKING:  # core.verify imports torch; this module does not need it to check numbers
    from .grammar import ResponseFormat
    from .verify import Verification


def _exact() -> Verification:
    from .verify import EXACT

    return EXACT


PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class GenerationConfig:
    """How one request generates. Construction checks every field (ValueError naming it)."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    min_p: float = 0.0  # 0: every token
    # ((token id, bias), ...) added to every tier's logits (a dict is taken too); ids below the vocabulary
    # (checked by the coordinator, which knows it)
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0  # transformers': over the whole sequence; 1 = off
    presence_penalty: float = 0.0  # OpenAI's: over the request's output; 0 = off
    frequency_penalty: float = 0.0
    # The output the client expects (OpenAI's predicted outputs), as token ids: a drafter of this request
    # (core.proposers.prediction). It changes the speed, never the output.
    prediction: tuple[int, ...] = ()
    seed: int = 0  # the request's sampling seed
    verification: Verification = field(default_factory=_exact)  # the final verifier's rule; exact by default
    # SpecDec++'s stopping threshold h in (0, 1) for this request, at every tier with an acceptance
    # head (schedule.adaptive, rule specdec); None keeps each tier's configured threshold.
    stop_threshold: float | None = None
    # How the request speculates (core.policy.SPECULATION): "auto" as the server does (load adaptation
    # or the K-matrix), "fixed" the configured K-matrix whatever the load, "off" plain decoding of the
    # target through the same engine. The output is the same in all three (exact verification).
    speculation: str = "auto"
    # The target's K-matrix row for this request (one entry per drafter, largest first); None: the
    # configured row. It runs as given, round after round, under "auto" too (no load adaptation).
    target_row: tuple[int, ...] | None = None
    # -1: none; N >= 0: each output token's log-probability under the target's (processed) distribution
    # and the N most likely alternatives, from the final review's own pass.
    logprobs: int = -1
    # What the output must be (core.grammar: a JSON schema, any JSON object, a regex, a Lark grammar).
    response_format: ResponseFormat | None = None

    def __post_init__(self) -> None:
        # Numbers from YAML or JSON arrive as ints where floats are meant: stored as floats, so that
        # equal settings compare equal whatever way they came in.
        checked = {
            "max_new_tokens": check_max_new_tokens(self.max_new_tokens),
            "temperature": check_temperature(self.temperature),
            "top_p": check_top_p(self.top_p),
            "top_k": check_top_k(self.top_k),
            "min_p": check_min_p(self.min_p),
            "logit_bias": check_logit_bias(self.logit_bias),
            "repetition_penalty": check_repetition_penalty(self.repetition_penalty),
            "presence_penalty": check_penalty("presence_penalty", self.presence_penalty),
            "frequency_penalty": check_penalty("frequency_penalty", self.frequency_penalty),
            "prediction": check_prediction(self.prediction),
            "seed": check_seed(self.seed),
            "stop_threshold": check_stop_threshold(self.stop_threshold),
            "speculation": check_speculation(self.speculation),
            "target_row": check_target_row(self.target_row),
            "logprobs": check_logprobs(self.logprobs),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)
