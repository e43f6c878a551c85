"""models.staticpass on cuda: a pass replayed from a captured CUDA graph gives the eager fixed-shape
pass's logits and writes the same keys; a bucket is captured once, and again after the pool grew.
Unverified until a GPU runs it (issue 49)."""

from __future__ import annotations

import pytest
import torch

from cascade_service.models.hf import HFModel
from cascade_service.models.staticpass import CapturedPasses, static_forward, static_inputs
from cascade_service.zoo.tiny import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_replayed_pass_equals_the_eager_one(tiny_family):
    model = HFModel.load(tiny_family["mid"], backend="lean", kv="pool", device="cuda")
    caches = [model.new_cache() for _ in range(3)]
    for cache, history in zip(caches, random_prompts(3, 30, seed=9)):
        with torch.inference_mode():
            model.forward_now(history, cache, 1)
    pool = model.kv_pool
    for cache in caches:
        pool.extend(cache, cache.length + 2, caches)
    inputs = static_inputs(caches, [[5, 6], [7, 8], [9, 10]], model.dtype, model.device)
    assert inputs is not None
    eager = static_forward(model.module, pool, inputs)
    keys = [t.clone() for t in pool.keys]
    captured = CapturedPasses(model.module, pool)
    first = captured.run(inputs)  # captured here
    again = captured.run(inputs)  # replayed
    assert captured.captures == 1
    torch.testing.assert_close(first, eager)
    torch.testing.assert_close(again, eager)
    for before, after in zip(keys, pool.keys):
        torch.testing.assert_close(before, after)  # the same keys written to the same slots
