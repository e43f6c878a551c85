"""models.staticpass: a pass over the KV pool in bucket shapes (what a CUDA graph replays) gives each row
the logits of the model's own forward over that row's whole sequence, for a lean drafter and for the
target's transformers forward, with rows of different lengths, padding rows and tokens; the caches then
hold exactly the new tokens. Routed through the batcher (`graphs: eager`), a cascade's output is
transformers' greedy `generate()`'s; a runner that fails is dropped and the passes go eager."""

from __future__ import annotations

import threading

import pytest
import torch

from cascade_service.config import ConfigError, ModelTierConfig, make_cascade, parse_config
from cascade_service.core.request import GenerationConfig
from cascade_service.inprocess import InProcess
from cascade_service.models import chain
from cascade_service.models.batching import Pass, forward_batch
from cascade_service.models.hf import HFModel
from cascade_service.models.kvpool import BLOCK
from cascade_service.models.staticpass import (
    ROW_BUCKETS,
    EagerPasses,
    forward_static_rows,
    pool_identity,
    static_inputs,
)
from cascade_service.zoo.tiny import random_prompts
from tests.helpers.oracle import oracle
from tests.helpers.threads import concurrently


def _reference(model: HFModel, sequence: list[int], n: int) -> torch.Tensor:
    with torch.inference_mode():
        return model.module(input_ids=torch.tensor([sequence])).logits[0, -n:].float()


@pytest.mark.parametrize(("arch", "backend"), [("llama", "lean"), ("llama", "hf"), ("qwen2", "hf"), ("gpt2", "hf")])
def test_a_bucketed_pass_gives_each_row_its_own_forwards_logits(tiny_family_factory, arch, backend):
    # transformers' forwards of the families the project loads, and the lean one: on cuda, every
    # model over a pool runs this pass by default (graphs: auto).
    model = HFModel.load(tiny_family_factory(arch)["mid"], backend=backend, kv="pool", graphs="eager")
    histories = random_prompts(3, 40, seed=5)
    histories[1] = histories[1][:7]  # rows of different lengths: padding within the width bucket
    caches = [model.new_cache() for _ in histories]
    for cache, history in zip(caches, histories):
        with torch.inference_mode():
            model.forward_now(history, cache, 1)
    news = [[11, 12, 13], [14], [15, 16]]  # 3 rows -> the 4-row bucket, 3 tokens -> the 4-token bucket
    inputs = static_inputs(caches, news, model.device)
    assert inputs is not None and inputs.key == (4, 4, 256)
    got = forward_static_rows(model, news, caches)
    assert got is not None
    for cache, history, new, rows in zip(caches, histories, news, got):
        expected = _reference(model, history + new, len(new))
        torch.testing.assert_close(rows, expected, rtol=1e-4, atol=1e-4)
        assert cache.length == len(history) + len(new)
    # The next step reads what the static pass wrote: it agrees with the reference too.
    got = forward_static_rows(model, [[21], [22], [23]], caches)
    assert got is not None
    for history, new, rows, nxt in zip(histories, news, got, (21, 22, 23)):
        torch.testing.assert_close(rows, _reference(model, history + new + [nxt], 1), rtol=1e-4, atol=1e-4)
    assert isinstance(model.static, EagerPasses) and model.static.runs == 2


def test_a_pass_past_the_buckets_is_left_to_the_eager_path(tiny_family):
    model = HFModel.load(tiny_family["mid"], backend="lean", kv="pool", graphs="eager")
    caches = [model.new_cache() for _ in range(ROW_BUCKETS[-1] + 1)]
    assert forward_static_rows(model, [[1]] * len(caches), caches) is None
    assert all(cache.length == 0 and not cache.table for cache in caches)  # nothing taken
    one = model.new_cache()
    assert forward_static_rows(model, [list(range(1, 40))], [one]) is None  # 39 tokens: no token bucket
    assert one.length == 0
    # Through the batcher's entry point the same 39 tokens run eagerly, and hidden states (which the
    # fixed-shape pass does not give) too: the runner ran none of them.
    logits = forward_batch(model, [Pass(list(range(1, 40)), one, 2, False)])[0]
    torch.testing.assert_close(logits, _reference(model, list(range(1, 40)), 2), rtol=1e-4, atol=1e-4)
    logits, hidden = forward_batch(model, [Pass([40], one, 1, True)])[0]
    assert hidden.shape[0] == 1
    assert model.static is not None and model.static.runs == 0


def test_graphs_default_to_nothing_on_the_cpu_and_unknown_modes_are_refused(tiny_family):
    assert HFModel.load(tiny_family["mid"]).static is None  # "auto": CUDA graphs on cuda only
    assert HFModel.load(tiny_family["mid"], kv="dynamic", graphs="eager").static is None  # no pool: no slots
    with pytest.raises(ValueError, match="graphs mode 'always'"):
        HFModel.load(tiny_family["mid"], graphs="always")
    tiers = {"target": {"path": str(tiny_family["target"])}, "drafters": [{"kind": "mag"}]}
    assert parse_config({"tiers": tiers, "model": {"graphs": "eager"}}).cascade.target.graphs == "eager"
    tiers["target"]["graphs"] = "sometimes"
    with pytest.raises(ConfigError, match=r"tiers\.target\.graphs must be one of auto, eager, off"):
        parse_config({"tiers": tiers})


