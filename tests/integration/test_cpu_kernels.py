"""The CPU's matrix products (models.cpukernels): every large float32 linear layer of a CPU model runs
over a oneDNN-packed weight (within rounding of `F.linear`, one row included) or, where the weight is
tied or oneDNN absent, as W @ x^T (one row's result to the bit, several rows' within rounding); the
`int8` backend quantizes a drafter's linear layers, is refused at the target, and leaves the output
the target's (oracle: transformers' generate() on a freshly loaded, untouched model)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cascade_service.config import ConfigError, ModelTierConfig, make_cascade, parse_config
from cascade_service.core.request import GenerationConfig
from cascade_service.inprocess import InProcess
from cascade_service.models.cpukernels import (
    PackedLinear,
    WeightMajorLinear,
    can_pack,
    fast_cpu_linears,
    packed_parameters,
    quantize_int8,
)
from cascade_service.models.hf import HFModel
from cascade_service.zoo.tiny import random_prompts
from tests.helpers.oracle import oracle


@pytest.mark.parametrize("bias", [False, True])
def test_weight_major_is_the_same_function_and_one_row_the_same_bits(bias):
    torch.manual_seed(0)
    layer = nn.Linear(96, 200, bias=bias)
    reference = nn.Linear(96, 200, bias=bias)
    reference.load_state_dict(layer.state_dict())
    assert fast_cpu_linears(layer, min_weights=0, packing=False) == 1 and type(layer) is WeightMajorLinear
    one = torch.randn(1, 1, 96)
    assert torch.equal(layer(one), reference(one))
    for shape in [(3, 96), (2, 5, 96), (1, 33, 96)]:
        x = torch.randn(*shape)
        out = layer(x)
        assert out.shape == (*shape[:-1], 200)
        torch.testing.assert_close(out, F.linear(x, reference.weight, reference.bias), rtol=0, atol=1e-5)


def test_weight_major_leaves_other_dtypes_and_subclasses_alone():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), nn.Embedding(4, 8))
    assert fast_cpu_linears(model, min_weights=0, packing=False) == 1
    assert [type(m) for m in model] == [WeightMajorLinear, nn.Linear, nn.Embedding]


def test_weight_major_takes_large_weights_only(tiny_family):
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(256, 1536), nn.Linear(64, 64))
    assert fast_cpu_linears(model, packing=False) == 1  # 1,048,576 weights; 393,216 and 4,096 keep MKL's product
    assert [type(m) for m in model] == [WeightMajorLinear, nn.Linear, nn.Linear]
    loaded = HFModel.load(tiny_family["target"])  # a tiny model: every layer small, none swapped
    linears = [m for m in loaded.module.modules() if isinstance(m, nn.Linear)]
    assert linears and not any(type(m) in (WeightMajorLinear, PackedLinear) for m in linears)


needs_onednn = pytest.mark.skipif(not can_pack(), reason="this torch build has no oneDNN packed inner product")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_is_the_same_function_within_rounding_and_keeps_no_dense_weight(bias):
    torch.manual_seed(0)
    layer = nn.Linear(96, 200, bias=bias)
    weight, offset = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()
    assert fast_cpu_linears(layer, min_weights=0) == 1 and type(layer) is PackedLinear
    assert "weight" not in dict(layer.named_parameters())  # the packed copy replaced it
    with pytest.raises(AttributeError):
        layer.weight  # noqa: B018  # a reader of the dense weight fails loudly, never reads packed bytes
    assert packed_parameters(layer) == 96 * 200
    for shape in [(1, 96), (1, 1, 96), (3, 96), (2, 5, 96), (1, 33, 96), (16, 96)]:
        x = torch.randn(*shape)
        with torch.inference_mode():
            out = layer(x)
        assert out.shape == (*shape[:-1], 200)
        torch.testing.assert_close(out, F.linear(x, weight, offset), rtol=1e-5, atol=1e-5)
    # negative control: the tolerance tells a wrong weight apart
    assert not torch.allclose(layer(torch.ones(1, 96)), F.linear(torch.ones(1, 96), weight * 1.001, offset), atol=1e-5)


@needs_onednn
def test_a_tied_weight_stays_dense_and_a_loaded_models_size_counts_packed_weights():
    embedding = nn.Embedding(300, 64)
    head = nn.Linear(64, 300, bias=False)
    head.weight = embedding.weight  # tied, as an LM head sharing the embedding
    own = nn.Linear(64, 300)
    model = nn.ModuleDict({"embed": embedding, "head": head, "own": own})
    before = sum(p.numel() for p in model.parameters())
    assert fast_cpu_linears(model, min_weights=0) == 2
    assert type(model["head"]) is WeightMajorLinear and model["head"].weight is embedding.weight
    assert type(model["own"]) is PackedLinear
    assert sum(p.numel() for p in model.parameters()) + packed_parameters(model) == before


def test_int8_layers_are_torchs_quantize_dynamic_to_the_bit():
    """The oracle is torch's own conversion (`quantize_dynamic` with the per-channel config) of a copy."""
    import warnings

    from torch.ao.nn.quantized.dynamic import Linear as Int8Linear
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    torch.manual_seed(3)
    ours = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Sequential(nn.Linear(96, 80, bias=False)), nn.LayerNorm(80))
    theirs = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Sequential(nn.Linear(96, 80, bias=False)), nn.LayerNorm(80))
    theirs.load_state_dict(ours.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_dynamic(theirs, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
    assert quantize_int8(ours) is ours
    assert [type(m) for m in ours.modules()] == [type(m) for m in theirs.modules()]
    for mine, reference in zip(ours.modules(), theirs.modules(), strict=True):
        if isinstance(mine, Int8Linear):
            (w, b), (w_ref, b_ref) = mine._weight_bias(), reference._weight_bias()
            assert torch.equal(w.int_repr(), w_ref.int_repr())
            assert torch.equal(w.q_per_channel_scales(), w_ref.q_per_channel_scales())
            assert (b is None) == (b_ref is None) and (b is None or torch.equal(b, b_ref))
            assert (mine.in_features, mine.out_features) == (reference.in_features, reference.out_features)
    for rows in (1, 5):
        x = torch.randn(rows, 48)
        assert torch.equal(ours(x), theirs(x))


def test_int8_drafts_and_the_output_stays_the_targets(tiny_family):
    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])),
        [ModelTierConfig("close", str(tiny_family["close"]), backend="int8")],
        [[4]],
        1.0,
    )
    engine = InProcess(cascade)
    drafter = engine.drafters[0]
    assert isinstance(drafter, HFModel) and drafter.backend == "int8"
    assert not any(type(m) in (nn.Linear, WeightMajorLinear) for m in drafter.module.modules())
    plain = HFModel.load(tiny_family["close"])
    assert drafter.num_parameters == plain.num_parameters and drafter.vocab_size == plain.vocab_size
    drafted = 0
    for prompt in random_prompts(3, 10, seed=5):
        result = engine.generate(prompt, GenerationConfig(max_new_tokens=24, speculation="fixed"))  # draft each round
        assert result.token_ids == oracle(tiny_family["target"], prompt, 24)
        drafted += result.stats.per_tier()["close"]["drafted"]
    assert drafted > 0  # it drafted: the int8 forward ran


def test_int8_is_refused_at_the_target_and_off_the_cpu(tiny_family):
    with pytest.raises(ConfigError, match=r"tiers\.target\.backend must be hf"):
        parse_config({"tiers": {"target": {"path": str(tiny_family["target"]), "backend": "int8"}}})
    module = nn.Linear(4, 4).to("meta")
    with pytest.raises(ValueError, match="backend int8 runs on the CPU only"):
        quantize_int8(module)
