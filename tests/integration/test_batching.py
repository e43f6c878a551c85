"""Continuous batching across concurrent requests: never a different token.

`models.batching` runs concurrent requests' forward passes as one padded pass over their own KV caches.
Checked against independent references: each request's logits equal its unbatched forward pass, and
greedy output of concurrent requests of different lengths equals plain `transformers` greedy
`generate()` for each, whatever the interleaving. The batch-size histogram shows passes were shared.
"""

from __future__ import annotations

import threading

import pytest
import torch

from cascade_service.config import GenerationConfig, MaGConfig, ModelTierConfig, make_cascade
from cascade_service.inprocess import InProcess
from cascade_service.models.batching import Pass, forward_batch
from cascade_service.models.hf import HFModel
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import oracle
from ..helpers.threads import concurrently


@pytest.mark.parametrize("kv", ["pool", "dynamic"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_a_batched_pass_gives_each_request_its_own_logits(tiny_family_factory, arch, kv):
    model = HFModel.load(tiny_family_factory(arch)["target"], kv=kv)
    prompts = random_prompts(4, 12, seed=11)
    # Ragged: an empty cache (a prefill), short and long caches, 1 to 5 new tokens, different keeps.
    cached = [0, 3, 12, 7]
    fed = [prompts[0][:9], prompts[1][3:4], prompts[2][:5], prompts[3][7:12]]
    keeps = [1, 1, 5, 3]
    alone, together = [], []
    with torch.inference_mode():
        for p, n, tokens, keep in zip(prompts, cached, fed, keeps):
            cache = model.new_cache()
            if n:
                model.forward_now(p[:n], cache, 1)
            alone.append(model.forward_now(tokens, cache, keep))
        caches = []
        for p, n in zip(prompts, cached):
            cache = model.new_cache()
            if n:
                model.forward_now(p[:n], cache, 1)
            caches.append(cache)
        together = forward_batch(model, [Pass(t, c, k, False) for t, c, k in zip(fed, caches, keeps)])
        for a, b in zip(alone, together):
            assert a.shape == b.shape
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        # The caches grew by exactly the fed tokens, and continue correctly: one more batched step
        # equals one more step of a cache built without batching.
        assert [c.get_seq_length() for c in caches] == [n + len(t) for n, t in zip(cached, fed)]
        nxt = forward_batch(model, [Pass([5], c, 1, False) for c in caches])
        for p, n, tokens, step in zip(prompts, cached, fed, nxt):
            ref = model.full_logits(p[:n] + tokens + [5])[-1:]
            torch.testing.assert_close(step, ref, rtol=1e-4, atol=1e-4)
        # Rows out of slot order (a pool gathers them), one rolled back by two positions (a rejected
        # draft): each still continues its own sequence.
        caches[2].crop(-2)
        order = [3, 0, 2]
        last = forward_batch(model, [Pass([7, 8], caches[i], 2, False) for i in order])
        for i, got in zip(order, last):
            seq = prompts[i][: cached[i]] + fed[i] + [5]
            seq = (seq[:-2] if i == 2 else seq) + [7, 8]
            torch.testing.assert_close(got, model.full_logits(seq)[-2:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv", ["pool", "dynamic"])
def test_concurrent_requests_of_different_lengths_match_the_oracle(tiny_family, kv):
    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"]), kv=kv),
        [ModelTierConfig("mid", str(tiny_family["mid"])), MaGConfig()],
        [[3, 1], [0, 3]],
        1.5,
    )
    engine = InProcess(cascade)
    prompts = random_prompts(10, 10, seed=21)
    prompts = [p[: 4 + i] for i, p in enumerate(prompts)]  # ragged prompts too
    budgets = [6 + 9 * i for i in range(10)]
    outputs: list[list[int] | None] = [None] * 10
    start = threading.Barrier(10)

    def run(i: int) -> None:
        start.wait()
        outputs[i] = engine.generate(prompts[i], GenerationConfig(max_new_tokens=budgets[i])).token_ids

    concurrently(10, run)
    for prompt, budget, out in zip(prompts, budgets, outputs):
        assert out == oracle(tiny_family["target"], prompt, budget)
    shared = {size: n for size, n in engine.target.batcher.batch_sizes.items() if size > 1}
    assert sum(shared.values()) >= 5, engine.target.batcher.batch_sizes  # the passes were really batched


def test_the_standalone_server_adapts_to_load_unless_told_to_fix_the_schedule(tiny_family):
    import dataclasses

    from cascade_service.config import Config
    from cascade_service.config.serving import ServingConfig
    from cascade_service.engine.policies.load import DraftBudget
    from cascade_service.standalone import start_standalone

    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])),
        [ModelTierConfig("mid", str(tiny_family["mid"])), MaGConfig()],
        [[3, 1], [0, 3]],
        1.5,
    )
    fixed = Config(cascade, serving=dataclasses.replace(ServingConfig(), adapt_to_load=False))
    cases = [(Config(cascade), None, True), (Config(cascade), False, False), (fixed, None, False), (fixed, True, True)]
    prompt = random_prompts(1, 8, seed=2)[0]
    for config, flag, adapts in cases:
        served = start_standalone(config, adapt_to_load=flag)
        try:
            policy = served.coordinator.policies(True, "")  # the floor over load adaptation, or over the K-matrix
            assert isinstance(policy.inner, DraftBudget) == adapts, (flag, config.serving.adapt_to_load)
            # Either way a greedy request is the target's own continuation.
            out = served.coordinator.generate(served.coordinator.params(prompt_ids=prompt, max_new_tokens=12))
            assert out.token_ids == oracle(tiny_family["target"], prompt, 12)
        finally:
            served.stop()


def test_the_standalone_server_batches_concurrent_grpc_requests_exactly(tiny_family):
    from cascade_service.client import CascadeClient
    from cascade_service.config import Config
    from cascade_service.standalone import start_standalone

    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])),
        [
            ModelTierConfig("close", str(tiny_family["close"])),
            ModelTierConfig("mid", str(tiny_family["mid"])),
            MaGConfig(),
        ],
        [[4, 2, 0], [0, 2, 6], [0, 0, 6]],
        1.5,
    )
    served = start_standalone(Config(cascade))
    prompts = [p[: 3 + 2 * i] for i, p in enumerate(random_prompts(8, 20, seed=8))]
    budgets = [40 - 4 * i for i in range(8)]
    outputs: list[list[int] | None] = [None] * 8
    start = threading.Barrier(8)

    def run(i: int) -> None:
        with CascadeClient(f"127.0.0.1:{served.port}", timeout_s=120) as client:
            start.wait()
            outputs[i] = client.generate(prompt_token_ids=prompts[i], max_new_tokens=budgets[i]).token_ids

    try:
        concurrently(8, run)
        for prompt, budget, out in zip(prompts, budgets, outputs):
            assert out == oracle(tiny_family["target"], prompt, budget)
        assert any(size > 1 for model in served.engine.models() for size in model.batcher.batch_sizes)
    finally:
        served.stop()


class _CyclingBudget:
    """A draft budget that goes through every cap from plain decoding (0) to beyond the schedule."""

    def __init__(self):
        self.calls = 0
        self.begun = 0
        self.observed: list[tuple[int, int]] = []
        self.sources: set[str] = set()

    def begin(self, committed: int = 0, remaining: int = 0) -> None:
        self.begun += 1

    def allows(self, source: str) -> bool:
        return True

    def cap(self, source: str, offered: int, ceiling: int) -> int:
        self.calls += 1
        self.sources.add(source)
        return min(offered, ceiling, [0, 1, 3, 0, 2, 9][self.calls % 6])

    def drafted(self) -> None:
        pass

    def observe(self, drafted: int, accepted: int) -> None:
        self.observed.append((drafted, accepted))


