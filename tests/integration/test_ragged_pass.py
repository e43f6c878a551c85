"""models.poolpass's ragged pass: rows of different new-token counts in one pass, the linear layers over
their real tokens concatenated and attention per row, give each row the logits of the model's own
forward over that row's whole sequence (transformers', not ours), write exactly the real tokens' keys,
and leave every row's cache at its own length; a later pass over those caches still matches."""

from __future__ import annotations

import pytest
import torch

from cascade_service.config import MaGConfig, ModelTierConfig, make_cascade
from cascade_service.core.request import GenerationConfig
from cascade_service.engine import core as engine_core
from cascade_service.inprocess import InProcess
from cascade_service.models import poolpass
from cascade_service.models.batching import Pass, forward_batch
from cascade_service.models.hf import HFModel
from cascade_service.models.poolpass import forward_rows, ragged
from cascade_service.zoo.tiny import random_prompts


def _reference(model: HFModel, sequence: list[int], n: int) -> torch.Tensor:
    with torch.inference_mode():
        return model.module(input_ids=torch.tensor([sequence])).logits[0, -n:].float()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_rows_of_1_3_and_11_new_tokens_share_one_ragged_pass(tiny_family_factory, arch, monkeypatch):
    model = HFModel.load(tiny_family_factory(arch)["mid"], backend="hf", kv="pool", graphs="off")
    assert ragged(model)
    spread = []
    real_attention = poolpass.ragged_attention

    def counted(*args, **kwargs):
        spread.append(args[1].shape[0])  # the query's batch: 1, the rows' tokens concatenated
        return real_attention(*args, **kwargs)

    monkeypatch.setitem(poolpass.ALL_ATTENTION_FUNCTIONS._global_mapping, poolpass.RAGGED, counted)
    histories = random_prompts(3, 40, seed=11)
    cached = [5, 23, 37]  # different cached lengths, not block-aligned
    caches = [model.new_cache() for _ in histories]
    for cache, history, n in zip(caches, histories, cached):
        forward_batch(model, [Pass(history[:n], cache, 1, False)])
    spread.clear()  # the lone prefills above attend through it too, one call a layer
    news = [[7], [8, 9, 10], list(range(20, 31))]
    keeps = [1, 3, 2]
    got = forward_batch(model, [Pass(new, cache, keep, False) for new, cache, keep in zip(news, caches, keeps)])
    assert spread and set(spread) == {1}  # the pass ran ragged, in every layer
    assert model.module.config._attn_implementation == "sdpa"  # and left the model as it was
    for rows, history, n, new, keep, cache in zip(got, histories, cached, news, keeps, caches):
        sequence = history[:n] + new
        torch.testing.assert_close(rows, _reference(model, sequence, keep), rtol=1e-4, atol=1e-4)
        assert cache.length == len(sequence)
    # The keys written are the real tokens' alone: a next pass over every cache is each row's forward.
    again = forward_batch(model, [Pass([4], cache, 1, False) for cache in caches])
    for rows, history, n, new in zip(again, histories, cached, news):
        torch.testing.assert_close(rows, _reference(model, history[:n] + new + [4], 1), rtol=1e-4, atol=1e-4)


def test_rows_in_any_order_attend_in_one_run_per_count_and_get_their_own_logits(tiny_family, monkeypatch):
    # Rows whose counts interleave (3, 1, 11, 1, 3) are fed side by side by count: three runs of
    # attention, not five, and each row's logits are still its own forward's, in the order asked.
    model = HFModel.load(tiny_family["mid"], backend="hf", kv="pool", graphs="off")
    runs = []
    real_attention = poolpass.ragged_attention

    def counted(*args, **kwargs):
        runs.append(poolpass._layout.groups)
        return real_attention(*args, **kwargs)

    monkeypatch.setitem(poolpass.ALL_ATTENTION_FUNCTIONS._global_mapping, poolpass.RAGGED, counted)
    histories = random_prompts(5, 40, seed=13)
    cached = [9, 30, 17, 4, 25]
    caches = [model.new_cache() for _ in histories]
    for cache, history, n in zip(caches, histories, cached):
        forward_batch(model, [Pass(history[:n], cache, 1, False)])
    assert runs and set(map(type, runs)) == {type(None)}  # a lone row's pass: one call, no runs
    runs.clear()
    news = [[8, 9, 10], [7], list(range(20, 31)), [6], [3, 4, 5]]
    keeps = [2, 1, 3, 1, 1]
    got = forward_batch(model, [Pass(new, cache, keep, False) for new, cache, keep in zip(news, caches, keeps)])
    assert runs and {len(groups) for groups in runs} == {3}
    for rows, history, n, new, keep, cache in zip(got, histories, cached, news, keeps, caches):
        torch.testing.assert_close(rows, _reference(model, history[:n] + new, keep), rtol=1e-4, atol=1e-4)
        assert cache.length == n + len(new)


