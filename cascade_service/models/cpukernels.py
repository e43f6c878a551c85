"""The matrix products a model runs on the CPU: its weights' own layout for every large linear layer, and
int8 weights for a drafter that asks for them (the `int8` backend).

Measured on the 2-core host (AMD EPYC, AVX2, torch 2.13's MKL; docs/benchmarks.md "A real family"),
`F.linear(x, W)` for a few rows x is MKL's sgemm with W transposed, and its cost grows with the rows
long before the arithmetic should matter: Qwen2.5-Coder-1.5B's MLP projection (8,960 x 1,536) takes
3.8 ms for 1 row and 14.1 ms for 8, its LM head (151,936 x 1,536) 66 ms and 271 ms. The same product
written as `W @ x^T` (W as stored, one column per row of x) takes 4.3 / 7.5 ms and 68 / 91 ms, and
was never slower from 2 to 256 rows on those layers (small ones keep MKL's: `WEIGHT_MAJOR_MIN`). A
verification pass of k + 1 tokens is such a product: the 1.5B's pass of 8 tokens cost 2.9x its
one-token step, which made speculation on a real target hardly pay; `WeightMajorLinear` makes it
2.0x. For one row both forms give the same bits (it keeps MKL's);
for several they differ from one row at a time by rounding alone (about 1e-5 on these layers), as
`F.linear` itself does between a batched pass and single rows.

A drafter's numerics never reach the output (the target reviews every token), so a drafter may also
run int8 weights: per output channel, dequantized on the fly by fbgemm's dynamic-quantized linear
(activations quantized per pass). On the same host the 0.5B drafter's step falls from 241 to 69 ms.
Only the CPU has those kernels; the target never runs them (config refuses every backend but `hf`
there).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class WeightMajorLinear(nn.Linear):
    """nn.Linear computed as W @ x^T: the same function, the faster product for few rows on the CPU."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's own signature
        rows = input.reshape(-1, self.in_features)  # [N, in]
        if rows.shape[0] == 1 or input.dtype != self.weight.dtype:
            # one row: the same bits either way, and MKL's own product is the faster (523 against 571 ms a
            # 1.5B step, measured side by side)
            return F.linear(input, self.weight, self.bias)
        out = torch.mm(self.weight, rows.t()).t()  # [out, N] -> [N, out], a view
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*input.shape[:-1], self.out_features)


# The smallest weight (elements) that runs weight-major. Below it MKL's own product is as fast or faster:
# side by side on the 2-core host (2 to 16 rows, medians of 9; noisy, a test suite ran beside them),
# 64 x 64 took 1.2-1.3x longer weight-major, the 1.5B's k/v projection (256 x 1,536) 1.1-3.7x, 896 x 896
# 0.84-1.02x, while 2,048 x 512 took 0.46-0.76x and 1,536 x 1,536 0.32-0.47x.
WEIGHT_MAJOR_MIN = 1 << 20


def weight_major(module: nn.Module, min_weights: int = WEIGHT_MAJOR_MIN) -> int:
    """Run every plain float32 nn.Linear of a CPU model with at least `min_weights` weights as
    WeightMajorLinear (the same weights, in place); returns how many. Other devices and dtypes keep
    their kernels (cuBLAS has no such gap, and bf16 products on this CPU take another path)."""
    count = 0
    for layer in module.modules():
        if (
            type(layer) is nn.Linear
            and layer.weight.device.type == "cpu"
            and layer.weight.dtype == torch.float32
            and layer.weight.numel() >= min_weights
        ):
            layer.__class__ = WeightMajorLinear
            count += 1
    return count


def quantize_int8(module: Any) -> Any:
    """A CPU drafter's linear layers with int8 weights (per output channel) and dynamically quantized
    activations; the embedding and norms stay as they are. Raises ValueError off the CPU."""
    device = next(module.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"backend int8 runs on the CPU only (fbgemm's kernels); this tier is on {device}")
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        # torch marks its eager quantization API as moving to torchao; the pinned range (< 2.15) has
        # it, and torch's weight-only int8 product (_weight_int8pack_mm) is no substitute on AVX2:
        # measured 3.8 ms where this takes 0.23 ms (4,864 x 896, one row; float32 1.8 ms).
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        return quantize_dynamic(module, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)


def packed_parameters(module: nn.Module) -> int:
    """The weights an int8 model keeps packed, which `parameters()` does not list (0 for any other)."""
    from torch.ao.nn.quantized.dynamic import Linear as Int8Linear

    return sum(layer.in_features * layer.out_features for layer in module.modules() if isinstance(layer, Int8Linear))
