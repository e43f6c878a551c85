"""A drafter's forward pass written out in plain torch ops: the `lean` backend of a model tier.

On a CPU a small drafter's decode step is mostly fixed per-call overhead, not arithmetic: the demo
zoo's one-layer small model does 0.35 MFLOP per token, yet transformers' forward takes about 0.27 ms
(mask and position bookkeeping, the cache's layer objects, output dataclasses, a module call per
norm). A drafter's numerics never change the cascade's output, because the target reviews every
token it proposes, so a drafter may run any forward that computes the same function up to rounding.
`LeanLlama` is that forward for Llama-family weights: q, k and v in one matmul, gate and up in one,
rotary embedding from a precomputed table, `F.rms_norm` and `scaled_dot_product_attention` with
grouped heads, about 15 kernel calls per layer. In bfloat16 or float16 it rounds where transformers'
Llama does: RMSNorm in float32, rounded to the dtype, then times the weight; cos and sin in float32,
then rounded; attention by the same SDPA call as transformers' default `sdpa` path (softmax inside
the kernel in float32). On the CPU its bf16 logits equal transformers' (tests/integration/test_lean.py).

It keeps transformers' calling convention (input_ids, cache or past_key_values, attention_mask,
position_ids, logits_to_keep, output_hidden_states) and the same `DynamicCache`, so the scorer, the
batcher and `step_time_s` drive it unchanged. The target never runs on it (config refuses it there):
the target's transformers forward is what the output must equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .attention import grouped_sdpa
from .cpukernels import quantize_int8

_ROTARY_KINDS = ("default", None)


@dataclass
class LeanOutput:
    """The two fields of transformers' CausalLMOutputWithPast that the tiers read."""

    logits: torch.Tensor  # [B, kept rows, V]
    hidden_states: tuple[torch.Tensor, ...] | None  # (final-norm output [B, S, H],) when asked for


def unsupported(config: Any) -> str | None:
    """Why a model config cannot run on the lean forward; None when it can."""
    if getattr(config, "model_type", None) != "llama":
        return f"model_type {getattr(config, 'model_type', None)!r} (lean runs llama)"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "attention or MLP biases"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) not in _ROTARY_KINDS:
        return f"rotary scaling {rope.get('rope_type', rope.get('type'))!r}"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp"
    return None


class _Layer(nn.Module):
    norm_in: torch.Tensor
    norm_mid: torch.Tensor
    qkv: torch.Tensor
    out: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor

    def __init__(self, layer: Any):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.norm_in = layer.input_layernorm.weight
        self.norm_mid = layer.post_attention_layernorm.weight
        # One matmul for q, k, v and one for gate, up: the weights side by side (a copy, made once).
        self.qkv = nn.Parameter(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), False)
        self.out = attn.o_proj.weight
        self.gate_up = nn.Parameter(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), False)
        self.down = mlp.down_proj.weight


