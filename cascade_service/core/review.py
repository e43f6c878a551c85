"""Review rules: how a reviewer judges a draft block it scored in one forward pass.

Speculative sampling (Leviathan et al. 2023; CS Drafting Algorithm 1, review step): walk the block
left to right, keep draft x with probability min(1, l * target(x) / draft(x)); at the first rejection
draw the replacement from norm(max(0, target - draft)); if every draft is kept, draw a bonus token from
the target's next distribution. l is the leniency: 1 at the final target review, >= 1 at inner ones.
`target_probs` may be any distribution pi the caller built (lossy rules in later work pass their own).
Rules run where `target_probs` lives: the block's rows arrive there already (`Draft.for_reviewer`),
and what a rule makes or draws it makes there too (core.placement).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .placement import host_reads, uniform
from .sampling import residual, reviewed_proposal, sample
from .types import Draft


@dataclass
class Verdict:
    """What a review decided: `accepted` leading drafts kept, then `token` (replacement or bonus).

    `token_probs` holds the emitted tokens' proposal probabilities and `dists` their full proposal
    distributions ([accepted + 1, V]; sampling mode, or greedy drafts that carry rows) for a reviewer
    one level up. `off_target` and `tv` account a lossy final review (core.verify): emitted tokens
    drawn from a distribution other than the reviewer's, and the summed total-variation deviation.
    """

    accepted: int
    token: int
    token_probs: list[float]
    dists: torch.Tensor | None
    off_target: int = 0
    tv: float = 0.0
    ll_loss: float = 0.0  # expected drop in the reviewer's log-likelihood (core.verify)
    # Per emitted token (when the review was asked for them): its log-probability under the reviewer's
    # distribution, and the most likely alternatives.
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability and the `top` (token, log-probability) pairs, most likely first,
    from the distribution the reviewer sampled or chose it from."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(probs: torch.Tensor, tokens: list[int], top: int) -> tuple[TokenLogprob, ...]:
    """For tokens[i] at row i of `probs` ([>= len(tokens), V]): its log-probability and the `top` best."""
    rows = probs[: len(tokens)].float().clamp_min(0.0).log()
    chosen = rows.gather(1, torch.tensor(tokens, device=rows.device)[:, None])[:, 0].tolist()
    best = rows.topk(min(top, rows.shape[-1]), dim=-1) if top > 0 else None
    out = []
    for i, token in enumerate(tokens):
        pairs = tuple(zip(best.indices[i].tolist(), best.values[i].tolist(), strict=True)) if best is not None else ()
        out.append(TokenLogprob(token, chosen[i], pairs))
    return tuple(out)


class ReviewRule(Protocol):
    draws: bool  # whether a review may draw from its generator (greedy exact review never does)

    def review(self, block: Draft, target_probs: torch.Tensor, leniency: float, generator: torch.Generator) -> Verdict:
        """target_probs: [len(block) + 1, V]; row i scores block position i, the last row the bonus.
        `block.dists`, when present, is on target_probs' device, in float32 (`Draft.for_reviewer`)."""
        ...


class GreedyReview:
    """Temperature 0: keep a draft while it is the reviewer's argmax.

    Leniency (authors' greedy rule, csd.py/model.py): with l > 1 also keep x when
    target(x) > draft(x) / l. The final review passes l = 1, so the output is the target's greedy one.
    """

    draws = False

    def review(self, block: Draft, target_probs: torch.Tensor, leniency: float, generator: torch.Generator) -> Verdict:
        k = len(block)
        # Every value the decision reads, in one read: each row's argmax and its probability [k + 1], each
        # draft's probability [k].
        best, p_best, p_drafted = host_reads(target_probs, block.tokens)
        accepted = 0
        for i in range(k):
            x = block.tokens[i]
            if x != best[i] and not (leniency > 1.0 and p_drafted[i] > block.token_probs[i] / leniency):
                break
            accepted += 1
        token = best[accepted]
        token_probs = p_drafted[:accepted] + [p_best[accepted]]
        # Drafts that carry rows (SamplingParams.rows) get this reviewer's rows for the level above.
        dists = None if block.dists is None else target_probs[: accepted + 1]
        return Verdict(accepted, token, token_probs, dists)


class SamplingReview:
    """Temperature > 0: speculative sampling with leniency, reporting true proposal distributions."""

    draws = True

    def review(self, block: Draft, target_probs: torch.Tensor, leniency: float, generator: torch.Generator) -> Verdict:
        k = len(block)
        assert block.dists is not None or k == 0, "sampling review needs the drafts' distributions"
        drafts = block.dists if block.dists is not None else target_probs[:0]  # [k, V]
        accepted = k
        if k:
            rows = torch.arange(k, device=target_probs.device)
            p_x = target_probs[rows, block.tokens]  # [k]
            q_x = drafts[rows, block.tokens].clamp_min(1e-30)  # [k]
            keep = uniform((k,), target_probs, generator) < torch.clamp(leniency * p_x / q_x, max=1.0)
            rejected = (~keep).nonzero()
            accepted = int(rejected[0]) if len(rejected) else k
        if accepted < k:
            token = sample(residual(target_probs[accepted], drafts[accepted]), generator)
        else:
            token = sample(target_probs[k], generator)
        # Emitted positions 0..accepted: reviewed drafts (the replacement included) follow the
        # reviewed mixture; a bonus token follows the reviewer's own distribution.
        n_reviewed = min(accepted + 1, k)
        dists = reviewed_proposal(target_probs[:n_reviewed], drafts[:n_reviewed], leniency) if k else target_probs[:0]
        if accepted == k:
            dists = torch.cat([dists, target_probs[k : k + 1]])
        tokens = block.tokens[:accepted] + [token]
        token_probs = dists[torch.arange(accepted + 1, device=dists.device), tokens].tolist()
        return Verdict(accepted, token, token_probs, dists)


def rule_for(greedy: bool) -> ReviewRule:
    return GreedyReview() if greedy else SamplingReview()
