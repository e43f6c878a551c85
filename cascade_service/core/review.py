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

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from .placement import host_argmax, host_at, host_race, host_reads, keyed_exponentials, uniform
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

    def decide(self, block: Draft, scores: torch.Tensor, leniency: float = 1.0, probs_unread: bool = True) -> Verdict:
        """`review` on `scores` ([len(block) + 1, V] logits after the request's bias, penalties and mask:
        `SamplingParams.scores`), computing only the probabilities something reads. With `probs_unread`
        (`ReviewRequest.probs_unread`: the target's verdict, and an inner tier's whose every reviewer is
        strict) a draft is kept while it is the scores' argmax (transformers' greedy rule itself), and at
        leniency l > 1 a draft that is not is kept when its probability passes its proposal's over l,
        which needs its row's softmax alone; the verdict's token_probs are NaN. Otherwise the verdict's
        rows are read above, so every row's probabilities are computed once and reviewed (`review`).
        On the CPU a review's softmax and reads are a round's dearest Python steps."""
        if not probs_unread or (scores.device.type != "cpu" and leniency > 1.0):
            # read above, or on a GPU, where every read to the host is a sync: every row's at once
            return self.review(block, torch.softmax(scores, dim=-1), leniency, NO_DRAWS)
        best = host_argmax(scores)
        accepted = 0
        for i, x in enumerate(block.tokens):
            if x != best[i]:
                # leniency: the draft's probability at its row (that row's softmax alone) against its proposal's
                if leniency <= 1.0 or not _drafted_prob(scores[i : i + 1], x) > block.token_probs[i] / leniency:
                    break
            accepted += 1
        return Verdict(accepted, best[accepted], [math.nan] * (accepted + 1), None)


def _drafted_prob(row: torch.Tensor, token: int) -> float:
    """softmax(row)[token] for one [1, V] row of scores, read as `host_reads` reads a draft's probability."""
    return host_reads(torch.softmax(row, dim=-1), [token])[2][0]


# The generator of calls that draw nothing (a greedy review, greedy drafting, keyed draws): one unseeded one
# shared, rather than a generator made per call on a round's critical path.
NO_DRAWS = torch.Generator()


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
        token_probs = host_at(dists, tokens)
        return Verdict(accepted, token, token_probs, dists)


class KeyedReview:
    """Temperature > 0, a lossless request: the review of draws keyed by position (core.sampling `race`).

    The reviewer's token at block position i is its race winner under the request's noise at sequence
    position start + i; a draft is kept when it is that token, so the emitted tokens are the reviewer's
    own draws whatever the drafts were. At the target (l = 1) the output is then a function of the
    seed and the target's distributions alone, distributed exactly as the target's (each position's
    noise is independent of every earlier position's, which alone decided the prefix): the same seed
    gives the same tokens under plain decoding, any schedule and any load. Acceptance is that of the
    Gumbel coupling, P(race under q = race under p), at most the maximal coupling's 1 - TV(p, q)
    speculative sampling reaches; a point-mass draft (MaG) is kept with probability p(x) under both.

    An inner review (l > 1) also keeps a draft x whose score comes within a factor l of the winner's
    (l * p(x) / E_x >= max_v p(v) / E_v): a looser guess at what the target will draw, which cannot
    change the target's output. The verdict's rows are the reviewer's distributions at the emitted
    positions (what its own tokens are drawn from); the target's review does not read them.
    """

    draws = False  # nothing from the call's generator: the noise comes from (seed, position)

    def __init__(self, seed: int, start: int):
        self.seed = seed
        self.start = start  # the sequence position of the block's first token

    def review(self, block: Draft, target_probs: torch.Tensor, leniency: float, generator: torch.Generator) -> Verdict:
        k, drafts = len(block), block.tokens
        # The rows' races in chunks: on a GPU all k + 1 at once (one read to the host); on the CPU one at a
        # time up to the first rejection, since a row's noise is a re-seed and V draws (25 us at the shipped
        # family's 2,048 tokens, 0.74 ms at Qwen2.5's 151,936 on this host) and where drafts disagree (a
        # MaG copy of 10-20 tokens at T = 1) most rows are never reached. Either way each row is its
        # position's race, so the verdict is the same.
        chunk = 1 if target_probs.device.type == "cpu" else k + 1
        accepted, winner, row = 0, -1, 0
        while winner < 0:
            end = min(k + 1, row + chunk)
            noise = keyed_exponentials(end - row, target_probs, self.seed, self.start + row)
            best, best_score, drafted = host_race(target_probs[row:end], noise, drafts[row:end])
            for j, i in enumerate(range(row, end)):
                if i == k or (drafts[i] != best[j] and not (leniency > 1.0 and leniency * drafted[j] >= best_score[j])):
                    winner = best[j]
                    break
                accepted += 1
            row = end
        tokens = drafts[:accepted] + [winner]
        dists = target_probs[: accepted + 1]
        token_probs = host_at(dists, tokens)
        return Verdict(accepted, tokens[-1], token_probs, dists)


def rule_for(greedy: bool) -> ReviewRule:
    return GreedyReview() if greedy else SamplingReview()
