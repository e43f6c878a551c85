"""The KV pool (models.kvpool): requests' caches as slots of one tensor that batched passes read in place.

Checked against the model's own no-cache forward (`full_logits`), over what the pool does that a
per-request cache does not: growing its slots and its capacity while requests hold caches, handing a
dropped request's slot to the next, batches of slots in and out of order, rollback by length.
"""

from __future__ import annotations

import random

import pytest
import torch

from cascade_service.config import KV_STORAGES, ConfigError, parse_config
from cascade_service.models import kvpool
from cascade_service.models.batching import Pass, forward_batch
from cascade_service.models.hf import HFModel
from cascade_service.zoo.tiny import random_prompts


@pytest.fixture
def small_pool(monkeypatch):
    # Start tiny so a short test grows the pool several times in both directions.
    monkeypatch.setattr(kvpool, "FIRST_SLOTS", 2)
    monkeypatch.setattr(kvpool, "FIRST_CAPACITY", 8)


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
    assert pool.capacity >= max(held) and pool.keys[0].shape[0] >= len(seqs)
    assert pool.capacity & (pool.capacity - 1) == 0  # grown by doubling from 8


def test_a_dropped_request_gives_its_slot_to_the_next_lowest_first(tiny_family):
    model = HFModel.load(tiny_family["target"])
    a, b, c = (model.new_cache() for _ in range(3))
    assert (a.slot, b.slot, c.slot) == (0, 1, 2)
    del b
    del a
    fresh = [model.new_cache() for _ in range(3)]
    assert [s.slot for s in fresh] == [0, 1, 3]
    with pytest.raises(ValueError, match="negative"):
        c.crop(2)


def test_a_scorer_reset_frees_its_slot(tiny_family):
    from cascade_service.core.types import Context

    model = HFModel.load(tiny_family["target"])
    scorer = model.scorer()
    prompt = random_prompts(1, 10, seed=3)[0]
    scorer.logits(Context(prompt, len(prompt)), 1)
    first = scorer._cache.slot
    scorer.reset()
    assert scorer._cache.slot != first  # the new cache took a fresh slot while the old was alive ...
    assert model.new_cache().slot == first  # ... and the old one is free again


def test_a_failed_pass_leaves_every_cache_as_it_was(tiny_family, monkeypatch):
    model = HFModel.load(tiny_family["target"])
    caches = [model.new_cache() for _ in range(3)]
    prompts = random_prompts(3, 8, seed=4)
    with torch.inference_mode():
        forward_batch(model, [Pass(p, c, 1, False) for p, c in zip(prompts, caches)])

        def broken(*args, **kwargs):
            raise RuntimeError("out of memory")

        monkeypatch.setattr(model, "module", broken)
        with pytest.raises(RuntimeError, match="out of memory"):
            forward_batch(model, [Pass([1, 2], c, 1, False) for c in caches])
    assert [c.get_seq_length() for c in caches] == [8, 8, 8]


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
