"""Toy language models over a tiny vocabulary, for exact-distribution tests of the core.

Logits depend on the last two tokens through fixed random tables, so the exact distribution of any
short continuation can be enumerated.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import ClassVar

import torch

from cascade_service.core.sampling import SamplingParams
from cascade_service.core.types import Context


class ToyScorer:
    def __init__(
        self,
        name: str,
        vocab: int,
        seed: int,
        scale: float = 2.0,
        base: ToyScorer | None = None,
        noise: float = 0.0,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ):
        g = torch.Generator().manual_seed(seed)
        if base is None:
            last = torch.randn(vocab, vocab, generator=g) * scale
            before = torch.randn(vocab, vocab, generator=g) * scale / 2
        else:  # a drafter that resembles `base`
            last = base.tables[0] + torch.randn(vocab, vocab, generator=g) * noise
            before = base.tables[1] + torch.randn(vocab, vocab, generator=g) * noise
        # Drawn in float32 on the CPU, so a tier's numbers do not depend on where it or its base runs;
        # its logits come out in its dtype on its device, as a model's would.
        self.tables = (last, before)
        self.last = last.to(device=device, dtype=dtype)
        self.before = before.to(device=device, dtype=dtype)
        self.name = name
        self.vocab = vocab
        self.tokens_processed = 0

    def row(self, tokens: list[int]) -> torch.Tensor:
        out = self.last[tokens[-1]].clone()
        if len(tokens) > 1:
            out += self.before[tokens[-2]]
        return out

    def logits(self, ctx: Context, n: int) -> torch.Tensor:
        end = len(ctx.tokens)
        self.tokens_processed += n
        return torch.stack([self.row(ctx.tokens[: end - n + 1 + j]) for j in range(n)])


def exact_distribution(
    model: ToyScorer, prompt: list[int], length: int, sampling: SamplingParams, rule: ToyGrammar | None = None
) -> dict[tuple, float]:
    """P(continuation) for every continuation of `length` tokens, by enumeration (under `rule`'s mask,
    applied as a logits processor would, when given)."""
    out = {}
    for seq in itertools.product(range(model.vocab), repeat=length):
        p, tokens = 1.0, list(prompt)
        for i, t in enumerate(seq):
            allowed = None if rule is None else rule.allowed(seq[:i])[None]
            p *= float(sampling.probs(model.row(tokens)[None], tokens, allowed)[0, t])
            tokens.append(t)
        out[seq] = p
    return out


class ToyGrammar:
    """A grammar over the toy vocabulary with core.grammar.GrammarMask's interface, for the exactness
    tests of the core (llguidance needs a real tokenizer): after token a, only FOLLOW[a] may come; the
    first output token follows the prompt's last. A state with one allowed token forces it, so the
    cascade's grammar drafts (GrammarMask.forced) are exercised too."""

    FOLLOW: ClassVar[dict[int, tuple[int, ...]]] = {0: (1, 2), 1: (3,), 2: (0, 1, 3), 3: (0, 2)}

    def __init__(self, vocab: int, last: int):
        self.vocab, self.last, self.at = vocab, last, 0
        self.out: list[int] = []

    def allowed(self, out: Sequence[int]) -> torch.Tensor:
        previous = out[-1] if out else self.last
        mask = torch.zeros(self.vocab, dtype=torch.bool)
        mask[list(self.FOLLOW[previous])] = True
        return mask

    def anchor(self, length: int) -> None:
        self.at = length

    def masks(self, context: Sequence[int], block: Sequence[int]) -> tuple[int, torch.Tensor] | None:
        out = self.out + list(context[self.at :])
        if not self._follows(self.out, list(context[self.at :])):
            return None
        valid = 0
        while valid < len(block) and self.allowed(out + list(block[:valid]))[block[valid]]:
            valid += 1
        return valid, torch.stack([self.allowed(out + list(block[:i])) for i in range(valid + 1)])

    def mask(self, context: Sequence[int]) -> torch.Tensor | None:
        masked = self.masks(context, ())
        return None if masked is None else masked[1][0]

    def _follows(self, out: list[int], tail: list[int]) -> bool:
        return all(self.allowed(out + tail[:i])[t] for i, t in enumerate(tail))

    def forced(self, limit: int) -> list[int]:
        forced: list[int] = []
        while len(forced) < limit and int((mask := self.allowed(self.out + forced)).sum()) == 1:
            forced.append(int(mask.nonzero()))
        return forced

    def advance(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            assert self.allowed(self.out)[token], (self.out, token)
            self.out.append(token)


def chi_square_rejects(
    counts: dict[tuple, int], expected: dict[tuple, float], n: int, z: float = 3.09
) -> tuple[bool, float, float]:
    """Pearson chi-square goodness of fit at alpha ~= 0.001 (z = 3.09), Wilson-Hilferty critical value.

    Cells with expected count < 5 are pooled so the chi-square approximation holds.
    """
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for key, p in expected.items():
        e = p * n
        if e < 5:
            pooled_obs += counts.get(key, 0)
            pooled_exp += e
            continue
        stat += (counts.get(key, 0) - e) ** 2 / e
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        cells += 1
    df = cells - 1
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > crit, stat, crit
