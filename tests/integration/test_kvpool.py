"""The paged KV pool (models.kvpool): requests' caches as block tables that batched passes read in place,
and the prefix cache over their committed blocks.

Checked against the model's own no-cache forward (`full_logits`), over what the pool does that a
per-request cache does not: growing while requests hold blocks, handing dropped blocks on, batches of
any rows in any order, rollback, prefixes shared between requests (copy on write), eviction and
preemption under a budget, and salts that keep tenants apart.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from cascade_service.config import KV_STORAGES, ConfigError, parse_config
from cascade_service.core.types import Context
from cascade_service.models import kvpool
from cascade_service.models.batching import Pass, forward_batch
from cascade_service.models.hf import HFModel
from cascade_service.models.kvpool import BLOCK
from cascade_service.models.kvsize import kv_bytes_per_token
from cascade_service.zoo.tiny import random_prompts


@pytest.fixture
def small_pool(monkeypatch):
    # Start tiny so a short test grows the pool several times.
    monkeypatch.setattr(kvpool, "FIRST_BLOCKS", 2)


def _budget_mb(model: HFModel, blocks: int) -> float:
    return blocks * BLOCK * kv_bytes_per_token(model.config, model.dtype) / 2**20


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_pool_passes_match_the_model_while_it_grows_and_rolls_back(tiny_family_factory, small_pool, arch):
    model = HFModel.load(tiny_family_factory(arch)["target"])
    rng = random.Random(5)
    seqs = random_prompts(6, 60, seed=9)
    caches = [model.new_cache() for _ in seqs]
    held = [0] * len(seqs)  # positions each cache holds: always a prefix of its sequence
    with torch.inference_mode():
        for _ in range(12):
            rows = rng.sample(range(len(seqs)), rng.randint(1, len(seqs)))  # any subset, any order
            passes, expect = [], []
            for i in rows:
                if held[i] and rng.random() < 0.3:  # a rejected draft: drop up to 3 positions
                    drop = rng.randint(1, min(3, held[i]))
                    caches[i].crop(-drop)
                    held[i] -= drop
                new = rng.randint(1, 5)
                keep = rng.randint(1, new)
                passes.append(Pass(seqs[i][held[i] : held[i] + new], caches[i], keep, False))
                expect.append(model.full_logits(seqs[i][: held[i] + new])[-keep:])
                held[i] += new
            got = forward_batch(model, passes)
            for g, e in zip(got, expect):
                torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
            assert [c.get_seq_length() for c in caches] == held
    pool = model.kv_pool
    # Memory follows the tokens held: each cache has exactly the blocks its positions need.
    assert [len(c.table) for c in caches] == [-(-h // BLOCK) for h in held]
    assert pool.used_blocks() == sum(len(c.table) for c in caches)
    assert pool.capacity > 2  # grown from 2 blocks


def test_blocks_go_back_on_rollback_and_on_drop(tiny_family):
    model = HFModel.load(tiny_family["target"])
    pool = model.kv_pool
    cache = model.new_cache()
    with torch.inference_mode():
        model.forward_now(random_prompts(1, 40, seed=1)[0], cache, 1)
    assert len(cache.table) == 3 and pool.used_blocks() == 3
    cache.crop(-20)  # 20 positions: 2 blocks
    assert len(cache.table) == 2 and pool.used_blocks() == 2
    with pytest.raises(ValueError, match="negative"):
        cache.crop(2)
    del cache
    gc.collect()
    assert pool.used_blocks() == 0 and pool.free_blocks() > 0


def test_a_failed_pass_leaves_every_cache_as_it_was(tiny_family, monkeypatch):
    model = HFModel.load(tiny_family["target"])
    caches = [model.new_cache() for _ in range(3)]
    prompts = random_prompts(3, 16, seed=4)
    with torch.inference_mode():
        forward_batch(model, [Pass(p, c, 1, False) for p, c in zip(prompts, caches)])
        tables = [list(c.table) for c in caches]

        def broken(*args, **kwargs):
            raise RuntimeError("out of memory")

        monkeypatch.setattr(model, "module", broken)
        with pytest.raises(RuntimeError, match="out of memory"):
            forward_batch(model, [Pass([1, 2], c, 1, False) for c in caches])
    assert [c.get_seq_length() for c in caches] == [16, 16, 16]
    assert [c.table for c in caches] == tables  # the blocks taken for the pass went back
    assert model.kv_pool.used_blocks() == 3


def _score(model: HFModel, tokens: list[int], salt: str = "", n: int = 1, stable: int | None = None):
    scorer = model.scorer(salt)
    with torch.inference_mode():
        rows = scorer.logits(Context(tokens, len(tokens) if stable is None else stable), n)
    return scorer, rows


def test_a_request_reuses_the_committed_prefix_of_an_earlier_one_exactly(tiny_family):
    model = HFModel.load(tiny_family["target"])
    pool = model.kv_pool
    shared = random_prompts(1, 70, seed=2)[0]  # 4 full blocks and 6 positions
    first, _ = _score(model, shared)
    assert first.tokens_cached == 0 and first.tokens_processed == 70
    del first
    gc.collect()
    assert pool.used_blocks() == 0 and len(pool.cached) == 4  # its full blocks stay cached
    longer = shared + random_prompts(1, 9, seed=3)[0]
    second, rows = _score(model, longer, n=3)
    assert second.tokens_cached == 64 and second.tokens_processed == 79 - 64
    torch.testing.assert_close(rows, model.full_logits(longer)[-3:], rtol=1e-4, atol=1e-4)
    assert pool.counters.hits == 64 and pool.counters.queries == 69 + 76
    # Only committed tokens are reused: a context whose tail is pending draft finds the blocks below it.
    third, rows = _score(model, longer, stable=40)
    assert third.tokens_cached == 32
    torch.testing.assert_close(rows, model.full_logits(longer)[-1:], rtol=1e-4, atol=1e-4)


def test_a_prefix_cached_under_one_salt_is_never_found_under_another(tiny_family):
    model = HFModel.load(tiny_family["target"])
    prompt = random_prompts(1, 48, seed=6)[0]
    _score(model, prompt, salt="key-a")
    assert _score(model, prompt + [5], salt="key-b")[0].tokens_cached == 0
    assert _score(model, prompt + [5], salt="")[0].tokens_cached == 0
    assert _score(model, prompt + [5], salt="key-a")[0].tokens_cached == 48


def test_a_shared_block_is_copied_before_a_request_rewrites_it(tiny_family):
    model = HFModel.load(tiny_family["target"])
    pool = model.kv_pool
    prompt = random_prompts(1, 33, seed=7)[0]
    owner, _ = _score(model, prompt)  # publishes blocks 0 and 1 (32 committed positions) and keeps them
    second_block = owner._cache.table[1]
    before = pool.keys[0][second_block].clone()
    reader, _ = _score(model, prompt[:40])
    assert reader.tokens_cached == 32 and reader._cache.table[1] == second_block  # shared
    # Its next call re-feeds token 31 for its logits: a write inside the shared block 1.
    with torch.inference_mode():
        rows = reader.logits(Context(prompt[:32], 32), 1)
    assert reader._cache.table[1] != second_block  # its own copy
    assert reader._cache.table[0] == owner._cache.table[0]  # the untouched block stays shared
    torch.testing.assert_close(pool.keys[0][second_block], before, rtol=0, atol=0)
    torch.testing.assert_close(rows, model.full_logits(prompt[:32])[-1:], rtol=1e-4, atol=1e-4)


def test_under_its_budget_the_pool_evicts_then_preempts_and_stays_exact(tiny_family):
    probe = HFModel.load(tiny_family["target"])
    positions = probe.max_positions or 0
    blocks = -(-positions // BLOCK) + 1
    model = HFModel.load(tiny_family["target"], kv_budget_mb=_budget_mb(probe, blocks))
    pool = model.kv_pool
    assert pool.max_blocks == blocks
    # A flood of distinct prompts: every full block is cached, then evicted for the next; never more
    # memory than the budget.
    for seed in range(12):
        prompt = random_prompts(1, positions // 2, seed=100 + seed)[0]
        _, rows = _score(model, prompt)
        torch.testing.assert_close(rows, model.full_logits(prompt)[-1:], rtol=1e-4, atol=1e-4)
    assert pool.counters.evictions > 0 and pool.capacity <= blocks
    assert pool.nbytes <= model_budget_bytes(model, blocks)
    # Two live requests that together need more than the budget: the idle one is preempted, and its
    # next call re-reads what it lost (from its own published blocks where they are still cached).
    a_tokens, b_tokens = (random_prompts(1, positions * 3 // 4, seed=s)[0] for s in (1, 2))
    a, _ = _score(model, a_tokens)
    b_scorer, _ = _score(model, b_tokens)  # held: its blocks are live while a is preempted
    assert pool.counters.preemptions >= 1 and a._cache.get_seq_length() < len(a_tokens)
    more = a_tokens + [7, 8]
    with torch.inference_mode():
        rows = a.logits(Context(more, len(a_tokens)), 2)
    torch.testing.assert_close(rows, model.full_logits(more)[-2:], rtol=1e-4, atol=1e-4)
    assert pool.capacity <= blocks and b_scorer.tokens_processed == len(b_tokens)


def model_budget_bytes(model: HFModel, blocks: int) -> int:
    return blocks * BLOCK * kv_bytes_per_token(model.config, model.dtype)


def test_a_budget_that_cannot_hold_one_request_is_refused(tiny_family, tmp_path):
    probe = HFModel.load(tiny_family["target"])
    with pytest.raises(ValueError, match=r"kv_budget_mb: .* cannot hold one request"):
        HFModel.load(tiny_family["target"], kv_budget_mb=_budget_mb(probe, 2))

    def config(model: dict, target: dict):
        raw = {"model": model, "tiers": {"target": {"path": str(tmp_path), **target}}}
        return parse_config(raw).cascade.target

    assert config({"kv_budget_mb": 64}, {}).kv_budget_mb == 64
    assert config({"kv_budget_mb": 64}, {"kv_budget_mb": 8}).kv_budget_mb == 8
    assert config({}, {}).kv_budget_mb is None
    for bad in (0, -1, "lots", True):
        with pytest.raises(ConfigError, match=r"tiers\.target\.kv_budget_mb must be a positive number"):
            config({}, {"kv_budget_mb": bad})


def test_the_config_names_a_storage_per_tier_or_for_all(tmp_path):
    assert set(KV_STORAGES) == set(kvpool.STORAGES)

    def config(model: dict, target: dict):
        raw = {"model": model, "tiers": {"target": {"path": str(tmp_path), **target}}}
        return parse_config(raw).cascade.target

    assert config({}, {}).kv == "pool"
    assert config({"kv": "dynamic"}, {}).kv == "dynamic"
    assert config({"kv": "dynamic"}, {"kv": "pool"}).kv == "pool"
    with pytest.raises(ConfigError, match=r"tiers\.target\.kv must be one of pool, dynamic"):
        config({}, {"kv": "paged"})
    with pytest.raises(ConfigError, match="model.dtpye"):  # a misspelt default is not silently dropped
        config({"dtpye": "float16"}, {})
    with pytest.raises(ValueError, match="unknown kv storage"):
        HFModel(None, "x", kv="paged")  # type: ignore[arg-type]


def test_requests_that_arrive_together_read_a_shared_header_once_and_exactly(tiny_family):
    from cascade_service.engine.core import join_loop
    from cascade_service.engine.loop import TaskLoop

    model = HFModel.load(tiny_family["target"])
    loop = TaskLoop("kv-test")
    try:
        join_loop(model, loop)
        header = random_prompts(1, 96, seed=8)[0]
        prompts = [header + tail for tail in random_prompts(4, 5, seed=9)]

        def one(prompt: list[int]) -> tuple[int, int, torch.Tensor]:
            scorer, rows = _score(model, prompt)
            return scorer.tokens_cached, scorer.tokens_processed, rows

        futures = [loop.submit(one, p) for p in prompts]  # all four before any pass runs
        results = [f.result(timeout=60) for f in futures]
    finally:
        loop.close()
    cached = sorted(r[0] for r in results)
    assert cached == [0, 96, 96, 96]  # one read the header; the others waited for it, then reused it
    assert sum(r[1] for r in results) == 101 + 3 * 5
    for (_, _, rows), prompt in zip(results, prompts):
        torch.testing.assert_close(rows, model.full_logits(prompt)[-1:], rtol=1e-4, atol=1e-4)
    assert not model.kv_pool.pending


def test_a_pass_whose_own_rows_outgrow_the_budget_is_overloaded_and_changes_nothing(tiny_family):
    from cascade_service.core.tier import Overloaded
    from cascade_service.models.kvpool import KVBudgetExceeded

    probe = HFModel.load(tiny_family["target"])
    blocks = -(-(probe.max_positions or 0) // BLOCK) + 1
    model = HFModel.load(tiny_family["target"], kv_budget_mb=_budget_mb(probe, blocks))
    rows = 3  # three rows of two-thirds of the context each: more than the budget in one pass
    prompts = random_prompts(rows, (probe.max_positions or 0) * 2 // 3, seed=12)
    caches = [model.new_cache() for _ in prompts]
    with torch.inference_mode(), pytest.raises(KVBudgetExceeded, match="kv_budget_mb") as caught:
        forward_batch(model, [Pass(p, c, 1, False) for p, c in zip(prompts, caches)])
    assert isinstance(caught.value, Overloaded)  # RESOURCE_EXHAUSTED at the edge
    assert [c.get_seq_length() for c in caches] == [0] * rows and model.kv_pool.used_blocks() == 0


def test_batched_passes_gather_into_one_kept_scratch_and_never_under_autograd(tiny_family):
    # Every layer of every batched pass gathers its rows' keys into the pool's scratch (KVPool.window),
    # grown when a pass needs more and kept; the pool never holds autograd history, even for a caller
    # outside inference mode (this test runs with grad enabled), and the passes stay exact.
    model = HFModel.load(tiny_family["mid"], backend="hf", kv="pool", graphs="off")
    pool = model.kv_pool
    assert torch.is_grad_enabled()
    histories = random_prompts(4, 60, seed=31)
    caches = [model.new_cache() for _ in histories]
    for cache, history in zip(caches, histories):
        forward_batch(model, [Pass(history[:40], cache, 1, False)])
    forward_batch(model, [Pass(history[40:41], cache, 1, False) for history, cache in zip(histories[:2], caches)])
    small = pool._windows[0].data_ptr(), pool._windows[0].shape[0]
    verifying = [Pass(history[41:45], cache, 4, False) for history, cache in zip(histories, caches[:2])]
    decoding = [Pass(history[40:41], cache, 1, False) for history, cache in zip(histories[2:], caches[2:])]
    got = forward_batch(model, verifying + decoding)
    assert pool._windows[0].shape[0] > small[1]  # four rows need more than two: grown once
    grown = pool._windows[0].data_ptr()
    forward_batch(model, [Pass(history[45:46], cache, 1, False) for history, cache in zip(histories[:2], caches)])
    assert pool._windows[0].data_ptr() == grown  # fewer rows: the same scratch
    assert not any(t.requires_grad for t in pool.keys + pool.values + list(pool._windows))
    with torch.inference_mode():
        for rows, history in zip(got[:2], histories):
            want = model.module(input_ids=torch.tensor([history[:45]])).logits[0, -4:]
            torch.testing.assert_close(rows, want, rtol=1e-4, atol=1e-4)
