"""models.attention.grouped_sdpa: grouped-query attention over uncopied key/value heads equals
SDPA over the heads repeated (transformers' `repeat_kv`, the oracle) for any query count, under
additive and boolean masks, a mask shared by the batch, and one head per KV head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv

from cascade_service.models.attention import grouped_sdpa, pack_mask


def _mask(batch: int, steps: int, width: int, seed: int, boolean: bool) -> torch.Tensor:
    # Each query row sees a prefix of the keys of its own length (a cache and its earlier new tokens).
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width - steps + 1, (batch, 1, 1, 1), generator=gen) + torch.arange(steps)[:, None]
    visible = torch.arange(width) < lengths  # [B, 1, s, W]
    if boolean:
        return visible
    return torch.zeros(visible.shape).masked_fill_(~visible, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("steps", [1, 2, 5, 11])
@pytest.mark.parametrize("heads,kv", [(6, 2), (4, 1), (3, 3)])
@pytest.mark.parametrize("boolean", [False, True])
def test_packed_heads_attend_as_repeated_heads(steps, heads, kv, boolean):
    gen = torch.Generator().manual_seed(steps * 100 + heads * 10 + kv)
    batch, width, dim = 3, 40, 8
    query = torch.randn(batch, steps, heads, dim, generator=gen).transpose(1, 2)  # as attention layers hand it
    key = torch.randn(batch, kv, width, dim, generator=gen)
    value = torch.randn(batch, kv, width, dim, generator=gen)
    mask = _mask(batch, steps, width, seed=steps, boolean=boolean)
    want = F.scaled_dot_product_attention(
        query, repeat_kv(key, heads // kv), repeat_kv(value, heads // kv), attn_mask=mask, scale=0.3
    )
    got = grouped_sdpa(query, key, value, mask, 0.3)
    assert got.shape == (batch, heads, steps, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_mask_shared_by_the_batch_and_no_mask_attend_as_repeated_heads():
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(2, 4, 3, 8, generator=gen)
    key, value = torch.randn(2, 2, 9, 8, generator=gen), torch.randn(2, 2, 9, 8, generator=gen)
    for mask in (_mask(1, 3, 9, seed=1, boolean=False), None):
        want = F.scaled_dot_product_attention(query, repeat_kv(key, 2), repeat_kv(value, 2), attn_mask=mask)
        torch.testing.assert_close(grouped_sdpa(query, key, value, mask, None), want, rtol=1e-5, atol=1e-6)


def test_a_mask_per_head_is_refused_by_name():
    query, key = torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 5, 8)
    with pytest.raises(ValueError, match="shared by the heads"):
        grouped_sdpa(query, key, key, torch.zeros(1, 4, 2, 5), None)


@pytest.mark.parametrize("steps", [1, 2, 7])
@pytest.mark.parametrize("heads,kv", [(6, 2), (3, 3)])
def test_a_packed_additive_mask_gives_the_boolean_masks_outputs_bit_for_bit(steps, heads, kv):
    # A pool pass packs its mask once and hands SDPA the additive form (pack_mask with a dtype), where
    # SDPA made it of the boolean one on every call: the outputs must be the same floats, a row with
    # no visible key included.
    gen = torch.Generator().manual_seed(steps * 10 + heads)
    batch, width, dim = 3, 40, 8
    query = torch.randn(batch, steps, heads, dim, generator=gen).transpose(1, 2)
    key = torch.randn(batch, kv, width, dim, generator=gen)
    value = torch.randn(batch, kv, width, dim, generator=gen)
    mask = _mask(batch, steps, width, seed=steps, boolean=True)
    mask[1, 0, 0] = False  # a row that sees nothing
    want = grouped_sdpa(query, key, value, mask, 0.3)
    packed = pack_mask(mask, heads // kv, torch.float32)
    assert packed is not None and packed.dtype == torch.float32
    got = grouped_sdpa(query, key, value, None, 0.3, packed)
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
