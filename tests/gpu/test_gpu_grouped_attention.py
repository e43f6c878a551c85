"""models.attention.grouped_sdpa on cuda: grouped-query heads packed over their KV head attend as SDPA over the
heads repeated (transformers' `repeat_kv`), in float32 and bfloat16, under an additive mask (the pool passes')
and a boolean one (the lean forward's), each also packed once as a pool pass packs it, and a pool pass on the GPU
(ragged, then a lone verification row) never repeats the KV heads and gives the model's own logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv

from cascade_service.models.attention import grouped_sdpa, pack_mask
from cascade_service.models.batching import Pass, forward_batch
from cascade_service.models.hf import HFModel
from cascade_service.zoo.tiny import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("steps", [1, 7])
@pytest.mark.parametrize("boolean", [False, True])
def test_packed_heads_attend_as_repeated_heads_on_cuda(dtype, steps, boolean):
    gen = torch.Generator(device="cuda").manual_seed(steps)
    batch, heads, kv, width, dim = 4, 12, 2, 300, 64
    query = torch.randn(batch, steps, heads, dim, generator=gen, device="cuda", dtype=dtype).transpose(1, 2)
    key = torch.randn(batch, kv, width, dim, generator=gen, device="cuda", dtype=dtype)
    value = torch.randn(batch, kv, width, dim, generator=gen, device="cuda", dtype=dtype)
    lengths = (
        torch.tensor([40, 120, 250, 300 - steps], device="cuda")[:, None, None, None]
        + torch.arange(steps, device="cuda")[:, None]
    )
    visible = torch.arange(width, device="cuda") < lengths  # [B, 1, s, W]
    mask = (
        visible
        if boolean
        else torch.zeros(visible.shape, dtype=dtype, device="cuda").masked_fill_(~visible, torch.finfo(dtype).min)
    )
    want = F.scaled_dot_product_attention(
        query, repeat_kv(key, heads // kv), repeat_kv(value, heads // kv), attn_mask=mask
    )
    got = grouped_sdpa(query, key, value, mask, None)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    # as a pool pass runs it: the mask packed once (additive, in the query's dtype) and handed to every layer
    packed = grouped_sdpa(query, key, value, None, None, pack_mask(mask, heads // kv, dtype))
    torch.testing.assert_close(packed, want, rtol=tolerance, atol=tolerance)


def test_a_cuda_pool_pass_never_repeats_key_heads_and_matches_the_model(tiny_family, monkeypatch):
    model = HFModel.load(tiny_family["mid"], device="cuda", backend="hf", kv="pool", graphs="off")
    histories = random_prompts(2, 30, seed=41)
    caches = [model.new_cache() for _ in histories]
    for cache, history in zip(caches, histories):
        forward_batch(model, [Pass(history[:20], cache, 1, False)])
    with torch.inference_mode():
        want = [
            model.module(input_ids=torch.tensor([h[:20] + [5, 6, 7, 8]], device="cuda")).logits[0, -4:]
            for h in histories
        ]

    def copied(*args, **kwargs):
        raise AssertionError("a pool pass repeated the KV heads")

    monkeypatch.setattr("transformers.integrations.sdpa_attention.repeat_kv", copied)
    with torch.inference_mode():
        rows = forward_batch(model, [Pass([5, 6, 7, 8], caches[0], 4, False), Pass([5], caches[1], 1, False)])
        lone = forward_batch(model, [Pass([6, 7, 8], caches[1], 3, False)])[0]
    torch.testing.assert_close(rows[0], want[0].float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rows[1], want[1][:1].float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lone, want[1][1:].float(), rtol=1e-4, atol=1e-4)
