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
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    packed_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA of query [B, H, s, d] over key, value [B, KV, W, d] (H a multiple of KV) under an additive
    or boolean `mask` shared by every head ([B or 1, 1, s, W]; None: every key is visible to every
    query, not causal) -> [B, H, s, d]. `packed_mask`: `pack_mask(mask, H // KV)` made already (a
    pass's layers share one mask: models.poolpass packs it once a pass)."""
    batch, heads, steps, dim = query.shape
    kv = key.shape[1]
    group = heads // kv
    if packed_mask is None:
        packed_mask = pack_mask(mask, group)
    if heads == kv:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=packed_mask, scale=scale)
    # Query head h = g * group + r (the order repeat_kv pairs them in) becomes row r * s + j of KV head g.
    packed = query.reshape(batch, kv, group * steps, dim)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=packed_mask, scale=scale)
    return out.view(batch, heads, steps, dim)


def pack_mask(mask: torch.Tensor | None, group: int, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """A mask shared by the heads ([B, 1, s, W]) for `grouped_sdpa`'s packed queries: each token's row
    once per query head of a group ([B, 1, group * s, W]; one token's row broadcasts as it is, and
    with no grouping the mask stays as it is, per head too). With a `dtype`, a boolean mask becomes
    the additive one SDPA would make of it on every call (0 where visible, -inf elsewhere: the same
    outputs bit for bit, tested). Both are copies (the packing 14 us a layer at 2 x 101 on this host,
    where an SDPA call without a mask took 11, and a boolean mask added 5-15 us to it): a pass's
    layers share one mask, so models.poolpass makes this once a pass."""
    if mask is None:
        return None
    if group > 1 and mask.shape[2] > 1:
        if mask.shape[1] != 1:
            raise ValueError(f"grouped_sdpa takes a mask shared by the heads ([B, 1, s, W]), got {tuple(mask.shape)}")
        steps, width = mask.shape[2], mask.shape[-1]
        mask = mask[:, :, None].expand(mask.shape[0], 1, group, steps, width).reshape(-1, 1, group * steps, width)
    if dtype is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask
