"""The cascade with tiers on CUDA, and split between CUDA and the CPU (`pytest -m gpu`; skipped without CUDA).

- Greedy identity against `generate()` on the target's device and dtype (tests/gpu/oracle.py), with
  every tier on cuda, the target on cuda and the drafters on the CPU, the reverse, and a bfloat16
  target on cuda with float32 drafters on the CPU.
- Exact sampling: toy tiers on cuda and split, the output distribution tested against enumeration
  (chi-square, as tests/unit/test_exact_distribution.py does on the CPU).
- Sampled requests with model tiers on cuda run (the request's CPU generator cannot sample CUDA
  logits: core.placement) under every final-verifier family and are reproducible per seed.
- The CLI and the batched forward pass on cuda.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch

from cascade_service.config import (
    GenerationConfig,
    MaGConfig,
    ModelTierConfig,
    make_cascade,
)
from cascade_service.core.cascade import RequestState, build_cascade
from cascade_service.core.decode import decode
from cascade_service.core.local import local_tiers
from cascade_service.core.proposers.mag import BigramTable, MaxGram
from cascade_service.core.sampling import SamplingParams
from cascade_service.core.schedule import Schedule
from cascade_service.core.stats import CascadeStats
from cascade_service.core.verify import Verification
from cascade_service.inprocess import InProcess
from cascade_service.zoo.tiny import random_prompts

from ..helpers.toy import ToyScorer, chi_square_rejects, exact_distribution
from .oracle import GPU, assert_greedy, load

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="needs CUDA")]

PROMPTS = [random_prompts(1, 3, seed=11)[0], random_prompts(1, 24, seed=12)[0] * 2, random_prompts(1, 20, seed=13)[0]]
NAMES, K = ["close", "mid", "mag"], [[4, 2, 0], [0, 2, 6], [0, 0, 6]]
# (target device, target dtype, drafters' device, drafters' dtype)
PLACEMENTS = {
    "all_on_cuda": ("cuda", "float32", "cuda", "float32"),
    "target_cuda_drafters_cpu": ("cuda", "float32", "cpu", "float32"),
    "target_cpu_drafters_cuda": ("cpu", "float32", "cuda", "float32"),
    "bf16_target_cuda_f32_drafters_cpu": ("cuda", "bfloat16", "cpu", "float32"),
    "f32_target_cuda_bf16_drafters_cuda": ("cuda", "float32", "cuda", "bfloat16"),
}


def _engine(family, placement: str, leniency: float = 1.5) -> InProcess:
    t_dev, t_dtype, d_dev, d_dtype = PLACEMENTS[placement]
    drafters = [MaGConfig() if n == "mag" else ModelTierConfig(n, str(family[n]), d_dtype, d_dev) for n in NAMES]
    return InProcess(
        make_cascade(ModelTierConfig("target", str(family["target"]), t_dtype, t_dev), drafters, K, leniency)
    )


@pytest.mark.parametrize("leniency", [1.0, 3.0])
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_greedy_cascade_on_cuda_equals_generate_on_the_targets_device(tiny_family, placement, leniency):
    engine = _engine(tiny_family, placement, leniency)
    assert engine.target.device.type == PLACEMENTS[placement][0]
    oracle = load(tiny_family["target"], PLACEMENTS[placement][0], PLACEMENTS[placement][1])
    for prompt in PROMPTS:
        assert_greedy(oracle, prompt, engine.generate(prompt, GenerationConfig(max_new_tokens=40)).token_ids, 40)


VOCAB, LENGTH, SAMPLES = 4, 3, 4000
TOY_PROMPT = [0, 1, 2, 0, 1]
TOY_PLACEMENTS = {
    "all_on_cuda": ("cuda", "cuda"),
    "target_cuda_drafters_cpu": ("cuda", "cpu"),
    "target_cpu_drafters_cuda": ("cpu", "cuda"),
}


@pytest.mark.parametrize("sampling", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9)], ids=["t1", "t0.7_p0.9"])
@pytest.mark.parametrize("placement", sorted(TOY_PLACEMENTS))
def test_output_distribution_on_cuda_equals_the_target_distribution(placement, sampling):
    target_device, drafter_device = TOY_PLACEMENTS[placement]
    target = ToyScorer("target", VOCAB, seed=1, device=target_device)
    base = ToyScorer("base", VOCAB, seed=2, base=target, noise=1.5, device=drafter_device)
    small = ToyScorer("small", VOCAB, seed=3, base=target, noise=3.0, device=drafter_device)
    bigram = BigramTable.from_tokens([0, 1, 2, 3, 0, 2, 1, 3, 3, 1], VOCAB)
    schedule = Schedule.parse([[2, 1, 1], [0, 2, 2], [0, 0, 3]], ["base", "small", "mag"])
    counts: Counter = Counter()
    for i in range(SAMPLES):
        state = RequestState(sampling, torch.Generator().manual_seed(i), CascadeStats("target"), VOCAB)
        system = build_cascade(*local_tiers(VOCAB, target, [base, small, MaxGram(bigram)]), schedule, 2.0, state)
        counts[tuple(t for chunk in decode(system, TOY_PROMPT, LENGTH, state) for t in chunk)] += 1
    rejects, stat, crit = chi_square_rejects(counts, exact_distribution(target, TOY_PROMPT, LENGTH, sampling), SAMPLES)
    assert not rejects, f"chi-square {stat:.1f} > critical {crit:.1f}: output is not the target's distribution"


@pytest.mark.parametrize(
    "verification",
    [
        Verification(),
        Verification("lossy", 0.3, None),
        Verification("diff", 0.2),
        Verification("token-v3", 0.2),
        Verification("fuzzy-js", 0.05),
    ],
    ids=lambda v: v.rule,
)
@pytest.mark.parametrize("placement", ["all_on_cuda", "target_cuda_drafters_cpu", "target_cpu_drafters_cuda"])
def test_sampled_requests_on_cuda_run_and_are_reproducible_per_seed(tiny_family, placement, verification):
    engine = _engine(tiny_family, placement)

    # An exact request draws by position: its seed fixes the output whatever the floor drafts. A lossy
    # one's output depends on what was drafted, so its seed fixes it for one draft path: the K-matrix.
    speculation = "auto" if verification.rule == "exact" else "fixed"

    def run(seed: int) -> list[int]:
        gen = GenerationConfig(
            max_new_tokens=24,
            temperature=0.8,
            top_p=0.95,
            seed=seed,
            verification=verification,
            speculation=speculation,
        )
        return engine.generate(PROMPTS[1], gen).token_ids

    first = run(7)
    assert len(first) == 24 and first == run(7)


def test_greedy_fuzzy_rows_cross_from_cpu_drafters_to_a_cuda_target(tiny_family):
    # Greedy drafts carry their rows for a fuzzy rule: CPU rows meet the target's CUDA rows.
    engine = _engine(tiny_family, "target_cuda_drafters_cpu")
    gen = GenerationConfig(max_new_tokens=24, verification=Verification("fuzzy-tv", 0.0))  # T = 0: exact
    oracle = load(tiny_family["target"], "cuda", "float32")
    assert_greedy(oracle, PROMPTS[1], engine.generate(PROMPTS[1], gen).token_ids, 24)


def test_concurrent_requests_share_batched_passes_on_cuda(tiny_family):
    engine = _engine(tiny_family, "all_on_cuda")
    prompts = [p[: 3 + 2 * i] for i, p in enumerate(random_prompts(6, 20, seed=8))]
    outputs: list[list[int] | None] = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        start.wait()
        outputs[i] = engine.generate(prompts[i], GenerationConfig(max_new_tokens=24)).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        for model in engine.models():
            model.batcher.close()
    oracle = load(tiny_family["target"], "cuda", "float32")
    for prompt, out in zip(prompts, outputs):
        assert out is not None
        assert_greedy(oracle, prompt, out, 24)
    assert any(size > 1 for model in engine.models() for size in model.batcher.batch_sizes)


def test_the_cli_generates_with_tiers_on_cuda(tiny_family, capsys):
    import json

    from cascade_service.cli import main

    code = main(
        [
            "generate",
            "--target",
            str(tiny_family["target"]),
            "--drafter",
            str(tiny_family["close"]),
            "mag",
            "--device",
            "cuda",
            "--prompt",
            "def f(x):",
            "--max-new-tokens",
            "12",
            "--temperature",
            "0.7",
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert len(json.loads(out)["token_ids"]) == 12
