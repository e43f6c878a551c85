"""models.staticpass on cuda: a pass replayed from a captured CUDA graph with new inputs copied in gives
the eager fixed-shape pass's logits over those inputs and writes their keys (a lean drafter and the
target's transformers forward); a bucket is captured once, and again after the pool's tensors moved; a
cascade whose tiers all replay graphs is the target's greedy path and reproducible per seed when
sampled."""

from __future__ import annotations

import pytest
import torch

from cascade_service.config import ModelTierConfig, make_cascade
from cascade_service.core.request import GenerationConfig
from cascade_service.engine.core import join_loop
from cascade_service.engine.loop import TaskLoop
from cascade_service.inprocess import InProcess
from cascade_service.models import chain
from cascade_service.models.batching import Pass, forward_batch
from cascade_service.models.graphs import CapturedPasses
from cascade_service.models.hf import HFModel
from cascade_service.models.kvpool import BLOCK
from cascade_service.models.staticpass import forward_static_rows, static_forward, static_inputs
from cascade_service.zoo.tiny import random_prompts

from .oracle import assert_greedy, load

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _prefilled(model: HFModel, rows: int, length: int, seed: int) -> list:
    caches = [model.new_cache() for _ in range(rows)]
    for cache, history in zip(caches, random_prompts(rows, length, seed=seed)):
        with torch.inference_mode():
            model.forward_now(history, cache, 1)
    return caches


@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_a_replayed_pass_equals_the_eager_one(tiny_family, backend):
    model = HFModel.load(tiny_family["mid"], backend=backend, kv="pool", device="cuda", graphs="off")
    caches = _prefilled(model, 3, 30, seed=9)
    pool = model.kv_pool
    for cache in caches:
        pool.extend(cache, cache.length + 2, caches)
    inputs = static_inputs(caches, [[5, 6], [7, 8], [9, 10]], model.device)
    other = static_inputs(caches, [[11, 12], [13, 14], [15, 16]], model.device)  # same slots, new ids
    assert inputs is not None and other is not None
    eager = static_forward(model.module, pool, other, model.dtype)
    other_keys = [t.clone() for t in pool.keys + pool.values]
    eager_first = static_forward(model.module, pool, inputs, model.dtype)
    first_keys = [t.clone() for t in pool.keys + pool.values]
    captured = CapturedPasses(model.module, pool, model.dtype)
    first = captured.run(inputs)  # captured here, over the first ids
    torch.testing.assert_close(first, eager_first)
    # Replay with the other ids copied in, over a pool that holds the first ids' keys at those slots:
    # the replay must compute from its new inputs and write their keys itself.
    again = captured.run(other)
    assert captured.captures == 1 and captured.runs == 2
    torch.testing.assert_close(again, eager)
    assert any(not torch.equal(a, b) for a, b in zip(first_keys, other_keys))  # the check below can fail
    for want, got in zip(other_keys, pool.keys + pool.values):
        torch.testing.assert_close(got, want)  # the new ids' keys, written by the replay


