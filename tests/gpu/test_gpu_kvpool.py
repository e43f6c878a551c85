"""The paged KV pool on CUDA: batched passes over pool blocks match each row's own forward on the same
device and dtype (index tensors, the 4D mask, growth and copy on write all on the GPU), a prefix found
in the cache gives the same logits, and concurrent greedy requests stay the target's path."""

from __future__ import annotations

import pytest
import torch

from cascade_service.config import GenerationConfig, MaGConfig, ModelTierConfig, make_cascade
from cascade_service.inprocess import InProcess
from cascade_service.models.batching import Pass, forward_batch
from cascade_service.models.hf import HFModel
from cascade_service.zoo.tiny import random_prompts

from ..helpers.threads import concurrently
from .oracle import GPU, assert_greedy, load

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="needs CUDA")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pool_passes_on_cuda_match_each_rows_forward(tiny_family, dtype):
    model = HFModel.load(tiny_family["target"], dtype, "cuda")
    prompts = random_prompts(5, 200, seed=6)  # 65 blocks: past the pool's first 32, it grows on the GPU
    caches = [model.new_cache() for _ in prompts]
    tol = 1e-4 if dtype == "float32" else 5e-2
    with torch.inference_mode():
        forward_batch(model, [Pass(p[: 150 + i], c, 1, False) for i, (p, c) in enumerate(zip(prompts, caches))])
        order = [4, 1, 3]  # any rows, any order: their blocks gathered
        got = forward_batch(model, [Pass(prompts[i][150 + i : 153 + i], caches[i], 3, False) for i in order])
        for i, rows in zip(order, got):
            assert rows.device.type == "cuda"
            torch.testing.assert_close(rows, model.full_logits(prompts[i][: 153 + i])[-3:], atol=tol, rtol=tol)
    assert model.kv_pool.keys[0].device.type == "cuda" and model.kv_pool.capacity > 32


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cached_prefix_on_cuda_gives_the_same_logits(tiny_family, dtype):
    from cascade_service.core.types import Context

    model = HFModel.load(tiny_family["target"], dtype, "cuda")
    header = random_prompts(1, 64, seed=7)[0]
    tol = 1e-4 if dtype == "float32" else 5e-2
    with torch.inference_mode():
        model.scorer().logits(Context(header + [3], 65), 1)  # publishes the header's 4 blocks
        reader = model.scorer()
        prompt = header + [5, 6, 7]
        rows = reader.logits(Context(prompt, len(prompt)), 2)
        assert reader.tokens_cached == 64
        torch.testing.assert_close(rows, model.full_logits(prompt)[-2:], atol=tol, rtol=tol)
        again = reader.logits(Context(header, 64), 1)  # re-feeds position 63: a copy of the shared block
        torch.testing.assert_close(again, model.full_logits(header)[-1:], atol=tol, rtol=tol)


def test_concurrent_greedy_requests_on_cuda_pools_are_the_targets_path(tiny_family):
    target = ModelTierConfig("target", str(tiny_family["target"]), device="cuda")
    engine = InProcess(
        make_cascade(
            target, [ModelTierConfig("mid", str(tiny_family["mid"]), device="cuda"), MaGConfig()], [[3, 1], [0, 3]], 1.5
        )
    )
    oracle_model = load(tiny_family["target"], "cuda", "float32")
    prompts = random_prompts(6, 12, seed=13)
    outputs: list[list[int]] = [[] for _ in prompts]

    def run(i: int) -> None:
        outputs[i] = engine.generate(prompts[i], GenerationConfig(max_new_tokens=24)).token_ids

    concurrently(len(prompts), run)
    for prompt, got in zip(prompts, outputs):
        assert_greedy(oracle_model, prompt, got, 24)
    assert any(size > 1 for size in engine.target.batcher.batch_sizes)
