"""Grouped-query attention that reads each key/value head once.

A model with fewer key/value heads than query heads (every family we serve: the shipped one has 6
query heads over 2, Qwen2.5-Coder 1.5B 12 over 2) pairs each KV head with a group of query heads.
transformers' SDPA path copies every KV head once per query head of its group (`repeat_kv`) whenever
more than one query token attends under a mask, which is every verification, every prefill chunk and
every multi-token row of a ragged pass: a copy of every row's whole keys and values, per layer, per
pass. On the 2-core host a 16-row pass of 5-token verifications took 41.7 ms against 7.4 for one-token
rows; packed, 10.0 (`bench mixedpass`, docs/benchmarks.md "KV storage").

Here a group's query heads become extra query rows of their KV head instead ([B, H, s, d] ->
[B, KV, (H / KV) * s, d]), each row under its own token's mask row, so one SDPA call over the
uncopied keys computes exactly what the repeated form does (each query row attends to the same keys
under the same mask). What is copied is the mask, s x W per row, not the keys, KV x W x d per row.
transformers does the same for a single query token (`pack_gqa`); this extends it to any count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float | None
) -> torch.Tensor:
    """SDPA of query [B, H, s, d] over key, value [B, KV, W, d] (H a multiple of KV) under an additive
    or boolean `mask` shared by every head ([B or 1, 1, s, W]; None: every key is visible to every
    query, not causal) -> [B, H, s, d]."""
    batch, heads, steps, dim = query.shape
    kv = key.shape[1]
    if heads == kv:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    if mask is not None and mask.shape[1] != 1:
        raise ValueError(f"grouped_sdpa takes a mask shared by the heads ([B, 1, s, W]), got {tuple(mask.shape)}")
    group = heads // kv
    # Query head h = g * group + r (the order repeat_kv pairs them in) becomes row r * s + j of KV head g.
    packed = query.reshape(batch, kv, group * steps, dim)
    if mask is not None and steps > 1:  # one token's mask row broadcasts over its group as it is
        width = mask.shape[-1]
        mask = mask[:, :, None].expand(mask.shape[0], 1, group, steps, width).reshape(-1, 1, group * steps, width)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scale)
    return out.view(batch, heads, steps, dim)