@pytest.mark.parametrize("lookup", [False, True])
def test_any_draft_budget_keeps_the_output_exact(tiny_family, lookup):
    from cascade_service.core.cascade import Lookup
    from cascade_service.sessions import MemoryStore

    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])),
        [ModelTierConfig("mid", str(tiny_family["mid"])), MaGConfig()],
        [[3, 1], [0, 3]],
        1.5,
        Lookup(2, 6) if lookup else None,
    )
    coordinator = InProcess(cascade).coordinator(MemoryStore())
    budgets: list[_CyclingBudget] = []
    coordinator.policies = lambda greedy, scope="": budgets.append(_CyclingBudget()) or budgets[-1]
    for prompt in random_prompts(3, 12, seed=44):
        prompt = prompt[:6] * 2  # repeats, so the MaG lookup finds matches
        out = coordinator.generate(coordinator.params(prompt_ids=prompt, max_new_tokens=30)).token_ids
        assert out == oracle(tiny_family["target"], prompt, 30)
    assert all(b.calls > 6 for b in budgets)
    assert all(b.begun == len(b.observed) for b in budgets)  # every round begun is reviewed
    assert all(drafted <= 9 for b in budgets for drafted, _ in b.observed)  # a round drafts within its cap
    assert set().union(*(b.sources for b in budgets)) == ({"lookup", "model"} if lookup else {"model"})


def test_load_adaptation_under_concurrency_keeps_the_output_exact(tiny_family):
    from cascade_service.sessions import MemoryStore

    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])),
        [ModelTierConfig("mid", str(tiny_family["mid"])), MaGConfig()],
        [[3, 1], [0, 3]],
        1.5,
    )
    engine = InProcess(cascade)
    coordinator = engine.coordinator(MemoryStore(), adapt_to_load=True)
    made = []
    make = coordinator.policies
    coordinator.policies = lambda greedy, scope="": made.append(make(greedy, scope)) or made[-1]
    prompts = random_prompts(8, 10, seed=45)
    outputs: list[list[int] | None] = [None] * 8

    def run(i: int) -> None:
        outputs[i] = coordinator.generate(coordinator.params(prompt_ids=prompts[i], max_new_tokens=60)).token_ids

    concurrently(8, run)
    for prompt, out in zip(prompts, outputs):
        assert out == oracle(tiny_family["target"], prompt, 60)
    assert engine.target.batcher.timer.cost() is not None  # the cost was fitted and consulted
    # under the floor (the default), the load budget caps what the floor lets draft
    assert len(made) == 8 and all(floor.inner.chosen for floor in made)
    narrowed = engine.coordinator(MemoryStore(), adapt_to_load=True, arms=("plain", "lookup"))  # serving.load_arms
    assert narrowed.policies(True, "").inner.model.trial.arms == ("plain", "lookup")


def test_an_engine_serving_like_a_config_runs_the_servers_policies(tiny_family):
    # The demo's in-process side compares paths, so it must run what the server runs: load adaptation
    # under the floor (a server's default), not the engine's own default (the floor over the K-matrix).
    from cascade_service.config.serving import ServingConfig
    from cascade_service.engine.policies.load import DraftBudget

    from ..helpers.tier_servers import tiny_cascade

    engine = InProcess(tiny_cascade(tiny_family))
    prompt = random_prompts(1, 8, seed=4)[0]
    try:
        assert not isinstance(engine._local.policies(True, "").inner, DraftBudget)  # the engine's default
        engine.serve_like(ServingConfig())
        assert isinstance(engine._local.policies(True, "").inner, DraftBudget)
        out = engine.generate(prompt, GenerationConfig(max_new_tokens=12)).token_ids
        assert out == oracle(tiny_family["target"], prompt, 12)
    finally:
        engine.core.close()
