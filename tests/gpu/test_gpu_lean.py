"""The lean backend on CUDA: its passes match transformers' on the same device and dtype, and a cascade
of lean drafters on the GPU stays the target's greedy path."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from cascade_service.config import GenerationConfig, ModelTierConfig, make_cascade
from cascade_service.engine import Engine
from cascade_service.models.hf import HFModel
from cascade_service.zoo.tiny import random_prompts

from ..helpers.bf16 import bf16_ulps
from .oracle import GPU, assert_greedy, load

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="needs CUDA")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lean_pass_on_cuda_matches_transformers(tiny_family, dtype):
    models = [HFModel.load(tiny_family["close"], dtype, "cuda", backend=b) for b in ("hf", "lean")]
    prompt = random_prompts(1, 20, seed=5)[0]
    outs = []
    for model in models:
        cache = DynamicCache()
        with torch.inference_mode():
            model.forward_now(prompt[:16], cache, 1)
            outs.append(model.forward_now(prompt[16:], cache, 4))
    assert outs[1].device.type == "cuda"
    if dtype == "float32":
        torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
        return
    # bfloat16: the lean forward rounds where transformers does (RMSNorm in float32, rounded, then times
    # the weight; rotary in float32, rounded; the same SDPA call), so what is left is the fused q/k/v
    # and gate/up matmuls summing in another order: about one bf16 spacing of a logit, 2 with margin
    # (tests/integration/test_lean.py argues it and checks it on the CPU, where the two are equal).
    # Unverified on a GPU since that change (issue 48): cuBLAS may pick other kernels for the fused
    # shapes. Before it, an H200 measured up to 0.31 apart (79 of 1,280 logits beyond 0.05).
    off = bf16_ulps(outs[1], outs[0])
    assert off.max() <= 2, f"lean bf16 logits {off.max():.0f} spacings from transformers' ({(off > 2).sum()} beyond 2)"


def test_greedy_cascade_with_lean_cuda_drafters_is_the_targets_path(tiny_family):
    drafters = [ModelTierConfig(n, str(tiny_family[n]), device="cuda", backend="lean") for n in ("close", "mid")]
    target = ModelTierConfig("target", str(tiny_family["target"]), device="cuda")
    engine = Engine(make_cascade(target, drafters, [[3, 2], [0, 4]], 1.0))
    model = load(tiny_family["target"], "cuda", "float32")
    for prompt in random_prompts(2, 12, seed=9):
        got = engine.generate(prompt, GenerationConfig(max_new_tokens=24)).token_ids
        assert_greedy(model, prompt, got, 24)