def test_a_pass_packs_its_mask_once_a_run_not_once_a_layer(tiny_family, monkeypatch):
    # Every layer of a pass gets the same mask: packed for grouped attention (models.attention
    # `pack_mask`, a copy) by the first layer of each run of rows and read by the others.
    model = HFModel.load(tiny_family["mid"], backend="hf", kv="pool", graphs="off")
    layers = model.config.num_hidden_layers
    assert layers > 1 and model.config.num_key_value_heads < model.config.num_attention_heads
    packs, calls = [], []
    real_pack, real_attention = poolpass.pack_mask, poolpass.ragged_attention
    monkeypatch.setattr(poolpass, "pack_mask", lambda *a: packs.append(a[0].shape) or real_pack(*a))

    def counted(*args, **kwargs):
        calls.append(1)
        return real_attention(*args, **kwargs)

    monkeypatch.setitem(poolpass.ALL_ATTENTION_FUNCTIONS._global_mapping, poolpass.RAGGED, counted)
    histories = random_prompts(3, 30, seed=5)
    caches = [model.new_cache() for _ in histories]
    for cache, history in zip(caches, histories):
        forward_batch(model, [Pass(history[:20], cache, 1, False)])
    packs.clear()
    calls.clear()
    forward_batch(model, [Pass([5, 6, 7], caches[0], 3, False)])  # a lone verification: one run
    assert len(calls) == layers and len(packs) == 1
    packs.clear()
    calls.clear()
    got = forward_batch(model, [Pass([5, 6, 7], caches[1], 3, False), Pass([5], caches[2], 1, False)])
    assert len(calls) == layers and len(packs) == 2  # two runs (3 tokens, 1 token), each packed once
    torch.testing.assert_close(got[0], _reference(model, histories[1][:20] + [5, 6, 7], 3), rtol=1e-4, atol=1e-4)


