"""models.chain: a greedy draft chained on the device gives the tokens and probabilities of drafting one
pass at a time, reads the host once per run (not per token), batches with other rows, leaves the cache
holding exactly the context and the draft's first k - 1 tokens, and falls back to ordinary passes where
the chain fits no bucket; a cascade drafting this way is still the oracle's output."""

from __future__ import annotations

import pytest
import torch

from cascade_service.core.sampling import SamplingParams
from cascade_service.core.types import Context
from cascade_service.models import chain
from cascade_service.models.batching import Pass, forward_batch
from cascade_service.models.hf import HFModel
from cascade_service.models.staticpass import static_forward, static_inputs
from cascade_service.zoo.tiny import random_prompts


def _stepwise(model: HFModel, history: list[int], k: int) -> tuple[list[int], list[float]]:
    """k greedy tokens one uncached forward at a time (the reference)."""
    tokens: list[int] = []
    probs: list[float] = []
    for _ in range(k):
        with torch.inference_mode():
            row = torch.softmax(model.module(input_ids=torch.tensor([history + tokens])).logits[0, -1].float(), -1)
        tokens.append(int(row.argmax()))
        probs.append(float(row.max()))
    return tokens, probs


@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_a_chained_draft_is_the_stepwise_greedy_draft(tiny_family, backend):
    model = HFModel.load(tiny_family["mid"], backend=backend, graphs="eager")
    scorer = model.scorer()
    assert scorer.chains
    history = random_prompts(1, 30, seed=12)[0]
    tokens, probs = scorer.draft_greedy(Context(history, len(history)), 5)
    expected_tokens, expected_probs = _stepwise(model, history, 5)
    assert tokens == expected_tokens
    assert probs == pytest.approx(expected_probs, rel=1e-4)
    assert scorer._cache.get_seq_length() == len(history) + 4  # the last token drafted is not fed
    # The next call (the draft's first two accepted, then the target's token) rolls back and continues.
    nxt = history + tokens[:2] + [7]
    with torch.inference_mode():
        expected = model.module(input_ids=torch.tensor([nxt])).logits[0, -1:].float()
    torch.testing.assert_close(scorer.logits(Context(nxt, len(history)), 1), expected, rtol=1e-4, atol=1e-4)


def test_rows_of_a_batch_chain_their_own_lengths_beside_a_plain_pass(tiny_family):
    model = HFModel.load(tiny_family["mid"], backend="lean", graphs="eager")
    histories = random_prompts(3, 24, seed=31)
    histories[2] = histories[2][:9]
    caches = [model.new_cache() for _ in histories]
    for cache, history in zip(caches, histories):
        forward_batch(model, [Pass(history[:-2], cache, 1, False)])
    batch = [
        Pass(histories[0][-2:], caches[0], 1, False, chain=4),
        Pass(histories[1][-2:], caches[1], 2, False),  # an ordinary pass in the same run
        Pass(histories[2][-2:], caches[2], 1, False, chain=2),
    ]
    got = forward_batch(model, batch)
    assert (got[0][0], got[2][0]) == (_stepwise(model, histories[0], 4)[0], _stepwise(model, histories[2], 2)[0])
    with torch.inference_mode():
        expected = model.module(input_ids=torch.tensor([histories[1]])).logits[0, -2:].float()
    torch.testing.assert_close(got[1], expected, rtol=1e-4, atol=1e-4)
    assert [c.length for c in caches] == [len(histories[0]) + 3, len(histories[1]), len(histories[2]) + 1]


def test_a_chain_past_the_buckets_runs_as_ordinary_passes(tiny_family):
    model = HFModel.load(tiny_family["mid"], backend="lean", graphs="eager")
    history = random_prompts(1, 40, seed=8)[0]  # 40 tokens fed at once: no token bucket
    runs = model.static.runs
    tokens, _ = forward_batch(model, [Pass(history, model.new_cache(), 1, False, chain=3)])[0]
    assert tokens == _stepwise(model, history, 3)[0]
    assert model.static.runs == runs + 2  # the two later steps fit: one token each


class _HostReads:
    """Counts reads of a tensor's values to the host (what a CUDA graph's capture refuses)."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__", "numpy", "cpu")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(original))

    def _counted(self, original):
        def read(tensor, *args, **kwargs):
            self.count += 1
            return original(tensor, *args, **kwargs)

        return read


@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_a_fixed_shape_pass_reads_nothing_back_and_a_chain_reads_once(tiny_family, backend, monkeypatch):
    model = HFModel.load(tiny_family["mid"], backend=backend, graphs="eager")
    caches = [model.new_cache() for _ in range(2)]
    for cache, history in zip(caches, random_prompts(2, 20, seed=2)):
        forward_batch(model, [Pass(history, cache, 1, False)])
    pool = model.kv_pool
    for cache in caches:
        pool.extend(cache, cache.length + 2, caches)
    inputs = static_inputs(caches, [[3, 4], [5, 6]], model.device)
    for cache in caches:
        pool.truncate(cache, cache.length)
    reads = _HostReads(monkeypatch)
    static_forward(model.module, pool, inputs, model.dtype)
    assert reads.count == 0  # the pass a graph captures: no value of the device goes to the host
    monkeypatch.undo()
    calls = []
    monkeypatch.setattr(chain, "_run", lambda *a: calls.append(1) or _run(*a))
    reads = _HostReads(monkeypatch)
    got = forward_batch(model, [Pass([7], caches[0], 1, False, chain=6), Pass([8], caches[1], 1, False, chain=6)])
    assert calls and reads.count == 1  # six steps each for two rows: one read at the end
    assert all(len(tokens) == 6 for tokens, _ in got)


_run = chain._run


def test_a_chain_copies_nothing_from_the_host_between_its_steps(tiny_family, monkeypatch):
    # On a GPU a tensor built from host values is a blocking copy; a chain builds every step's inputs
    # before its first step, so none may be made once a step has run (the CPU cannot see the copy
    # itself: count the host-made tensors after the first step's argmax).
    model = HFModel.load(tiny_family["mid"], backend="lean", graphs="eager")
    caches = [model.new_cache() for _ in range(2)]
    for cache, history in zip(caches, random_prompts(2, 20, seed=3)):
        forward_batch(model, [Pass(history, cache, 1, False)])
    stepped, late = [], []
    real_tensor, real_step = torch.tensor, chain.greedy_step
    monkeypatch.setattr(chain, "greedy_step", lambda rows: stepped.append(1) or real_step(rows))
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: (late.append(1) if stepped else None) or real_tensor(*a, **k))
    got = forward_batch(model, [Pass([7], caches[0], 1, False, chain=5), Pass([8], caches[1], 1, False, chain=3)])
    assert len(stepped) == 5 and [len(tokens) for tokens, _ in got] == [5, 3]
    assert late == []


def test_only_plain_greedy_drafts_chain():
    assert chain_ok(SamplingParams())
    assert not chain_ok(SamplingParams(temperature=1.0))
    assert not chain_ok(SamplingParams(logit_bias=((3, 1.0),)))
    assert not chain_ok(SamplingParams(repetition_penalty=1.2))


def chain_ok(sampling: SamplingParams) -> bool:
    from cascade_service.core.local import chainable

    return chainable(sampling)
