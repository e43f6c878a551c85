"""A batched pass over requests that each keep a `DynamicCache` (`kv: dynamic`): pack, run, unpack.

The storage before `models.kvpool` (`kv: pool`, the default), kept for models and setups the pool does
not serve and to measure one against the other (`cascade-service bench kv`).

A batched pass over ragged requests: row i has L_i cached tokens and s_i new ones.
    past   left-padded to L = max L_i: [pad x (L - L_i)] [cache_i]   (pads masked out)
    input  right-padded to S = max s_i: [new_i] [pad x (S - s_i)]     (after the real tokens, so no real
                                                                       query sees them: causality)
    positions L_i + j, so rotary / absolute positions are each request's own.
Every query sees at least its own key, so no attention row is fully masked. Afterwards each request's
cache gets the keys/values of its s_i real new tokens appended, and its logits rows are gathered from
the positions it asked for. Every row's cache is copied into the packed one and its new keys copied
back out, per layer, on every pass: what the pool does not do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from .cachearg import cache_kwargs
from .rows import padded_inputs, split_outputs


def forward_packed(model: Any, batch: Sequence[Any]) -> list[object]:
    """One forward pass for several requests' passes (fed, cache, keep, with_hidden) over their own
    `DynamicCache`s; see the module docstring."""
    device = model.device
    past = [item.cache.get_seq_length() for item in batch]
    ids, news, wanted = padded_inputs(batch, device)
    width, steps = max(past), ids.shape[1]
    mask = torch.ones((len(batch), width + steps), dtype=torch.long, device=device)
    positions = torch.empty((len(batch), steps), dtype=torch.long, device=device)
    for i in range(len(batch)):
        mask[i, : width - past[i]] = 0
        positions[i] = torch.arange(past[i], past[i] + steps, device=device)
    packed = _pack([item.cache for item in batch], past, width, model)
    out = model.module(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        **cache_kwargs(model.module, packed),
        use_cache=True,
        logits_to_keep=torch.tensor(wanted, device=device),
        output_hidden_states=any(item.with_hidden for item in batch),
    )
    for i, (item, s) in enumerate(zip(batch, news)):
        _append(item.cache, packed, i, width, s)
    return split_outputs(out, batch, news, wanted)


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, each [1, kv_heads, len, head_dim]; empty for a fresh cache."""
    if hasattr(cache, "layers"):  # transformers 5.x
        # Each layer type transformers has is read the same way; its stubs do not say so.
        return [
            (layer.keys, layer.values)  # type: ignore[union-attr,misc]
            for layer in cache.layers
            if getattr(layer, "keys", None) is not None and layer.keys.numel()  # type: ignore[union-attr]
        ]
    return list(zip(cache.key_cache, cache.value_cache))  # type: ignore[attr-defined]  # 4.x


def _pack(caches: list[DynamicCache], past: list[int], width: int, model: Any) -> DynamicCache:
    packed = DynamicCache()
    if width == 0:
        return packed
    layers = [_layers(c) for c in caches]
    template = next(kv for kv, n in zip(layers, past) if n)
    for layer, (k0, v0) in enumerate(template):
        keys = k0.new_zeros((len(caches), k0.shape[1], width, k0.shape[3]))
        values = v0.new_zeros((len(caches), v0.shape[1], width, v0.shape[3]))
        for i, n in enumerate(past):
            if n:
                k, v = layers[i][layer]
                keys[i, :, width - n :] = k[0]
                values[i, :, width - n :] = v[0]
        packed.update(keys, values, layer)
    return packed


def _append(cache: DynamicCache, packed: DynamicCache, row: int, width: int, new: int) -> None:
    # The packed cache now holds width + S positions per row; this row's real new ones follow `width`.
    for layer, (keys, values) in enumerate(_layers(packed)):
        cache.update(
            keys[row : row + 1, :, width : width + new].clone(),
            values[row : row + 1, :, width : width + new].clone(),
            layer,
        )