class LeanLlama(nn.Module):
    """A LlamaForCausalLM's forward in plain torch ops over the same weights (see the module doc)."""

    embed: torch.Tensor
    norm: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, module: Any):
        super().__init__()
        reason = unsupported(module.config)
        if reason is not None:
            raise ValueError(f"the lean backend cannot run this model: {reason}; use backend: hf")
        config = module.config
        self.config = config
        self.generation_config = getattr(module, "generation_config", None)
        body = module.model
        self.embed = body.embed_tokens.weight
        self.blocks = [_Layer(layer) for layer in body.layers]  # typed, for the loop
        self.layers = nn.ModuleList(self.blocks)  # registered: .parameters(), .to()
        self.norm = body.norm.weight
        self.lm_head = module.lm_head
        self.eps = float(config.rms_norm_eps)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        # cos and sin of every position the model holds, as transformers' LlamaRotaryEmbedding makes
        # them (float32, then the weights' dtype), indexed instead of recomputed per call.
        rotary = body.rotary_emb
        positions = int(getattr(config, "max_position_embeddings", 0) or 4096)
        freqs = (
            torch.arange(positions, dtype=torch.float32, device=self.embed.device)[:, None] * rotary.inv_freq.float()
        )
        table = torch.cat([freqs, freqs], dim=-1)
        scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.register_buffer("cos", (table.cos() * scale).to(self.embed.dtype), persistent=False)
        self.register_buffer("sin", (table.sin() * scale).to(self.embed.dtype), persistent=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: Any = None,
        use_cache: bool = True,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_hidden_states: bool = False,
        past_key_values: Any = None,
    ) -> LeanOutput:
        # `cache` is transformers 5.2x's name (models.cachearg); `past_key_values`, the older one, is
        # taken too, as transformers' own forwards take it until 5.40.
        if cache is not None and past_key_values is not None:
            raise ValueError("the lean forward got both cache and past_key_values: pass cache only")
        batch, steps = input_ids.shape
        cache = (cache if cache is not None else past_key_values) if use_cache else None
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + steps, device=input_ids.device).expand(batch, steps)
        cos, sin = self.cos[position_ids].unsqueeze(1), self.sin[position_ids].unsqueeze(1)  # [B, 1, S, D]
        mask = _mask(attention_mask, batch, steps, past, input_ids.device)
        x = F.embedding(input_ids, self.embed)
        for index, layer in enumerate(self.blocks):
            x = x + self._attend(layer, rms_norm(x, layer.norm_in, self.eps), cos, sin, cache, index, mask)
            h = rms_norm(x, layer.norm_mid, self.eps)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        x = rms_norm(x, self.norm, self.eps)
        kept = _keep(x, logits_to_keep)
        return LeanOutput(self.lm_head(kept), (x,) if output_hidden_states else None)

    def _attend(
        self,
        layer: _Layer,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: Any,
        index: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        batch, steps, _ = h.shape
        heads, kv, dim = self.heads, self.kv_heads, self.head_dim
        qkv = F.linear(h, layer.qkv).view(batch, steps, heads + 2 * kv, dim).transpose(1, 2)  # [B, n, S, D]
        # q and k rotate together: one rotation over heads + kv_heads rows.
        qk = qkv[:, : heads + kv]
        qk = qk * cos + rotate_half(qk) * sin
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv :]
        if cache is not None:
            k, v = cache.update(k, v, index)
        if mask is None and steps > 1:  # a prefill from an empty cache (`_mask`)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv)
        else:  # grouped query heads packed over their KV head, not repeated (models.attention)
            out = grouped_sdpa(q, k, v, mask, None)
        return F.linear(out.transpose(1, 2).reshape(batch, steps, heads * dim), layer.out)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], weight, eps)  # one kernel: the same function in float32
    # In a 16-bit dtype, transformers' LlamaRMSNorm order and roundings: the norm in float32, rounded
    # to the dtype, then times the weight in the dtype (F.rms_norm would multiply before rounding).
    return weight * F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _mask(attention_mask: torch.Tensor | None, batch: int, steps: int, past: int, device: torch.device):
    """The boolean attention mask [B, 1, S, past + S] (True: attend), or None where no key is hidden.

    A single new token with no padding sees every key: no mask. A block of new tokens after a cache
    needs the causal mask shifted by the cache's length, which `is_causal` (aligned top-left) is not.
    `attention_mask` [B, past + S] marks the batcher's left padding of shorter caches with 0; a 4D
    one (a pool pass's, models.kvpool) is already the whole additive mask.
    """
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    if attention_mask is None and (steps == 1 or past == 0):
        return None  # a lone step, or a prompt from scratch (is_causal)
    width = past + steps
    allowed = torch.ones(steps, width, dtype=torch.bool, device=device).tril(diagonal=past)  # [S, W]
    if attention_mask is None:
        return allowed[None, None]
    return allowed[None, None] & attention_mask[:, None, None, :].bool()


def _keep(x: torch.Tensor, keep: int | torch.Tensor) -> torch.Tensor:
    if isinstance(keep, torch.Tensor):
        return x[:, keep]
    return x if keep == 0 else x[:, -keep:]


# The backends a model tier may name (config: `backend:`), each turning a loaded transformers model
# into the module the tier runs. The config's list of names (config.base.BACKENDS) is this one's keys.
BACKENDS: dict[str, Callable[[Any], Any]] = {
    "hf": lambda module: module,
    "lean": LeanLlama,
    "int8": quantize_int8,  # transformers' forward over int8 linear layers (models.cpukernels)
}
