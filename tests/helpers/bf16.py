"""Distances in bfloat16 spacings: how the lean forward's bf16 tests state their tolerance."""

from __future__ import annotations

import torch


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in bfloat16 spacings at each of want's values (8 significant bits: 2^(e-7) for
    |x| in [2^e, 2^(e+1)); below 1, the spacing at 1, so near-zero logits are not held to nothing)."""
    spacing = 2.0 ** (torch.floor(torch.log2(want.float().abs().clamp_min(1.0))) - 7)
    return (got.float() - want.float()).abs() / spacing
