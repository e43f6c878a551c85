"""models.staticpass: a lean model's pass over the KV pool in bucket shapes gives each row the logits of
the model's own forward over that row's whole sequence, with rows of different lengths, padding rows
and tokens, and blocks shared by a prefix; the caches then hold exactly the new tokens."""

from __future__ import annotations

import torch

from cascade_service.models.hf import HFModel
from cascade_service.models.staticpass import ROW_BUCKETS, forward_static_rows, static_inputs
from cascade_service.zoo.tiny import random_prompts


def _reference(model: HFModel, sequence: list[int], n: int) -> torch.Tensor:
    with torch.inference_mode():
        return model.module(input_ids=torch.tensor([sequence])).logits[0, -n:].float()


def test_a_bucketed_pass_gives_each_row_its_own_forwards_logits(tiny_family):
    model = HFModel.load(tiny_family["mid"], backend="lean", kv="pool")
    histories = random_prompts(3, 40, seed=5)
    histories[1] = histories[1][:7]  # rows of different lengths: padding within the width bucket
    caches = [model.new_cache() for _ in histories]
    for cache, history in zip(caches, histories):
        with torch.inference_mode():
            model.forward_now(history, cache, 1)
    news = [[11, 12, 13], [14], [15, 16]]  # 3 rows -> the 4-row bucket, 3 tokens -> the 4-token bucket
    inputs = static_inputs(caches, news, model.dtype, model.device)
    assert inputs is not None and inputs.ids.shape == (4, 4) and inputs.mask.shape[-1] == 256
    got = forward_static_rows(model, news, caches)
    assert got is not None
    for cache, history, new, rows in zip(caches, histories, news, got):
        expected = _reference(model, history + new, len(new))
        torch.testing.assert_close(rows, expected, rtol=1e-4, atol=1e-4)
        assert cache.length == len(history) + len(new)
    # The next step reads what the static pass wrote: it agrees with the reference too.
    got = forward_static_rows(model, [[21], [22], [23]], caches)
    for history, new, rows, nxt in zip(histories, news, got, (21, 22, 23)):
        torch.testing.assert_close(rows, _reference(model, history + new + [nxt], 1), rtol=1e-4, atol=1e-4)


def test_a_pass_past_the_buckets_is_left_to_the_eager_path(tiny_family):
    model = HFModel.load(tiny_family["mid"], backend="lean", kv="pool")
    caches = [model.new_cache() for _ in range(ROW_BUCKETS[-1] + 1)]
    assert forward_static_rows(model, [[1]] * len(caches), caches) is None
    assert all(cache.length == 0 and not cache.table for cache in caches)  # nothing taken
    one = model.new_cache()
    assert forward_static_rows(model, [list(range(1, 40))], [one]) is None  # 39 tokens: no token bucket
    assert one.length == 0
