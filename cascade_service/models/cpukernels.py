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

Where torch has oneDNN (its x86 builds), a large layer's weight is instead packed once, at load, into
oneDNN's blocked layout for a few rows (`PackedLinear`, `ROWS_HINT`), and every pass runs oneDNN's
inner product over it: the product inductor emits for CPU linear layers. Side by side on the same
host (medians of 9), 8 rows: 5.9 against 7.8 ms (8,960 x 1,536), 0.48 against 1.19 ms (1,536 x
1,536), 104 against 122 ms (the LM head); one row about as fast as MKL's or faster. Its results
differ from `F.linear`'s by rounding alone (about 3e-6 relative), one row included. The dense weight
is dropped (the packed copy replaces it, no second copy in memory), so a packed layer has no
`.weight`: a weight tied to another layer (an LM head sharing the embedding) stays dense, weight-major.

A drafter's numerics never reach the output (the target reviews every token), so a drafter may also
run int8 weights: per output channel, dequantized on the fly by fbgemm's dynamic-quantized linear
(activations quantized per pass). On the same host the 0.5B drafter's step falls from 241 to 69 ms.
Only the CPU has those kernels; the target never runs them (config refuses every backend but `hf`
there).
"""

from __future__ import annotations

import functools
import warnings
from concurrent.futures import ThreadPoolExecutor
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


# The rows oneDNN blocks a packed weight for: a verification's k + 1 (k = 6 or 7 on the real family).
# Packed for 8, one row ran as fast as MKL's own product and 2 to 16 rows faster than weight-major;
# packed for 1, one row was faster still but 8 rows slower (measured on the layers named above).
ROWS_HINT = 8


class PackedLinear(nn.Linear):
    """nn.Linear over a weight oneDNN holds packed (`pack`): no `.weight`, the same function within
    rounding."""

    packed: torch.Tensor  # oneDNN's opaque tensor: the weight in its blocked layout

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's own signature
        return torch.ops.mkldnn._linear_pointwise(input, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for {ROWS_HINT} rows"


@functools.cache  # once a process: every model load asks
def can_pack() -> bool:
    """Whether this torch has oneDNN's packed inner product (x86 builds do; others run weight-major):
    a 2 x 2 layer of ones, packed, must give 2 for each output."""
    if not torch.backends.mkldnn.is_available():
        return False
    layer = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    try:
        out = pack(layer)(torch.ones(1, 2))
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.equal(out, torch.full((1, 2), 2.0)))


def pack(layer: nn.Linear) -> PackedLinear:
    """`layer` as a PackedLinear, in place: its weight packed, the dense one dropped."""
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), ROWS_HINT)
    del layer.weight  # the packed copy replaces it (nn.Module drops the parameter)
    layer.__class__ = PackedLinear
    layer.packed = packed
    return layer  # type: ignore[return-value]  # its class was just set


def fast_cpu_linears(module: nn.Module, min_weights: int = WEIGHT_MAJOR_MIN, packing: bool | None = None) -> int:
    """Run every plain float32 nn.Linear of a CPU model with at least `min_weights` weights on the faster
    product for few rows, in place: PackedLinear where oneDNN packs (`packing`; None: `can_pack()`) and
    the weight is its own, WeightMajorLinear otherwise; returns how many. Other devices and dtypes keep
    their kernels (cuBLAS has no such gap, and bf16 products on this CPU take another path)."""
    packing = can_pack() if packing is None else packing
    # A parameter listed under two names is tied (an LM head sharing the embedding): packing would keep
    # a second copy of it, and the other user reads `.weight`.
    seen: dict[int, int] = {}
    for _, parameter in module.named_parameters(remove_duplicate=False):
        seen[id(parameter)] = seen.get(id(parameter), 0) + 1
    count = 0
    for layer in module.modules():
        if (
            type(layer) is nn.Linear
            and layer.weight.device.type == "cpu"
            and layer.weight.dtype == torch.float32
            and layer.weight.numel() >= min_weights
        ):
            if packing and seen[id(layer.weight)] == 1:
                pack(layer)
            else:
                layer.__class__ = WeightMajorLinear
            count += 1
    return count


def quantize_int8(module: Any) -> Any:
    """A CPU drafter's linear layers with int8 weights (per output channel) and dynamically quantized
    activations, in place; the embedding and norms stay as they are. Raises ValueError off the CPU.

    The same modules `quantize_dynamic(module, {nn.Linear: per_channel_dynamic_qconfig})` makes (the
    same observer, weights and packing: their outputs are equal to the bit; tests/integration/
    test_cpu_kernels.py), built without its waste: its `Linear.from_float` first constructs each layer
    at full size, which packs an uninitialized full-size weight only to replace it. On Qwen2.5-Coder
    0.5B the wasted packs took 1.3 of the 6.8 s the conversion took."""
    device = next(module.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"backend int8 runs on the CPU only (fbgemm's kernels); this tier is on {device}")
    with warnings.catch_warnings():
        # torch marks its eager quantization API as moving to torchao; the pinned range (< 2.15) has
        # it, and torch's weight-only int8 product (_weight_int8pack_mm) is no substitute on AVX2:
        # measured 3.8 ms where this takes 0.23 ms (4,864 x 896, one row; float32 1.8 ms).
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        from torch.ao.nn.quantized.dynamic import Linear as Int8Linear
        from torch.ao.quantization import per_channel_dynamic_qconfig

        layers = [
            (parent, name, child)
            for parent in module.modules()
            for name, child in parent.named_children()
            if type(child) is nn.Linear
        ]
        # Layers convert independently and torch's quantize and pack release the GIL: on the 2-core host
        # the 0.5B's 169 layers took 2.9-3.1 s in two threads against 4.8-5.6 s in one (and 6.1-6.8 s
        # through quantize_dynamic), its whole int8 load 3.1-3.3 s against 6.3-6.8 s.
        threads = max(1, min(torch.get_num_threads(), len(layers)))
        with ThreadPoolExecutor(threads) as pool:  # a fresh observer per layer: they hold state
            converted = list(
                pool.map(
                    lambda layer: _int8_linear(layer, per_channel_dynamic_qconfig.weight(), Int8Linear),
                    [child for _, _, child in layers],
                )
            )
        for (parent, name, _), layer in zip(layers, converted, strict=True):
            setattr(parent, name, layer)
    return module


def _int8_linear(layer: nn.Linear, observer: Any, int8_linear: Any) -> nn.Module:
    """`layer` as torch's dynamic int8 Linear, its weight quantized as `observer` says (what
    `Linear.from_float` does, but the module is made at 1 x 1 and packed once, with the real weight)."""
    with torch.no_grad():
        weight = layer.weight.detach().float()
        observer(weight)
        scales, zero_points = observer.calculate_qparams()
        qweight = torch.quantize_per_channel(
            weight, scales.to(torch.double), zero_points.to(torch.int64), observer.ch_axis, torch.qint8
        )
        out = int8_linear(1, 1, bias_=layer.bias is not None, dtype=torch.qint8)
        out.in_features, out.out_features = layer.in_features, layer.out_features
        out.set_weight_bias(qweight, None if layer.bias is None else layer.bias.detach())
    return out


def packed_parameters(module: nn.Module) -> int:
    """The weights a model keeps packed (int8 layers, PackedLinear), which `parameters()` does not list."""
    from torch.ao.nn.quantized.dynamic import Linear as Int8Linear

    return sum(
        layer.in_features * layer.out_features
        for layer in module.modules()
        if isinstance(layer, (Int8Linear, PackedLinear))
    )
