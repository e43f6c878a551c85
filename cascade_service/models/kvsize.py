"""How much a model's KV cache holds per token, and the budget of its paged pool (models.kvpool).

`kv_budget_mb` (config: per tier, or `model.kv_budget_mb` for all) bounds a model's pool: its tensors
never outgrow it; under it, blocks of finished requests stay cached for their prefixes, least recently
used first to go. Unset, the budget is DEFAULT_FRACTION of the device's memory (on a GPU, within half of
what is free once the weights are in: `default_budget`). A budget that cannot
hold one request of the model's whole context is refused when the model loads.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .kvpool import BLOCK, KVPool

DEFAULT_FRACTION = 0.1  # of the device's memory, per model, when the config names no budget
FREE_FRACTION = 0.5  # on a GPU, also at most this share of what is free once the model's weights are in


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a decoder's attention cache, from its transformers config."""
    layers = int(config.num_hidden_layers)  # GPT-2's n_layer is mapped to this name
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return layers, kv_heads, head_dim


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """The bytes one position's keys and values take in every layer."""
    layers, kv_heads, head_dim = kv_shape(config)
    return layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def device_memory(device: torch.device) -> int:
    """The device's total memory in bytes (the host's RAM for the CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_budget(device: torch.device) -> int:
    """A model's KV budget when its config names none: DEFAULT_FRACTION of the device's memory, and on a
    GPU no more than FREE_FRACTION of its free memory now (the weights loaded; other models and other
    processes hold the rest), as vLLM and SGLang size their KV caches from what is free. Under captured
    graphs the pool is made at up to this size before the first capture (models.graphs.start_graphs)."""
    budget = int(device_memory(device) * DEFAULT_FRACTION)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = min(budget, int(free * FREE_FRACTION))
    return budget


def kv_pool(config: Any, dtype: torch.dtype, device: torch.device, budget_mb: float | None, name: str) -> KVPool:
    """The paged pool of a model (its budget checked against its context); an encoder-decoder model
    keeps its own caches (models.seq2seq) and gets an unbounded, unused pool."""
    if getattr(config, "is_encoder_decoder", False):
        return KVPool()
    layers = kv_shape(config)[0]
    per_token = kv_bytes_per_token(config, dtype)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 0
    # One request of the whole context, in whole blocks, and block 0 (never a request's).
    least = (-(-int(positions) // BLOCK) + 1) * BLOCK * per_token
    if budget_mb is None:
        budget = max(default_budget(device), least)
    else:
        budget = int(budget_mb * 2**20)
        if budget < least:
            raise ValueError(
                f"kv_budget_mb: {budget_mb} MiB cannot hold one request of {name}'s {positions} positions "
                f"({per_token} bytes each): at least {least / 2**20:.2f} MiB"
            )
    return KVPool(layers, per_token // layers, budget)
