"""Batching in the engine loop (engine/loop.py, models/batching.py): which passes share a batch,
chunked prefills, every ready request in one pass, and fair turns.

Each choice is checked for what it promises (padding within bounds, the oldest pass always goes, a
chunked prefill equals one pass, no request starves) and, where tokens come out, against the oracle.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from transformers import DynamicCache

from cascade_service.config import GenerationConfig, MaGConfig, ModelTierConfig, make_cascade
from cascade_service.engine.core import EngineCore
from cascade_service.inprocess import InProcess
from cascade_service.models.batching import Pass
from cascade_service.models.hf import HFModel
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import oracle


def test_a_batch_groups_passes_of_similar_length_and_always_takes_the_oldest():
    from cascade_service.engine.clock import PAD_WASTE
    from cascade_service.engine.scheduler import take_batch

    def passes(*lengths):
        return [Pass([0] * n, DynamicCache(), 1, False) for n in lengths]

    pending = passes(1, 100, 1, 2, 1, 98)
    batch = take_batch(pending, max_batch=64)
    assert batch[0] is pending[0] and [len(p.fed) for p in batch] == [1, 1, 1]  # the prefills wait
    assert len(batch) * max(len(p.fed) for p in batch) <= PAD_WASTE * sum(len(p.fed) for p in batch)
    rest = [p for p in pending if all(p is not b for b in batch)]
    # the oldest first, with its like; a short pass fits in beside two long ones (300 <= 1.5 * 200)
    assert [len(p.fed) for p in take_batch(rest, 64)] == [100, 98, 2]
    assert [len(p.fed) for p in take_batch(passes(2, 1, 1, 1), 64)] == [2, 1, 1]  # 4 rows of 2 > 1.5 * 5
    assert len(take_batch(passes(*[1] * 10), max_batch=4)) == 4


def test_a_ragged_models_batch_mixes_new_token_counts_and_is_bound_by_its_keys_alone():
    from cascade_service.engine.scheduler import take_batch

    # Fifteen decode steps and a 7-token verification: padded, 16 rows of 7 > 1.5 x 22 real queries, so
    # the verification waits; ragged, it joins (its extra tokens are all it adds).
    steps = [_cached(40 + i) for i in range(15)]
    verification = _cached(45, new=7)
    assert verification not in take_batch(steps + [verification], max_batch=64)
    assert take_batch(steps + [verification], max_batch=64, ragged=True) == steps + [verification]
    # A prefill chunk joins too; a cache of 4,000 positions still does not (its keys would pad the rest).
    chunk, long = _cached(0, new=16), _cached(4000)
    batch = take_batch(steps + [chunk, long], max_batch=64, ragged=True)
    assert chunk in batch and long not in batch


def test_a_ragged_models_row_is_priced_by_its_own_tokens():
    from cascade_service.engine.clock import PassTimer

    padded, ragged = PassTimer(min_passes=4), PassTimer(min_passes=4)
    ragged.ragged = True
    for timer in (padded, ragged):
        for rows in (4, 8, 12, 16):
            for tokens in (rows, rows + 6):  # one-token rows, with and without a 7-token row
                timer.record(rows, tokens, 0.01 + 0.001 * rows + 0.002 * tokens, longest=1 if tokens == rows else 7)
    # A 7-token row: padded, it would pad every pass of one-token rows (or go alone); ragged, it shares
    # the fixed part and pays its 7 tokens.
    assert ragged.row_seconds(7) < padded.row_seconds(7)
    assert ragged.row_seconds(1) < padded.row_seconds(1)  # nor is a decode step padded to a verification's 7
    cost = ragged.cost()
    assert cost is not None and ragged.row_seconds(7) - ragged.row_seconds(1) == pytest.approx(6 * cost.per_token_s)


def _cached(past: int, new: int = 1) -> Pass:
    """A pass feeding `new` tokens to a cache of `past` positions (synthetic keys and values)."""
    cache = DynamicCache()
    if past:
        cache.update(torch.zeros(1, 1, past, 1), torch.zeros(1, 1, past, 1), 0)
    return Pass([0] * new, cache, 1, False)


def _padding_within_bounds(batch: list[Pass]) -> bool:
    from cascade_service.engine.clock import PAD_WASTE, ROW_POSITIONS

    past = [p.cache.get_seq_length() for p in batch]
    news = [len(p.fed) for p in batch]
    width, steps, rows = max(past), max(news), len(batch)
    return rows * steps <= PAD_WASTE * sum(news) and rows * (width + steps + ROW_POSITIONS) <= PAD_WASTE * sum(
        p + s + ROW_POSITIONS for p, s in zip(past, news)
    )


def test_a_long_cache_is_not_batched_with_short_ones_and_the_oldest_pass_always_goes():
    from cascade_service.engine.scheduler import take_batch

    shorts = [_cached(30 + 3 * i) for i in range(16)]  # ragged short caches: 30 to 75 positions
    long = _cached(4000)
    pending = shorts[:5] + [long] + shorts[5:]
    batch = take_batch(pending, max_batch=64)
    assert batch[0] is shorts[0] and len(batch) == 16 and all(p is not long for p in batch)
    assert _padding_within_bounds(batch)
    # The long one, oldest now, goes alone: no short cache is padded to 4,000 positions.
    assert take_batch([long] + shorts, max_batch=64) == [long]
    # Long caches of similar lengths share a pass; the short ones wait for the next.
    other_long = _cached(3600, new=2)
    batch = take_batch([long] + shorts + [other_long], max_batch=64)
    assert batch == [long, other_long] and _padding_within_bounds(batch)
    # Without the cached lengths (the new tokens alone) all 18 would have fitted in one pass.
    assert not _padding_within_bounds([long] + shorts + [other_long])


def test_short_caches_of_different_lengths_are_grouped_by_their_new_tokens_alone():
    from cascade_service.engine.scheduler import take_batch

    # Short caches count alike (a row costs ROW_POSITIONS whatever its cache): a prefill of 4 tokens
    # and steps of 1 to 3 over caches of 0 to 200 positions are grouped as with empty caches.
    pending = [_cached(0, new=4)] + [_cached(40 * i, new=1 + i % 3) for i in range(6)]
    batch = take_batch(pending, max_batch=64)
    assert batch[0] is pending[0] and _padding_within_bounds(batch)
    assert sorted(len(p.fed) for p in batch) == [2, 2, 3, 3, 4]


def test_prefill_chunks_cover_the_tokens_once_with_every_kept_row_in_the_last():
    import itertools

    from cascade_service.engine.scheduler import chunk_end

    def chunks(n, keep, size):
        bounds = [0]
        while bounds[-1] < n:
            bounds.append(chunk_end(n, bounds[-1], keep, size))
        return [b - a for a, b in itertools.pairwise(bounds)]

    assert chunks(1000, 1, 256) == [256, 256, 256, 232]
    assert chunks(512, 1, 256) == [256, 256] and chunks(257, 1, 256) == [256, 1]
    assert chunks(1000, 300, 256) == [256, 256, 188, 300]  # the 300 kept rows in one pass
    assert chunks(256, 1, 256) == [256] and chunks(10, 1, 0) == [10] and chunks(5, 5, 2) == [5]


def _loop_with(model, **settings):
    from cascade_service.engine.loop import TaskLoop
    from cascade_service.models.batching import executor

    loop = TaskLoop("test-loop")
    batcher = loop.batcher(model.name, executor(model))
    for name, value in settings.items():
        setattr(batcher, name, value)
    return loop, batcher


def _fake(name: str = "fake"):
    import types

    return types.SimpleNamespace(name=name, sync=lambda: None)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # rotary and absolute positions
@pytest.mark.parametrize("keep", [1, 3, 40])  # 40: more kept rows than a chunk holds
def test_a_chunked_prefill_gives_the_logits_and_cache_of_one_pass(tiny_family_factory, arch, keep):
    model = HFModel.load(tiny_family_factory(arch)["target"])
    prompt = random_prompts(1, 150, seed=31)[0]
    loop, batcher = _loop_with(model, prefill_chunk=32, LONE_CHUNK=32)  # chunks of a lone prompt's size
    try:
        with torch.inference_mode():
            whole, chunked = DynamicCache(), DynamicCache()
            ref_logits, ref_hidden = model.forward_now(prompt, whole, keep, with_hidden=True)
            logits, hidden = batcher.forward(prompt, chunked, keep, with_hidden=True)  # handed to the loop
            assert batcher.batch_sizes == {1: 5}  # 32 + 32 + 32 + 32 + 22 (or 40 rows kept: 32 x 3 + 14 + 40)
            assert logits.dtype == torch.float32 and logits.shape == ref_logits.shape == (keep, model.vocab_size)
            torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(hidden, ref_hidden, rtol=1e-4, atol=1e-4)
            assert chunked.get_seq_length() == whole.get_seq_length() == len(prompt)
            # The caches hold the same keys and values: the next step gives the same logits.
            torch.testing.assert_close(
                batcher.forward([7], chunked, 1), model.forward_now([7], whole, 1), rtol=1e-4, atol=1e-4
            )
    finally:
        loop.close()


def test_a_failed_chunked_prefill_leaves_the_cache_as_it_was(tiny_family, monkeypatch):
    from cascade_service.models import batching

    model = HFModel.load(tiny_family["target"])
    loop, batcher = _loop_with(model, prefill_chunk=16, LONE_CHUNK=16)
    real, calls = batching.forward_batch, []

    def fail_third(model, batch):
        calls.append(len(batch))
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return real(model, batch)

    monkeypatch.setattr(batching, "forward_batch", fail_third)
    cache = DynamicCache()
    try:
        with torch.inference_mode():
            model.forward_now([5, 6, 7], cache, 1)
            with pytest.raises(RuntimeError, match="out of memory"):
                batcher.forward(random_prompts(1, 60, seed=3)[0], cache, 1)
    finally:
        loop.close()
    assert len(calls) == 3 and cache.get_seq_length() == 3


def test_a_prefill_is_cut_small_while_another_request_decodes_and_its_passes_run_in_between(monkeypatch):
    from cascade_service.models import batching

    ran: list[list[int]] = []  # the new tokens of each pass's rows, in the order the passes ran
    loop, batcher = _loop_with(_fake(), prefill_chunk=10, LONE_CHUNK=40)

    def fake(model, batch):
        ran.append([len(p.fed) for p in batch])
        if len(ran) == 1:  # the prompt's first pass: another request arrives meanwhile
            other = loop.submit(batcher.forward, [1], DynamicCache(), 1)
            while not loop._arrived:
                time.sleep(0.001)
            fake.other = other  # type: ignore[attr-defined]
        return [None] * len(batch)

    monkeypatch.setattr(batching, "forward_batch", fake)
    try:
        loop.run(batcher.forward, [1] * 100, DynamicCache(), 1)
        fake.other.result()  # type: ignore[attr-defined]
    finally:
        loop.close()
    # Alone: 40 tokens. Then the other request is there: its step runs first (its like: none, and it
    # has had no model time), the prompt's chunks are cut to 10 while it was among the last two
    # passes, then back to 40.
    assert ran == [[40], [1], [10], [10], [40]], ran


def test_a_request_that_has_ended_does_not_cut_the_next_prefill_small(monkeypatch):
    # A session's next turn came right after its last one ended: the last one's cache was still among
    # the last two passes, so the new turn's prefill went in chunks of 16 (each paying for the whole
    # history's attention) as if another request were decoding. Only a live request counts.
    from cascade_service.models import batching

    ran: list[list[int]] = []
    monkeypatch.setattr(
        batching, "forward_batch", lambda model, batch: ran.append([len(p.fed) for p in batch]) or [None] * len(batch)
    )
    loop, batcher = _loop_with(_fake(), prefill_chunk=10, LONE_CHUNK=40)
    try:
        live = DynamicCache()
        loop.run(batcher.forward, [1], live, 1)  # a request that still decodes: its cache is held
        loop.run(batcher.forward, [1] * 60, DynamicCache(), 1)
        assert ran[1:] == [[10], [10], [40]], ran  # the control: cut small beside a live request
        loop.run(batcher.forward, [1], live, 1)
        del live  # that request ends
        gc.collect()
        ran.clear()
        loop.run(batcher.forward, [1] * 60, DynamicCache(), 1)
        assert ran == [[40], [20]], ran
    finally:
        loop.close()


def test_concurrent_requests_beside_a_chunked_long_prompt_match_the_oracle(tiny_family, monkeypatch):
    from cascade_service.engine.scheduler import ModelQueue

    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])),
        [ModelTierConfig("mid", str(tiny_family["mid"])), MaGConfig()],
        [[3, 1], [0, 3]],
        1.5,
    )
    monkeypatch.setattr(ModelQueue, "LONE_CHUNK", 40)  # chunks of 40 and of 16 as the traffic goes
    engine = InProcess(cascade, core=EngineCore(prefill_chunk=16))
    prompts = random_prompts(6, 8, seed=22)
    prompts[0] = random_prompts(1, 200, seed=23)[0]  # 5 to 13 chunks at the target and at the drafter
    before = dict(engine.target.batcher.batch_sizes)
    futures = [engine.loop.submit(engine.generate, p, GenerationConfig(max_new_tokens=24)) for p in prompts]
    for prompt, future in zip(prompts, futures):
        assert future.result().token_ids == oracle(tiny_family["target"], prompt, 24)
    shared = {k: n - before.get(k, 0) for k, n in engine.target.batcher.batch_sizes.items()}
    assert sum(n for size, n in shared.items() if size > 1) >= 3
    fed = [longest for _, _, _, longest in list(engine.target.batcher.timer._passes)[-sum(shared.values()) :]]
    # The prompt went in chunks: of 16 while others use the target, of 40 once it reads alone (drafters going
    # first, engine.scheduler.turns, its drafter's read may end after the others have finished), the last
    # one short by the rows it keeps.
    assert max(fed) <= 40 and sum(1 for n in fed if n >= 16) >= 5


def test_every_ready_request_shares_the_next_pass(monkeypatch):
    """Requests decoding in step are all parked on the model by the time the loop runs its pass:
    every pass holds all of them, with no timer to gather them."""
    from cascade_service.models import batching

    monkeypatch.setattr(batching, "forward_batch", lambda model, batch: [None] * len(batch))
    loop, batcher = _loop_with(_fake())
    rows, steps = 6, 8

    def request() -> None:
        cache = DynamicCache()
        for _ in range(steps):
            batcher.forward([1], cache, 1)

    try:
        for future in [loop.submit(request) for _ in range(rows)]:
            future.result()
    finally:
        loop.close()
    assert batcher.batch_sizes == {rows: steps}


def test_turns_go_to_the_request_that_had_the_least_model_time_the_oldest_on_a_tie():
    loop, batcher = _loop_with(_fake())
    try:
        dear, cheap, like = _cached(4000), _cached(10), _cached(12)
        batcher._used.update({dear.cache: 0.5, cheap.cache: 0.1, like.cache: 0.1})
        batcher.pending = [dear, cheap, like]
        assert batcher.take() == [cheap, like]  # the oldest of the least used first; like joins it
        assert batcher.pending == [dear] and batcher._clock == 0.1
        batcher._used[cheap.cache] = batcher._used[like.cache] = 0.6  # they had their turns
        batcher.pending = [cheap, like, dear]
        assert batcher.take() == [dear] and batcher._clock == 0.5
    finally:
        loop.close()


@pytest.mark.parametrize("fair", [True, False])
def test_a_request_with_dear_passes_has_the_model_as_long_as_each_of_the_others(monkeypatch, fair):
    """One stream over a long cache (40 ms passes, no short row can join them) beside 4 short streams
    (10 ms a pass for the 4). Taking turns by age, the long one has every other pass: the short ones
    run at half speed. By model time had, it runs once the short ones have each had its pass's time
    (16 of theirs), and never starves."""
    from cascade_service.models import batching

    long_cache = _cached(4000).cache
    shorts_on = threading.Event()
    ran: list[tuple[bool, bool]] = []  # per pass: the long stream's?, while the short ones ran?

    def fake(model, batch):
        dear = any(p.cache is long_cache for p in batch)
        ran.append((dear, shorts_on.is_set()))
        time.sleep(0.04 if dear else 0.01)
        return [None] * len(batch)

    monkeypatch.setattr(batching, "forward_batch", fake)
    loop, batcher = _loop_with(_fake(), FAIR=fair)
    stop = threading.Event()

    def long_stream() -> None:
        while not stop.is_set():
            batcher.forward([1], long_cache, 1)

    def short_stream() -> None:
        cache = DynamicCache()
        for _ in range(40):
            batcher.forward([1], cache, 1)

    streamer = loop.submit(long_stream)
    try:
        while len(ran) < 5:  # 200 ms of model time alone first: no debt to the short ones that come
            time.sleep(0.01)
        shorts_on.set()
        for future in [loop.submit(short_stream) for _ in range(4)]:
            future.result()
        shorts_on.clear()
    finally:
        stop.set()
        streamer.result()
        loop.close()
    during = [dear for dear, on in ran if on]
    long_passes, short_passes = sum(during), len(during) - sum(during)
    assert short_passes >= 40
    if fair:  # 40 passes of 2.5 ms a short stream: the long one's due is 100 ms, 2-3 passes of 40
        assert 1 <= long_passes <= 6, (long_passes, short_passes)
    else:
        assert long_passes >= 25, (long_passes, short_passes)
