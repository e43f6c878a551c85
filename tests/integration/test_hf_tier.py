"""HF tiers over the tiny random family: cached scoring is exact, loading is local-only, drafters differ."""

from __future__ import annotations

import random
import time
from functools import cache

import pytest
import torch

from cascade_service.core.types import Context
from cascade_service.models.hf import HFModel, load_tokenizer
from cascade_service.zoo.tiny import agreement, build_family, greedy_tokens, random_prompts

ARCHS = ["llama", "qwen2", "gpt2"]


@cache
def _load(path) -> HFModel:
    return HFModel.load(path)


def _check_rows(model: HFModel, scorer, ctx: Context, n: int) -> None:
    rows = scorer.logits(ctx, n)  # [n, V]
    expected = model.full_logits(ctx.tokens)[-n:]  # [n, V], no cache at all
    assert rows.shape == (n, model.vocab_size) and rows.dtype == torch.float32
    torch.testing.assert_close(rows, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_scorer_logits_equal_full_forward_after_arbitrary_rollbacks(tiny_family_factory, arch):
    model = _load(tiny_family_factory(arch)["target"])
    rng = random.Random(arch)
    fresh = lambda k: [rng.randrange(3, model.vocab_size) for _ in range(k)]  # noqa: E731
    committed, pending = fresh(9), []
    scorer = model.scorer()
    for _ in range(50):
        move = rng.random()
        if move < 0.35:  # a drafter extends the pending tail
            pending += fresh(rng.randint(1, 4))
        elif move < 0.7:  # review: accept a prefix of the draft, commit a correction, drop the rest
            committed += pending[: rng.randint(0, len(pending))] + fresh(1)
            pending = []
        else:  # another drafter diverges somewhere inside the pending tail
            pending = pending[: rng.randint(0, len(pending))] + fresh(rng.randint(1, 3))
        ctx = Context(committed + pending, stable=len(committed))
        # Occasionally ask for rows reaching deep into the committed prefix (crop below `stable`).
        n = len(ctx) if rng.random() < 0.05 else rng.randint(1, min(len(ctx), len(pending) + 2))
        _check_rows(model, scorer, ctx, n)


def test_stable_prefix_is_never_refed(tiny_family):
    model = _load(tiny_family["target"])
    scorer = model.scorer()
    prompt = random_prompts(1, 10)[0]
    d1, d2, d3, c, e1, e2, bonus, f1 = 11, 12, 13, 14, 15, 16, 17, 18

    def call(tokens, stable, n, fed_total):
        _check_rows(model, scorer, Context(tokens, stable), n)
        assert scorer.tokens_processed == fed_total

    call(prompt, 10, 1, 10)  # prefill
    call(prompt + [d1, d2, d3], 10, 4, 14)  # k=3 review: the last prompt token + 3 drafts
    # d1 accepted, d2 rejected -> correction c; the cache is cropped after d1, not re-prefilled.
    call(prompt + [d1, c, e1, e2], 12, 3, 17)
    call(prompt + [d1, c, e1, e2, bonus, f1], 15, 2, 19)  # all accepted + bonus
    call(prompt + [d1, c, e1, e2, bonus, f1], 15, 1, 20)  # same context: only the last token


def test_committed_prefix_is_trusted_not_rescanned(tiny_family):
    # Tokens below `stable` never change within a request, so the scorer must not compare them again;
    # a context that (illegally) rewrites them is therefore served from the cache.
    scorer = _load(tiny_family["target"]).scorer()
    prompt = random_prompts(1, 12)[0]
    scorer.logits(Context(prompt, 12), 1)
    rewritten = [3] * 11 + prompt[11:]
    scorer.logits(Context(rewritten + [5, 6], 12), 1)
    assert scorer.tokens_processed == 12 + 2


def test_reset_drops_the_cache(tiny_family):
    model = _load(tiny_family["target"])
    scorer = model.scorer()
    ctx = Context(random_prompts(1, 8)[0], 8)
    scorer.logits(ctx, 1)
    scorer.reset()
    _check_rows(model, scorer, ctx, 1)
    assert scorer.tokens_processed == 16


@pytest.mark.parametrize("n", [0, 4])
def test_logits_rejects_n_outside_context(tiny_family, n):
    with pytest.raises(ValueError, match="n must be"):
        _load(tiny_family["target"]).scorer().logits(Context([5, 6, 7], 3), n)


def test_load_rejects_missing_dir_without_hub_fallback(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        HFModel.load(missing)
    with pytest.raises(FileNotFoundError, match="hub ids are not loaded"):
        HFModel.load("gpt2")  # a hub id is not a local directory
    with pytest.raises(FileNotFoundError, match="config.json"):
        HFModel.load(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(missing)


def test_bad_dtype_rejected(tiny_family):
    with pytest.raises(ValueError, match="float64"):
        HFModel.load(tiny_family["target"], dtype="float64")
    with pytest.raises(ValueError, match="tpu"):
        HFModel.load(tiny_family["target"], device="tpu")


def test_loaded_model_reports_metadata(tiny_family):
    model = _load(tiny_family["target"])
    tokenizer = load_tokenizer(tiny_family["target"])
    assert model.name == "target"
    assert model.vocab_size == len(tokenizer)
    assert model.eos_token_ids == {tokenizer.eos_token_id}
    assert model.num_parameters > _load(tiny_family["unrelated"]).num_parameters
    assert HFModel.load(tiny_family["close"], name="c1", dtype="auto", device="auto").name == "c1"


def test_step_time_is_measured_once_and_cached(tiny_family):
    model = _load(tiny_family["unrelated"])
    first = model.step_time_s(context_len=16, repeats=3)
    assert 0 < first < 1.0
    assert model.step_time_s(context_len=16, repeats=3) == first


def test_close_drafter_agrees_more_than_unrelated(tiny_family):
    target = _load(tiny_family["target"])
    prompts = random_prompts(8, 8, seed=1)
    rates = {name: agreement(target, _load(tiny_family[name]), prompts, 48) for name in ("close", "mid", "unrelated")}
    print(f"greedy agreement with target: {rates}")
    assert 0.6 <= rates["close"] <= 0.95
    assert 0.3 <= rates["mid"] < rates["close"]
    assert rates["unrelated"] < 0.1


@pytest.mark.parametrize("arch", ARCHS)
def test_target_greedy_is_varied_and_cache_independent(tiny_family_factory, arch):
    # Peaky logits: the incremental (cached) greedy path equals the block forward's argmax, and the
    # output is not one token (or a 2-cycle) repeated forever.
    model = _load(tiny_family_factory(arch)["target"])
    for prompt in random_prompts(3, 8):
        chosen = greedy_tokens(model, prompt, 48)
        block = model.full_logits(prompt + chosen)[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert block == chosen
        assert len(set(chosen)) >= 10


def test_family_builds_quickly_and_is_reused(tmp_path):
    began = time.perf_counter()
    paths = build_family(tmp_path, seed=3)
    print(f"tiny llama family built in {time.perf_counter() - began:.2f}s")
    for path in paths.values():
        assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
            p.name for p in path.iterdir()
        }
    stamp = (paths["target"] / "model.safetensors").stat().st_mtime_ns
    assert build_family(tmp_path, seed=3) == paths
    assert (paths["target"] / "model.safetensors").stat().st_mtime_ns == stamp


def test_tokenizer_round_trips_text(tiny_family):
    tokenizer = load_tokenizer(tiny_family["target"])
    text = "def greet(name):\n    return f'Hello, {name}!'  # naïve ünïcode ✓\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) < len(text.encode())  # the merges compress
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_tokens_to_ids(["<pad>", "<s>", "</s>"]) == [0, 1, 2]
