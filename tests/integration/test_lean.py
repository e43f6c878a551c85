"""The lean backend (models.lean): the same function as transformers' forward, and exact cascades.

A lean drafter computes what transformers computes up to rounding (checked pass by pass, batched and
not), and a cascade whose drafters run lean still emits exactly the target's greedy `generate()`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from cascade_service.config import BACKENDS, ConfigError, GenerationConfig, ModelTierConfig, make_cascade, parse_config
from cascade_service.inprocess import InProcess
from cascade_service.models import lean
from cascade_service.models.batching import Pass, forward_batch
from cascade_service.models.hf import HFModel
from cascade_service.zoo.tiny import random_prompts

from ..helpers.bf16 import bf16_ulps
from ..helpers.oracle import oracle

PROMPTS = random_prompts(3, 18, seed=21)


def _pair(path) -> tuple[HFModel, HFModel]:
    return HFModel.load(path, name="hf"), HFModel.load(path, name="lean", backend="lean")


def test_lean_passes_equal_transformers_passes(tiny_family):
    reference, fast = _pair(tiny_family["close"])
    assert isinstance(fast.module, lean.LeanLlama)
    assert fast.num_parameters == reference.num_parameters and fast.vocab_size == reference.vocab_size
    ids = PROMPTS[0] + PROMPTS[1]
    caches = DynamicCache(), DynamicCache()
    # A prompt from scratch, a block after a cache (the shifted causal mask), a lone step, the hidden state.
    for start, end, keep in ((0, 20, 20), (20, 26, 6), (26, 27, 1)):
        with torch.inference_mode():
            want = reference.forward_now(ids[start:end], caches[0], keep, with_hidden=True)
            got = fast.forward_now(ids[start:end], caches[1], keep, with_hidden=True)
        for a, b in zip(want, got):
            assert a.shape == b.shape
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
    assert caches[1].get_seq_length() == caches[0].get_seq_length() == 27


@pytest.mark.parametrize("name", ["close", "mid"])
def test_lean_bfloat16_pass_rounds_as_transformers_does(tiny_family, name):
    # In bfloat16 the lean forward makes transformers' roundings in transformers' order: RMSNorm in
    # float32, rounded, then times the weight; rotary cos/sin in float32, then rounded; attention by
    # the same SDPA call. What may still differ is the fused q/k/v and gate/up matmuls, whose float32
    # sums can fall on the other side of a bf16 rounding: one spacing in a hidden state moves a logit
    # by about one spacing of its own size, so 2 leave a margin. With F.rms_norm's fused weight
    # multiply (before issue 48) the 3-layer tiny models were 42 and 52 spacings off here.
    models = [HFModel.load(tiny_family[name], "bfloat16", backend=b) for b in ("hf", "lean")]
    outs = []
    for model in models:
        cache = DynamicCache()
        with torch.inference_mode():
            model.forward_now(PROMPTS[0][:14], cache, 1)  # a prompt, then a block after the cache
            outs.append(model.forward_now(PROMPTS[0][14:], cache, 4))
    assert outs[0].shape == outs[1].shape == (4, models[0].vocab_size)
    off = bf16_ulps(outs[1], outs[0])
    assert off.max() <= 2, (
        f"lean bf16 logits {off.max():.0f} spacings from transformers' ({(off > 2).sum()} logits beyond 2)"
    )


def test_lean_batched_pass_over_ragged_caches_equals_each_row_alone(tiny_family):
    # The batcher left-pads caches and right-pads new tokens (attention_mask, position_ids): the lean
    # forward must honour both, as transformers' does.
    reference, fast = _pair(tiny_family["mid"])
    rows = [(PROMPTS[0][:5], PROMPTS[0][5:9], 4), (PROMPTS[1][:12], PROMPTS[1][12:13], 1), ([], PROMPTS[2][:7], 2)]
    for model in (reference, fast):
        batch, alone = [], []
        for past, new, keep in rows:
            caches = DynamicCache(), DynamicCache()
            with torch.inference_mode():
                for cache in caches:
                    if past:
                        model.forward_now(past, cache, 1)
                alone.append(model.forward_now(new, caches[1], keep))
            batch.append(Pass(list(new), caches[0], keep, False))
        with torch.inference_mode():
            got = forward_batch(model, batch)
        for a, b in zip(alone, got):
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("k_matrix", [[[4, 2], [0, 6]], [[1, 3], [0, 2]]])
def test_greedy_cascade_with_lean_drafters_equals_transformers_generate(tiny_family, k_matrix):
    drafters = [ModelTierConfig(n, str(tiny_family[n]), backend="lean") for n in ("close", "unrelated")]
    engine = InProcess(make_cascade(ModelTierConfig("target", str(tiny_family["target"])), drafters, k_matrix, 1.5))
    assert all(isinstance(d.module, lean.LeanLlama) for d in engine.drafters)  # type: ignore[union-attr]
    for prompt in PROMPTS:
        got = engine.generate(prompt, GenerationConfig(max_new_tokens=30)).token_ids
        assert got == oracle(tiny_family["target"], prompt, 30)


def test_config_names_every_backend_and_keeps_the_target_on_transformers(tiny_family):
    assert set(BACKENDS) == set(lean.BACKENDS)
    tiers = {"target": {"path": str(tiny_family["target"])}, "drafters": [{"path": str(tiny_family["close"])}]}
    tiers["drafters"][0]["backend"] = "lean"
    assert parse_config({"tiers": tiers}).cascade.drafters[0].backend == "lean"
    tiers["drafters"][0]["backend"] = "onnx"
    with pytest.raises(ConfigError, match=r"tiers\.drafters\[0\]\.backend must be one of hf, lean"):
        parse_config({"tiers": tiers})
    tiers["drafters"][0]["backend"] = "hf"
    tiers["target"]["backend"] = "lean"
    with pytest.raises(ConfigError, match=r"tiers\.target\.backend must be hf"):
        parse_config({"tiers": tiers})


def test_lean_refuses_an_architecture_it_does_not_implement(tiny_family_factory):
    module = AutoModelForCausalLM.from_pretrained(tiny_family_factory("gpt2")["close"], local_files_only=True)
    assert lean.unsupported(module.config) is not None
    with pytest.raises(ValueError, match="lean backend cannot run this model.*use backend: hf"):
        lean.LeanLlama(module)
