"""Toy language models over a tiny vocabulary, for exact-distribution tests of the core.

Logits depend on the last two tokens through fixed random tables, so the exact distribution of any
short continuation can be enumerated.
"""

from __future__ import annotations

import itertools
import math

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
    model: ToyScorer, prompt: list[int], length: int, sampling: SamplingParams
) -> dict[tuple, float]:
    """P(continuation) for every continuation of `length` tokens, by enumeration."""
    out = {}
    for seq in itertools.product(range(model.vocab), repeat=length):
        p, tokens = 1.0, list(prompt)
        for t in seq:
            p *= float(sampling.probs(model.row(tokens)[None], tokens)[0, t])
            tokens.append(t)
        out[seq] = p
    return out


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