def test_buckets_are_captured_at_start_and_again_after_the_pool_moved(tiny_family):
    model = HFModel.load(tiny_family["mid"], backend="lean", kv="pool", device="cuda")
    join_loop(model, TaskLoop("gpu-static-test"), max_batch=4)
    runner = model.static
    assert isinstance(runner, CapturedPasses)
    assert runner.captures == 3 * 5  # rows 1, 2, 4 by tokens 1, 2, 4, 8, 16 at the first width
    caches = _prefilled(model, 2, 20, seed=4)
    got = forward_static_rows(model, [[3], [4]], caches)
    assert got is not None and runner.captures == 15  # a warm bucket: replayed, not captured
    before = runner.captures
    # The pool was sized before the warm capture (start_graphs), at what max_batch requests hold, so
    # only more blocks than it holds move its tensors: rows enough for that, whatever its size.
    pool = model.kv_pool
    generation, capacity = pool.generation, pool.capacity
    moved = _prefilled(model, capacity * BLOCK // 300 + 2, 300, seed=5)
    assert pool.generation > generation and pool.capacity > capacity and moved
    got = forward_static_rows(model, [[5], [6]], caches)
    assert got is not None and runner.captures == before + 1  # the moved pool: that bucket again
    for rows, history, new in zip(got, random_prompts(2, 20, seed=4), ([3, 5], [4, 6])):
        with torch.inference_mode():
            expected = model.module(input_ids=torch.tensor([history + new], device="cuda")).logits[0, -1:]
        torch.testing.assert_close(rows, expected.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cascade_replaying_graphs_is_the_targets_greedy_path(tiny_family, dtype):
    drafters = [
        ModelTierConfig(n, str(tiny_family[n]), dtype=dtype, device="cuda", backend="lean") for n in ("close", "mid")
    ]
    target = ModelTierConfig("target", str(tiny_family["target"]), dtype=dtype, device="cuda")
    engine = InProcess(make_cascade(target, drafters, [[3, 2], [0, 4]], 1.0))
    model = load(tiny_family["target"], "cuda", dtype)
    for prompt in random_prompts(3, 12, seed=19):
        got = engine.generate(prompt, GenerationConfig(max_new_tokens=32)).token_ids
        assert_greedy(model, prompt, got, 32)
    for tier in engine.core.models():
        runner = tier.static
        assert isinstance(runner, CapturedPasses), f"{tier.name}: graphs were dropped (see the log)"
        assert runner.captures > 0 and runner.runs > 0, tier.name


def test_sampled_output_on_graphs_is_reproducible_per_seed(tiny_family):
    drafters = [ModelTierConfig("mid", str(tiny_family["mid"]), device="cuda", backend="lean")]
    target = ModelTierConfig("target", str(tiny_family["target"]), device="cuda")
    engine = InProcess(make_cascade(target, drafters, [[4]], 1.0))
    prompt = random_prompts(1, 10, seed=23)[0]
    runs = [
        engine.generate(prompt, GenerationConfig(max_new_tokens=32, temperature=1.0, seed=seed)).token_ids
        for seed in (7, 7, 8)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]  # another seed, another draw (a 32-token tie would be a broken sampler)


@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_a_fixed_shape_pass_and_a_chains_steps_never_synchronize(tiny_family, backend, monkeypatch):
    # The CPU tests count Python-level reads only; here CUDA itself says whether anything between a
    # chain's first step and its one read at the end (or inside a fixed-shape pass) waits for the device.
    model = HFModel.load(tiny_family["mid"], backend=backend, kv="pool", device="cuda")
    join_loop(model, TaskLoop("gpu-sync-test"), max_batch=4)
    caches = _prefilled(model, 2, 20, seed=6)
    pool = model.kv_pool
    for cache in caches:
        pool.extend(cache, cache.length + 2, caches)
    inputs = static_inputs(caches, [[3, 4], [5, 6]], model.device)
    for cache in caches:
        pool.truncate(cache, cache.length)
    assert inputs is not None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        static_forward(model.module, pool, inputs, model.dtype)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    run = chain._run

    def strict(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return run(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def chained(seed: int) -> list:
        return forward_batch(
            model, [Pass([seed], caches[0], 1, False, chain=5), Pass([seed + 1], caches[1], 1, False, chain=3)]
        )

    lengths = [cache.length for cache in caches]
    first = chained(7)  # captures the buckets it needs (a capture synchronizes by design)
    for cache, length in zip(caches, lengths):
        pool.truncate(cache, length)
    monkeypatch.setattr(chain, "_run", strict)
    again = chained(7)  # replayed, with no wait on the device between steps (else the mode raises)
    # The same tokens; the probabilities as a replay computes them, which an H100 put 2e-7 from the
    # capturing run's (2026-11-27).
    assert [tokens for tokens, _ in again] == [tokens for tokens, _ in first]
    for (_, want), (_, got) in zip(first, again):
        assert got == pytest.approx(want, abs=1e-5)
