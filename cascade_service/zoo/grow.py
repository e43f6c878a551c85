"""Function-preserving growth of a Llama (Net2Net, Chen et al. 2016; bert2BERT, Chen et al. 2022): a
wider, deeper model that computes exactly what the trained one did, to be trained further.

- The residual stream widens from d to D. The new dimensions start at zero and stay zero until
  training moves them: every weight that writes to the stream (the token embedding, o_proj,
  down_proj) is zero there. RMSNorm normalises over all D dimensions, d of them non-zero, which
  shrinks the root mean square by sqrt(d / D): each norm's gain is scaled by sqrt(d / D) and its
  epsilon by d / D, so every norm returns what it did.
- Attention gets new heads of the same size, in new key-value groups of the same size; the old heads
  keep their groups (head i reads group i // group size either way). The new heads' columns of
  o_proj are zero.
- The MLP gets new units whose down_proj columns are zero.
- New layers go after old ones, spread evenly; their o_proj and down_proj are zero, so each starts as
  the identity.
- Everything that reads the new dimensions, heads, units or layers starts small and random (std
  `init`), so training has gradients for the zero weights that write.

`tests/unit/test_grow.py` checks that the grown model's logits are the original's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM


@dataclass(frozen=True)
class Growth:
    """The grown model's shape; every figure at least the original's."""

    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    layers: int


def grow(model: LlamaForCausalLM, growth: Growth, seed: int = 0, init: float = 0.02) -> LlamaForCausalLM:
    """A `growth`-shaped Llama whose outputs equal `model`'s (up to float rounding of the norm gains)."""
    old = model.config
    config = _grown_config(old, growth)
    with torch.random.fork_rng(devices=[]):  # seeded init without disturbing the caller's RNG
        torch.manual_seed(seed)
        big = LlamaForCausalLM(config)
        with torch.no_grad():
            for parameter in big.parameters():
                parameter.normal_(0.0, init)
    d, D = old.hidden_size, growth.hidden
    scale = math.sqrt(d / D)
    src, dst = model.model, big.model
    with torch.no_grad():
        emb = dst.embed_tokens.weight  # [V, D]
        emb.zero_()
        emb[:, :d] = src.embed_tokens.weight
        big.lm_head.weight[:, :d] = model.lm_head.weight  # its columns over new dims read zeros
        _norm(dst.norm.weight, src.norm.weight, scale)
        placed = _placement(old.num_hidden_layers, growth.layers)
        for index, layer in enumerate(dst.layers):
            if index in placed:
                _copy_layer(layer, src.layers[placed[index]], old, scale)
            else:  # a new layer: the identity until training moves its writers off zero
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
                layer.input_layernorm.weight.fill_(scale)
                layer.post_attention_layernorm.weight.fill_(scale)
    return big.eval()


def _grown_config(old: LlamaConfig, growth: Growth) -> LlamaConfig:
    heads, kv_heads = int(old.num_attention_heads), int(old.num_key_value_heads or old.num_attention_heads)
    head_dim = getattr(old, "head_dim", None) or old.hidden_size // heads
    group = heads // kv_heads
    checks = {
        "hidden": growth.hidden >= old.hidden_size,
        "heads": growth.heads >= heads and growth.heads * head_dim == growth.hidden,
        "kv_heads": growth.kv_heads >= kv_heads and growth.heads == growth.kv_heads * group,
        "intermediate": growth.intermediate >= old.intermediate_size,
        "layers": growth.layers >= old.num_hidden_layers,
    }
    bad = [name for name, ok in checks.items() if not ok]
    if bad:
        raise ValueError(
            f"growth.{bad[0]}: a grown model keeps the head size ({head_dim}) and the key-value group "
            f"size ({group}) and shrinks nothing; got {growth}"
        )
    if old.tie_word_embeddings or getattr(old, "attention_bias", False) or getattr(old, "mlp_bias", False):
        raise ValueError("growth needs untied embeddings and no biases (the zoo's Llamas have neither)")
    config = LlamaConfig(**{**old.to_dict(), "architectures": None})
    config.hidden_size = growth.hidden
    config.num_attention_heads = growth.heads
    config.num_key_value_heads = growth.kv_heads
    config.head_dim = head_dim
    config.intermediate_size = growth.intermediate
    config.num_hidden_layers = growth.layers
    config.rms_norm_eps = old.rms_norm_eps * old.hidden_size / growth.hidden
    return config


def _placement(old_layers: int, new_layers: int) -> dict[int, int]:
    """{new index: old index}: old layers in order, the new ones spread evenly after them."""
    return {j * new_layers // old_layers: j for j in range(old_layers)}


def _norm(into: torch.Tensor, gain: torch.Tensor, scale: float) -> None:
    d = gain.shape[0]
    into[:d] = gain * scale
    into[d:] = float(gain.mean()) * scale  # multiplies zeros until training moves them


def _copy_layer(new, old, old_config: LlamaConfig, scale: float) -> None:
    d = old_config.hidden_size
    q_rows = old.self_attn.q_proj.weight.shape[0]  # old heads x head_dim
    kv_rows = old.self_attn.k_proj.weight.shape[0]
    units = old.mlp.gate_proj.weight.shape[0]
    attn, mlp = new.self_attn, new.mlp
    attn.q_proj.weight[:q_rows, :d] = old.self_attn.q_proj.weight
    attn.k_proj.weight[:kv_rows, :d] = old.self_attn.k_proj.weight
    attn.v_proj.weight[:kv_rows, :d] = old.self_attn.v_proj.weight
    attn.o_proj.weight.zero_()  # new heads and new dimensions write nothing
    attn.o_proj.weight[:d, :q_rows] = old.self_attn.o_proj.weight
    mlp.gate_proj.weight[:units, :d] = old.mlp.gate_proj.weight
    mlp.up_proj.weight[:units, :d] = old.mlp.up_proj.weight
    mlp.down_proj.weight.zero_()  # new units and new dimensions write nothing
    mlp.down_proj.weight[:d, :units] = old.mlp.down_proj.weight
    _norm(new.input_layernorm.weight, old.input_layernorm.weight, scale)
    _norm(new.post_attention_layernorm.weight, old.post_attention_layernorm.weight, scale)
