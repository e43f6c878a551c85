"""Adaptive draft length: rules that end an autoregressive draft block early.

A drafter drafting one token at a time asks its stopper after every token whether to stop. The
block's hard cap (the caller's `limit`), EOS and the maximum sequence length stay the caller's job;
a stopper only decides to stop *earlier*.

SpecDec++ (Huang et al. 2024, arXiv 2405.19715, Algorithm 1) stops once the predicted probability
that at least one drafted token will be rejected exceeds a threshold h. The confidence baseline
(Kangaroo, Liu et al. 2024; BiLD, Kim et al. 2024; SpecDec++ Sec. 2) stops once the drafter's own
distribution is no longer confident.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

ADAPTIVE_RULES = ("specdec", "confidence")


class DraftStopper(Protocol):
    """Decides, after each drafted token, whether the draft block ends there.

    `start()` is called when a new block begins. `should_stop(token, probs, hidden)` is called after
    each drafted token: `token` was just drafted from `probs` ([V], the drafter's distribution, or
    None where the caller has no such row: a reviewing tier emits tokens it reviewed, not sampled);
    `hidden` ([H]) is the drafter's final hidden state at the position that produced `probs` (the
    input to its LM head), given only when `needs_hidden`. True = stop now; the token just drafted
    stays in the block.
    """

    needs_hidden: bool

    def start(self) -> None: ...

    def should_stop(self, token: int, probs: torch.Tensor | None, hidden: torch.Tensor | None) -> bool: ...


class AcceptancePredictor(Protocol):
    """An acceptance prediction head: hidden [H] -> predicted P(accept) as a 0-d tensor in [0, 1]."""

    def predict(self, hidden: torch.Tensor) -> torch.Tensor: ...


def _check_threshold(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 < value < 1.0:  # NaN fails too
        raise ValueError(f"{name} must be in (0, 1), got {value}")
    return value


class SpecDecPPStopper:
    """SpecDec++ threshold rule: stop once 1 - prod_i a_i > h (Algorithm 1, Theorem 4.3).

    a_i = head(e_i) is the predicted acceptance of candidate y_i given y_<i were accepted, where
    e_i is the drafter's final hidden state at y_i's position (Eq. 4.1). That hidden state is
    computed by the forward pass that drafts y_{i+1}, so when y_i is just drafted the stopper only
    has e_{i-1}: the decision after drafting y_i covers y_1..y_{i-1}, and y_i is still submitted
    (SpecDec++ Algorithm 1; the official code does exactly this). This needs no extra drafter pass.
    Consequences: the first token of a block never stops it (its `hidden` belongs to the context,
    not to a candidate), so every block has at least 2 tokens unless the cap or EOS ends it --
    the official code's minimum of 2. The head's w_rej-weighted training makes a_i under-predict
    acceptance (ours, from the weighted loss); h is tuned jointly with w_rej (paper: h = 0.7 with w_rej = 6).
    """

    needs_hidden = True

    def __init__(self, head: AcceptancePredictor, threshold: float):
        self.head = head
        self.threshold = _check_threshold("threshold", threshold)
        self.start()

    def start(self) -> None:
        self.drafted = 0
        self.accept_prob = 1.0  # predicted P(all candidates so far accepted)

    @property
    def reject_prob(self) -> float:
        """Predicted P(at least one candidate whose hidden state was seen is rejected)."""
        return 1.0 - self.accept_prob

    def should_stop(self, token: int, probs: torch.Tensor | None, hidden: torch.Tensor | None) -> bool:
        if hidden is None:
            raise ValueError("SpecDecPPStopper needs the drafter's hidden state (needs_hidden is True)")
        self.drafted += 1
        if self.drafted > 1:  # hidden = e_{i-1}, the previous candidate's; at i = 1 it is the context's
            self.accept_prob *= float(self.head.predict(hidden))
        return self.reject_prob > self.threshold


class ConfidenceStopper:
    """Confidence baseline: stop once the drafter's top-1 probability max_v q(v) falls below h.

    "Confidence of the current draft token distribution" (SpecDec++ Sec. 2) is its maximum
    probability, as in Kangaroo's early exit and BiLD's fallback policy; with greedy drafting it
    equals the drafted token's probability. Deviation from BiLD, which hands the unconfident position
    to the large model instead of emitting it: this interface keeps the token just drafted.
    """

    needs_hidden = False

    def __init__(self, threshold: float):
        self.threshold = _check_threshold("threshold", threshold)

    def start(self) -> None:
        pass  # memoryless

    def should_stop(self, token: int, probs: torch.Tensor | None, hidden: torch.Tensor | None) -> bool:
        if probs is None:
            raise ValueError("ConfidenceStopper needs the drafter's distribution; a reviewing tier has none")
        return float(probs.max()) < self.threshold


@dataclass(frozen=True)
class AdaptiveLength:
    """Adaptive draft length for one tier that drafts alone (config `schedule.adaptive`).

    `rule` "specdec": SpecDec++ with the acceptance head in directory `head` (`cascade-service
    train-head`); "confidence": the baseline. The tier's K-matrix quota stays the block's cap.
    """

    rule: str
    threshold: float
    head: str | None = None

    def __post_init__(self) -> None:
        if self.rule not in ADAPTIVE_RULES:
            raise ValueError(f"rule must be one of {', '.join(ADAPTIVE_RULES)}, got {self.rule!r}")
        _check_threshold("threshold", self.threshold)
        if (self.rule == "specdec") != bool(self.head):
            raise ValueError("head: the specdec rule needs an acceptance head directory; confidence takes none")

    def to_dict(self) -> dict:
        return {"rule": self.rule, "threshold": self.threshold, "head": self.head}


StopperFactory = Callable[[AdaptiveLength], DraftStopper]


def make_stopper(spec: AdaptiveLength, load_head: Callable[[str], AcceptancePredictor]) -> DraftStopper:
    """A fresh stopper for one request's tier; `load_head` maps a head directory to a loaded head."""
    if spec.rule == "confidence":
        return ConfidenceStopper(spec.threshold)
    assert spec.head is not None
    return SpecDecPPStopper(load_head(spec.head), spec.threshold)
