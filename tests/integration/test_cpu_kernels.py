"""The CPU's matrix products (models.cpukernels): every float32 linear layer of a CPU model runs as
W @ x^T, which gives one row's result to the bit and several rows' within rounding of `F.linear`; the
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
from cascade_service.models.cpukernels import WeightMajorLinear, quantize_int8, weight_major
from cascade_service.models.hf import HFModel
from cascade_service.zoo.tiny import random_prompts
from tests.helpers.oracle import oracle


@pytest.mark.parametrize("bias", [False, True])
def test_weight_major_is_the_same_function_and_one_row_the_same_bits(bias):
    torch.manual_seed(0)
    layer = nn.Linear(96, 200, bias=bias)
    reference = nn.Linear(96, 200, bias=bias)
    reference.load_state_dict(layer.state_dict())
    assert weight_major(layer, min_weights=0) == 1 and type(layer) is WeightMajorLinear
    one = torch.randn(1, 1, 96)
    assert torch.equal(layer(one), reference(one))
    for shape in [(3, 96), (2, 5, 96), (1, 33, 96)]:
        x = torch.randn(*shape)
        out = layer(x)
        assert out.shape == (*shape[:-1], 200)
        torch.testing.assert_close(out, F.linear(x, reference.weight, reference.bias), rtol=0, atol=1e-5)


def test_weight_major_leaves_other_dtypes_and_subclasses_alone():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), nn.Embedding(4, 8))
    assert weight_major(model, min_weights=0) == 1
    assert [type(m) for m in model] == [WeightMajorLinear, nn.Linear, nn.Embedding]


def test_weight_major_takes_large_weights_only(tiny_family):
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(256, 1536), nn.Linear(64, 64))
    assert weight_major(model) == 1  # 1,048,576 weights; 393,216 and 4,096 keep MKL's own product
    assert [type(m) for m in model] == [WeightMajorLinear, nn.Linear, nn.Linear]
    loaded = HFModel.load(tiny_family["target"])  # a tiny model: every layer small, none swapped
    linears = [m for m in loaded.module.modules() if isinstance(m, nn.Linear)]
    assert linears and not any(type(m) is WeightMajorLinear for m in linears)


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
