"""Turning logits into distributions and tokens, the same way for every tier.

Every tier's logits pass through one `SamplingParams`, so the draft and target distributions that
speculative sampling compares are processed identically: a request's logit_bias added to the logits,
then temperature, top-k, top-p and min-p, the order of `transformers`' logits warpers. The final review
verifies against the target's processed distribution, so the output is distributed exactly as the
target's under these controls; drafters get the same processing so that their drafts stay likely.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .limits import (
    check_logit_bias,
    check_min_p,
    check_penalty,
    check_repetition_penalty,
    check_temperature,
    check_top_k,
    check_top_p,
)
from .placement import PROBS_DTYPE, generator_for, host_race, keyed_exponentials


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_p 1, top_k 0 and min_p 0 keep the whole distribution.

    `rows`: greedy drafts carry their full distributions too (a final-verifier rule that compares
    whole distributions needs them, core.verify); sampling drafts always do.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    rows: bool = False
    top_k: int = 0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # ((token id, bias), ...), added to the logits first
    # Penalties on tokens already there (they need the sequence: `probs(logits, tokens)`): transformers'
    # repetition_penalty over the whole sequence, OpenAI's presence and frequency penalties over the
    # request's output, which starts at `output_start` (the request's context length).
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    output_start: int = 0

    def __post_init__(self) -> None:
        check_temperature(self.temperature)  # a tier's request off the wire is checked as the client's was
        check_top_p(self.top_p)
        check_top_k(self.top_k)
        check_min_p(self.min_p)
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))
        check_repetition_penalty(self.repetition_penalty)
        check_penalty("presence_penalty", self.presence_penalty)
        check_penalty("frequency_penalty", self.frequency_penalty)

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def carries_rows(self) -> bool:
        return self.rows or not self.greedy

    def probs(
        self, logits: torch.Tensor, tokens: Sequence[int] | None = None, allowed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[n, V] logits -> [n, V] float32 probabilities. Row i is the distribution after
        `tokens[: len(tokens) - n + 1 + i]` (the sequence a pass scored, its last n positions); only
        penalties read it, and with them it must be given.

        Greedy mode returns softmax at temperature 1: decisions use argmax, and greedy leniency compares
        these probabilities (the authors' rule), so they must not be sharpened.
        """
        logits = self.scores(logits, tokens, allowed)
        if self.greedy:
            return torch.softmax(logits, dim=-1)
        if self.temperature != 1.0:  # at 1 softmax's own shift gives the same floats: 15 of 24 us saved a call
            logits = sharpen(logits, self.temperature)
        if 0 < self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]  # ties with the k-th stay, as in transformers
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1.0:
            probs = _top_p(probs, self.top_p)
        if self.min_p > 0.0:
            kept = probs * (probs >= self.min_p * probs.amax(dim=-1, keepdim=True))
            probs = kept / kept.sum(dim=-1, keepdim=True)
        return probs

    def scores(
        self, logits: torch.Tensor, tokens: Sequence[int] | None = None, allowed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[n, V] logits -> [n, V] float32 logits after the request's logit bias, penalties and `allowed`
        mask (`probs`' arguments): what transformers' greedy search takes the argmax of, and what
        `probs` turns into probabilities."""
        logits = logits.to(PROBS_DTYPE)  # a bfloat16 tier's logits too: every review reads float32 (core.placement)
        if self.logit_bias:  # before everything, greedy included: it moves the argmax (OpenAI's logit_bias)
            ids, biases = zip(*self.logit_bias, strict=True)
            bias = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
            bias[list(ids)] = torch.tensor(biases, dtype=logits.dtype, device=logits.device)
            logits = logits + bias
        if self.penalized:
            if tokens is None:
                raise ValueError("penalties need the sequence the logits were scored over")
            logits = self._penalize(logits, tokens)
        if allowed is not None:  # a response format's mask ([n, V] bool), as a logits processor would apply it
            logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
        return logits

    def _penalize(self, logits: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
        n, vocab = logits.shape[-2], logits.shape[-1]
        seq = torch.tensor(list(tokens), dtype=torch.long, device=logits.device).clamp(0, vocab - 1)
        seen_end = len(tokens) - n + 1  # row 0 follows tokens[:seen_end]; row i also the block's first i
        later = torch.zeros(n, vocab, dtype=logits.dtype, device=logits.device)
        if n > 1:
            later[torch.arange(1, n), seq[seen_end : seen_end + n - 1]] = 1.0
        later = later.cumsum(dim=0)
        start = min(self.output_start, seen_end)
        if self.repetition_penalty != 1.0:  # transformers' RepetitionPenaltyLogitsProcessor, per row
            seen = (torch.bincount(seq[:seen_end], minlength=vocab).to(logits.dtype) + later) > 0
            scaled = torch.where(logits > 0, logits / self.repetition_penalty, logits * self.repetition_penalty)
            logits = torch.where(seen, scaled, logits)
        if self.presence_penalty or self.frequency_penalty:  # OpenAI's, over the output so far
            counts = torch.bincount(seq[start:seen_end], minlength=vocab).to(logits.dtype) + later
            logits = logits - self.frequency_penalty * counts - self.presence_penalty * (counts > 0).to(logits.dtype)
        return logits


def sharpen(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature, each row shifted so its maximum is 0 where the temperature is tiny
    (softmax is shift-invariant, and shifts by its own maximum anyway).

    The shift keeps a tiny temperature finite: dividing raw logits by 1e-38 overflows to +inf and
    softmax turns inf - inf into NaN, while shifted logits go to 0 at the maximum and -inf elsewhere,
    which is the greedy limit the temperature approaches. Above `SHIFT_BELOW` no float32 logit a model
    emits (|x| < 1e30) overflows, and the division alone is one op where the shift took three: on this
    host a sampled round runs these right after a forward pass, cold, at 12-20 us an op.
    """
    if temperature < SHIFT_BELOW:
        return (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    return logits / temperature


SHIFT_BELOW = 1e-6  # the temperature below which `sharpen` shifts before dividing


# On the CPU top-p first looks among each row's most likely tokens, this many, then a full sort: on Qwen2.5-Coder
# 0.5B's rows (151,936 tokens) a 7-row call took 63-82 ms sorting every row whole, 5.3-7.7 ms this way.
TOP_P_CANDIDATES = (64, 1024)


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    # Keep the smallest set of most likely tokens whose mass reaches top_p (always at least one). Where a
    # row's k most likely tokens hold top_p, every token kept is among them: the token after them has
    # at least top_p before it. On a GPU the full sort, with no read to the host to choose k.
    vocab = probs.shape[-1]
    tries = [k for k in TOP_P_CANDIDATES if k < vocab] if probs.device.type == "cpu" else []
    for k in tries:
        sorted_probs, order = probs.topk(k, dim=-1)  # [n, k], most likely first
        if bool((sorted_probs.sum(dim=-1) >= top_p).all()):
            break
    else:
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # [n, V]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, mass_before < top_p)
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a [V] distribution, drawn where `probs` lives (`generator`: the request's)."""
    return int(torch.multinomial(probs, 1, generator=generator_for(generator, probs.device)))


def residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, target - draft)), [..., V]: where a rejected draft's replacement is drawn from.

    If the difference has no mass (target == draft where it matters) rejection had probability 0;
    fall back to the target so the function is total.
    """
    diff = (target_probs - draft_probs).clamp_min(0.0)
    mass = diff.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, diff / mass.clamp_min(1e-30), target_probs)


def reviewed_proposal(target_probs: torch.Tensor, draft_probs: torch.Tensor, leniency: float) -> torch.Tensor:
    """The true distribution of the token a (lenient) review emits at one position, [..., V].

    A draft x ~ draft is kept with probability min(1, l * target(x) / draft(x)), else replaced by a
    sample of residual(target, draft). So the emitted token follows
        min(draft, l * target) + (1 - sum min(draft, l * target)) * residual.
    With l = 1 this is exactly `target`. With l > 1 it is not, and a reviewer above must judge the
    block against this mixture, not against the inner reviewer's `target` (the paper is silent;
    docs/algorithm.md "Leniency"), or the final output stops being distributed as the target model's.
    """
    if leniency == 1.0:
        return target_probs
    kept = torch.minimum(draft_probs, leniency * target_probs)
    rejected_mass = (1.0 - kept.sum(dim=-1, keepdim=True)).clamp_min(0.0)
    return kept + rejected_mass * residual(target_probs, draft_probs)


def race(probs: torch.Tensor, seed: int, start: int) -> list[int]:
    """The token at each of `probs`' rows ([n, V], row i the distribution at sequence position
    start + i) under the request's keyed noise: argmax_v p(v) / E_v with E ~ Exp(1) iid per token,
    the exponential race (Gumbel-max in another form), whose winner is distributed as p.

    Every tier draws a position's token this way from the same noise, so a drafter's token is the one
    the target draws exactly when the race goes the same way under both distributions, and the
    target's token at a position depends on (seed, position, its own distribution) alone: whatever
    was drafted before, a seed fixes the output (`review.KeyedReview`).
    """
    return host_race(probs, keyed_exponentials(len(probs), probs, seed, start), ())[0]