def test_a_ragged_pass_that_fails_leaves_the_caches_and_the_model_as_they_were(tiny_family, monkeypatch):
    model = HFModel.load(tiny_family["mid"], backend="hf", kv="pool", graphs="off")
    caches = [model.new_cache() for _ in range(2)]
    for cache, history in zip(caches, random_prompts(2, 12, seed=12)):
        forward_batch(model, [Pass(history, cache, 1, False)])

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setitem(poolpass.ALL_ATTENTION_FUNCTIONS._global_mapping, poolpass.RAGGED, broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        forward_batch(model, [Pass([1, 2, 3], caches[0], 1, False), Pass([4], caches[1], 1, False)])
    assert [cache.length for cache in caches] == [12, 12]
    assert model.module.config._attn_implementation == "sdpa"
    assert getattr(poolpass._layout, "groups", None) is None


def test_the_lean_forward_and_eager_attention_keep_padded_passes(tiny_family):
    assert not ragged(HFModel.load(tiny_family["mid"], backend="lean", kv="pool"))
    eager = HFModel.load(tiny_family["mid"], backend="hf", kv="pool")
    eager.module.config._attn_implementation = "eager"
    assert not ragged(eager)


@pytest.mark.parametrize("ragged_passes", [True, False])
def test_requests_verifying_beside_fourteen_plain_ones_cost_the_target_no_extra_passes(
    tiny_family, ragged_passes, monkeypatch
):
    # Sixteen streams, two of them drafting with MaG (drafts that take no pass of their own, so the
    # verifying rows are ready for every target pass): with ragged passes a 5-token verification joins
    # the fourteen one-token steps, and the target runs no more passes than for sixteen plain streams.
    # Padded (the negative control), it cannot join, and the passes grow.
    if not ragged_passes:
        monkeypatch.setattr(engine_core, "ragged", lambda model: False)
    engine = InProcess(make_cascade(ModelTierConfig("target", str(tiny_family["target"])), [MaGConfig()], [[4]], 1.0))
    assert engine.target.batcher.ragged is ragged_passes
    prompts = [p * 3 for p in random_prompts(16, 6, seed=31)]  # repeats: MaG has something to draft

    def served(speculation: list[str]) -> tuple[list[list[int]], int]:
        sizes = engine.target.batcher.batch_sizes
        before = sum(sizes.values())
        futures = [
            engine.loop.submit(engine.generate, p, GenerationConfig(max_new_tokens=24, speculation=s))
            for p, s in zip(prompts, speculation)
        ]
        token_ids = [f.result().token_ids for f in futures]
        return token_ids, sum(sizes.values()) - before

    plain, plain_passes = served(["off"] * 16)
    mixed, mixed_passes = served(["fixed"] * 2 + ["off"] * 14)
    assert mixed == plain
    if ragged_passes:
        assert mixed_passes <= plain_passes
    else:
        assert mixed_passes > plain_passes + 4


def test_the_mixed_pass_bench_times_every_way_and_leaves_the_caches(tiny_family, capsys):
    from cascade_service.bench import mixedpass

    for verifying in ("1", "4"):  # one row verifying beside one-token rows; every row verifying
        args = ["--context", "40", "--rows", "4", "--verifying", verifying, "--k", "3", "--repeats", "1"]
        mixedpass.main([str(tiny_family["target"]), *args])
        printed = capsys.readouterr().out
        assert all(f"{way} " in printed for way in mixedpass.WAYS) and f"{verifying} verifying 4 tokens" in printed
    with pytest.raises(SystemExit) as exited:  # more verifying rows than rows: argparse's error, by name
        mixedpass.main([str(tiny_family["target"]), "--rows", "2", "--verifying", "3"])
    assert exited.value.code == 2 and "--verifying" in capsys.readouterr().err


def test_pool_passes_attend_over_uncopied_key_heads_and_match_the_models_forward(tiny_family, monkeypatch):
    # The tiny family has half as many KV heads as query heads. A lone verification row and a ragged
    # pass read each KV head once (models.attention): transformers' repeat_kv, which copies every
    # row's keys and values per query head, is never called, and each row still gets its own logits.
    model = HFModel.load(tiny_family["mid"], backend="hf", kv="pool", graphs="off")
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    histories = random_prompts(3, 30, seed=21)
    caches = [model.new_cache() for _ in histories]
    for cache, history in zip(caches, histories):
        forward_batch(model, [Pass(history[:20], cache, 1, False)])
    references = [_reference(model, history[:20] + [5, 6, 7, 8], 4) for history in histories]

    def copied(*args, **kwargs):
        raise AssertionError("a pool pass repeated the KV heads")

    monkeypatch.setattr("transformers.integrations.sdpa_attention.repeat_kv", copied)
    lone = forward_batch(model, [Pass([5, 6, 7, 8], caches[0], 4, False)])[0]  # a 3-draft verification
    torch.testing.assert_close(lone, references[0], rtol=1e-4, atol=1e-4)
    rows = forward_batch(model, [Pass([5, 6, 7, 8], caches[1], 4, False), Pass([5], caches[2], 1, False)])
    torch.testing.assert_close(rows[0], references[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rows[1], references[2][:1], rtol=1e-4, atol=1e-4)
    for cache in caches[1:]:
        cache.crop(-(cache.length - 20))
    padded = forward_rows(model, [Pass([5, 6, 7, 8], caches[1], 4, False), Pass([5], caches[2], 1, False)], False)
    torch.testing.assert_close(padded[0], references[1], rtol=1e-4, atol=1e-4)  # a padded pass's too
    torch.testing.assert_close(padded[1], references[2][:1], rtol=1e-4, atol=1e-4)
