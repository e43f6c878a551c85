"""Function-preserving growth (zoo/grow.py): the grown Llama computes what the original did, and it
refuses a shape that could not."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cascade_service.zoo.grow import Growth, grow


def _small() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # trained-looking norms: gains away from 1
        for module in model.modules():
            if module.__class__.__name__ == "LlamaRMSNorm":
                module.weight.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize(
    "growth",
    [
        Growth(hidden=96, heads=12, kv_heads=4, intermediate=160, layers=7),
        Growth(hidden=48, heads=6, kv_heads=2, intermediate=64, layers=3),  # the same shape: a copy
        Growth(hidden=144, heads=18, kv_heads=6, intermediate=64, layers=3),  # wider only
    ],
)
def test_the_grown_model_computes_what_the_original_did(growth):
    small = _small()
    big = grow(small, growth, seed=1)
    assert big.config.hidden_size == growth.hidden and big.config.num_hidden_layers == growth.layers
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before, after = small(ids).logits, big(ids).logits  # [2, 40, V]
    assert torch.allclose(before, after, atol=2e-5), float((before - after).abs().max())
    assert torch.equal(before.argmax(-1), after.argmax(-1))
    with torch.no_grad():  # and greedily, through the KV cache
        a = small.generate(ids[:1, :8], max_new_tokens=16, do_sample=False)
        b = big.generate(ids[:1, :8], max_new_tokens=16, do_sample=False)
    assert torch.equal(a, b)


def test_growth_has_room_to_learn():
    # Every new weight that writes to the stream is zero, every one that reads is not: training moves them.
    big = grow(_small(), Growth(hidden=96, heads=12, kv_heads=4, intermediate=160, layers=6), seed=1)
    new_layer = big.model.layers[1]  # layers 0, 2, 4 are the old ones
    assert not new_layer.self_attn.o_proj.weight.any() and not new_layer.mlp.down_proj.weight.any()
    assert new_layer.self_attn.q_proj.weight.std() > 0.01 and new_layer.mlp.up_proj.weight.std() > 0.01
    assert not big.model.embed_tokens.weight[:, 48:].any()
    big.train()
    loss = big(torch.randint(0, 97, (2, 16)), labels=torch.randint(0, 97, (2, 16))).loss
    loss.backward()
    assert new_layer.mlp.down_proj.weight.grad.abs().sum() > 0
    assert big.model.embed_tokens.weight.grad[:, 48:].abs().sum() > 0


@pytest.mark.parametrize(
    "growth, field",
    [
        (Growth(hidden=32, heads=4, kv_heads=2, intermediate=64, layers=3), "hidden"),
        (Growth(hidden=96, heads=8, kv_heads=2, intermediate=64, layers=3), "heads"),  # head size would change
        (Growth(hidden=96, heads=12, kv_heads=3, intermediate=64, layers=3), "kv_heads"),  # group size 4, not 3
        (Growth(hidden=96, heads=12, kv_heads=4, intermediate=32, layers=3), "intermediate"),
        (Growth(hidden=96, heads=12, kv_heads=4, intermediate=64, layers=2), "layers"),
    ],
)
def test_a_shape_that_cannot_preserve_the_function_is_refused(growth, field):
    with pytest.raises(ValueError, match=f"growth.{field}:"):
        grow(_small(), growth)
