"""The KV pool on CUDA: batched passes over pool slots match each row's own forward on the same device
and dtype (index tensors, the 4D mask and growth all on the GPU), and concurrent greedy requests stay
the target's path."""

from __future__ import annotations

import pytest
import torch

from cascade_service.config import GenerationConfig, MaGConfig, ModelTierConfig, make_cascade
from cascade_service.engine import Engine
from cascade_service.models.batching import Pass, forward_batch
from cascade_service.models.hf import HFModel
from cascade_service.zoo.tiny import random_prompts

from ..helpers.threads import concurrently
from .oracle import GPU, assert_greedy, load

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="needs CUDA")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pool_passes_on_cuda_match_each_rows_forward(tiny_family, dtype):
    model = HFModel.load(tiny_family["target"], dtype, "cuda")
    prompts = random_prompts(5, 200, seed=6)  # past the pool's first capacity: it grows on the GPU
    caches = [model.new_cache() for _ in prompts]
    tol = 1e-4 if dtype == "float32" else 5e-2
    with torch.inference_mode():
        forward_batch(model, [Pass(p[: 150 + i], c, 1, False) for i, (p, c) in enumerate(zip(prompts, caches))])
        order = [4, 1, 3]  # out of slot order: gathered
        got = forward_batch(model, [Pass(prompts[i][150 + i : 153 + i], caches[i], 3, False) for i in order])
        for i, rows in zip(order, got):
            assert rows.device.type == "cuda"
            torch.testing.assert_close(rows, model.full_logits(prompts[i][: 153 + i])[-3:], atol=tol, rtol=tol)
    assert model.kv_pool.keys[0].device.type == "cuda" and model.kv_pool.capacity >= 256


def test_concurrent_greedy_requests_on_cuda_pools_are_the_targets_path(tiny_family):
    target = ModelTierConfig("target", str(tiny_family["target"]), device="cuda")
    engine = Engine(
        make_cascade(
            target, [ModelTierConfig("mid", str(tiny_family["mid"]), device="cuda"), MaGConfig()], [[3, 1], [0, 3]], 1.5
        )
    )
    for model in engine.models():
        model.enable_batching()
    oracle_model = load(tiny_family["target"], "cuda", "float32")
    prompts = random_prompts(6, 12, seed=13)
    outputs: list[list[int]] = [[] for _ in prompts]

    def run(i: int) -> None:
        outputs[i] = engine.generate(prompts[i], GenerationConfig(max_new_tokens=24)).token_ids

    concurrently(len(prompts), run)
    for prompt, got in zip(prompts, outputs):
        assert_greedy(oracle_model, prompt, got, 24)
    assert any(size > 1 for size in engine.target.batcher.batch_sizes)