def test_a_cascade_on_fixed_shape_passes_is_the_oracles_output(tiny_family, monkeypatch):
    chains = []
    real = chain._chained
    monkeypatch.setattr(chain, "_chained", lambda model, batch: chains.append(len(batch)) or real(model, batch))
    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"]), graphs="eager"),
        [ModelTierConfig(n, str(tiny_family[n]), backend="lean", graphs="eager") for n in ("close", "mid")],
        [[2, 2], [0, 3]],  # mid, the lowest tier, drafts alone: greedily, chained
        1.0,
    )
    engine = InProcess(cascade)
    prompts = [p[: 5 + 3 * i] for i, p in enumerate(random_prompts(6, 30, seed=44))]
    budgets = [10 + 7 * i for i in range(6)]
    outputs: list[list[int] | None] = [None] * 6
    start = threading.Barrier(6)

    def run(i: int) -> None:
        start.wait()
        outputs[i] = engine.generate(prompts[i], GenerationConfig(max_new_tokens=budgets[i])).token_ids

    concurrently(6, run)
    for prompt, budget, out in zip(prompts, budgets, outputs):
        assert out == oracle(tiny_family["target"], prompt, budget)
    for model in engine.core.models():
        assert model.static is not None and model.static.runs > 0, model.name  # the fixed-shape passes ran
    assert chains and max(chains) > 1  # the drafter's greedy drafts chained, several requests' in one run


class _Broken(EagerPasses):
    def run(self, inputs):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_runner_that_fails_is_dropped_and_the_pass_runs_eagerly(tiny_family, caplog):
    model = HFModel.load(tiny_family["mid"], backend="lean", kv="pool", graphs="eager")
    model.static = _Broken(model.module, model.kv_pool, model.dtype)
    history = random_prompts(1, 12, seed=3)[0]  # 12 tokens: the 16-token bucket
    cache = model.new_cache()
    logits = forward_batch(model, [Pass(history, cache, 1, False)])[0]
    torch.testing.assert_close(logits, _reference(model, history, 1), rtol=1e-4, atol=1e-4)
    assert model.static is None and cache.length == len(history)
    assert "fixed-shape passes off" in caplog.text and "stream is capturing" in caplog.text


def test_a_pool_that_grew_is_never_taken_for_the_one_a_graph_was_captured_over(tiny_family):
    # A graph replays over the addresses it was captured with; after empty_cache() a grown pool's new
    # tensor may sit at an old address. Put the old tensors back after a growth (same addresses, same
    # capacity): the identity must still differ, since the pool's contents were replaced in between.
    model = HFModel.load(tiny_family["mid"], backend="lean", graphs="eager")
    pool = model.kv_pool
    cache = model.new_cache()
    forward_batch(model, [Pass(random_prompts(1, 20, seed=4)[0], cache, 1, False)])
    before, keys, values = pool_identity(pool), list(pool.keys), list(pool.values)
    pool.extend(cache, pool.capacity * BLOCK + 1, [cache])  # blocks past the capacity
    for layer, keys_of_layer in enumerate(keys):  # what a pass does first: the tensors grow to hold them
        pool.reserve(layer, keys_of_layer.new_zeros((1, keys_of_layer.shape[2], 1, keys_of_layer.shape[3])))
    assert pool_identity(pool) != before
    pool.keys[:], pool.values[:] = keys, values
    assert pool_identity(pool) != before


def test_a_pool_sized_for_its_rows_before_the_capture_does_not_move_while_they_fill_it(tiny_family):
    # Under captured graphs the pool is made at what max_batch requests at the longest context hold
    # (within its budget) before the first capture, so a growth (which moves the tensors and makes
    # every graph stale) does not come while those requests run (issue 59, point 1). Sized here on
    # the CPU through the same function (start_graphs calls it for CapturedPasses only, on cuda).
    from cascade_service.models.poolhold import reserve_layers, serving_blocks

    model = HFModel.load(tiny_family["mid"], kv_budget_mb=64)
    rows = 2
    want = serving_blocks(model, rows)
    assert want == rows * -(-model.config.max_position_embeddings // BLOCK) + 1
    with model.kv_pool.lock:
        reserve_layers(model, want)
    pool = model.kv_pool
    assert pool.capacity == min(want, pool.max_blocks), (pool.capacity, want, pool.max_blocks)
    identity = pool_identity(pool)
    caches = [model.new_cache() for _ in range(rows)]
    long = random_prompts(1, model.config.max_position_embeddings - 8, seed=3)[0]
    with torch.inference_mode():
        for cache in caches:
            for start in range(0, len(long), 256):
                forward_batch(model, [Pass(long[start : start + 256], cache, 1, False)])
    assert pool_identity(pool) == identity  # the tensors never moved
    # The negative control: the same fill over a pool made at its first size moves its tensors.
    unsized = HFModel.load(tiny_family["mid"], kv_budget_mb=64)
    with unsized.kv_pool.lock:
        reserve_layers(unsized)
    before = pool_identity(unsized.kv_pool)
    with torch.inference_mode():
        forward_batch(unsized, [Pass(long[:512], unsized.new_cache(), 1, False)])
    assert pool_identity(unsized.kv_pool) != before
    small = HFModel.load(tiny_family["mid"], kv_budget_mb=4)  # a budget below the want caps it
    with small.kv_pool.lock:
        reserve_layers(small, want)
    assert small.kv_pool.capacity == small.kv_pool.max_blocks < want
