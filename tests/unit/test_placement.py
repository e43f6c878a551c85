"""Each tier on its own device (ARCHITECTURE invariant 6), checked on the CPU with simulated devices.

The whole cascade runs inside `VirtualDevices` (tests/unit/virtual_devices.py) with toy tiers on
different simulated GPUs and the CPU, in every sampling mode and final-verifier family: no op may meet
operands from two devices and no draw may use a generator from another device than its tensor. The
check is shown to catch the two faults it exists for (a CPU generator sampling GPU probabilities,
draft rows meeting the reviewer's from another device).
"""

from __future__ import annotations

import weakref
from collections import Counter

import pytest
import torch

from cascade_service.core import placement
from cascade_service.core import sampling as sampling_module
from cascade_service.core.cascade import Lookup, RequestState, build_cascade
from cascade_service.core.decode import decode
from cascade_service.core.local import local_tiers
from cascade_service.core.proposers.mag import BigramTable, MaxGram
from cascade_service.core.sampling import SamplingParams
from cascade_service.core.schedule import Schedule
from cascade_service.core.stats import CascadeStats
from cascade_service.core.types import Draft
from cascade_service.core.verify import EXACT, Verification

from ..helpers.toy import ToyScorer
from .virtual_devices import DeviceMismatch, VirtualDevices, device_of

VOCAB, LENGTH = 4, 8
PROMPT = [0, 1, 2, 0, 1]
NAMES = ["base", "small", "mag"]
K_MATRIX = [[2, 1, 1], [0, 2, 2], [0, 0, 3]]

PLACEMENTS = {
    "target_gpu0_base_gpu1_small_cpu": {"target": "cuda:0", "base": "cuda:1", "small": "cpu"},
    "target_cpu_drafters_on_two_gpus": {"target": "cpu", "base": "cuda:0", "small": "cuda:1"},
    "every_tier_on_one_gpu": {"target": "cuda:0", "base": "cuda:0", "small": "cuda:0"},
}
MODES = {
    "greedy": (SamplingParams(0.0), EXACT),
    "greedy_fuzzy_rows": (SamplingParams(0.0, rows=True), Verification("fuzzy-tv", 0.3)),
    "greedy_diff": (SamplingParams(0.0), Verification("diff", 0.2)),
    "sampling": (SamplingParams(1.0), EXACT),
    "sampling_top_p": (SamplingParams(0.7, top_p=0.9), EXACT),
    "sampling_lossy": (SamplingParams(1.0), Verification("lossy", 0.3, None)),
    "sampling_token_v2": (SamplingParams(1.0), Verification("token-v2", 0.2)),
    "sampling_fuzzy_js": (SamplingParams(1.0), Verification("fuzzy-js", 0.05)),
}


def _decode(
    devices: dict[str, str],
    sampling: SamplingParams,
    verification: Verification,
    seed: int,
    lookup: Lookup | None = None,
) -> list[int]:
    target = ToyScorer("target", VOCAB, seed=1, device=devices["target"])
    base = ToyScorer("base", VOCAB, seed=2, base=target, noise=1.5, device=devices["base"])
    small = ToyScorer("small", VOCAB, seed=3, base=target, noise=3.0, device=devices["small"])
    bigram = BigramTable.from_tokens([0, 1, 2, 3, 0, 2, 1, 3, 3, 1], VOCAB)
    state = RequestState(
        sampling, torch.Generator().manual_seed(seed), CascadeStats("target"), VOCAB, verification=verification
    )
    system = build_cascade(
        *local_tiers(VOCAB, target, [base, small, MaxGram(bigram)]), Schedule.parse(K_MATRIX, NAMES), 2.0, state, lookup
    )
    return [t for chunk in decode(system, PROMPT, LENGTH, state) for t in chunk]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("placement_name", sorted(PLACEMENTS))
def test_no_sampling_or_review_path_meets_a_tensor_or_generator_from_another_device(placement_name, mode):
    sampling, verification = MODES[mode]
    with VirtualDevices():
        for seed in range(4):
            out = _decode(PLACEMENTS[placement_name], sampling, verification, seed, Lookup(1, 3) if seed % 2 else None)
            assert len(out) == LENGTH and all(0 <= t < VOCAB for t in out)


@pytest.mark.parametrize("mode", ["greedy", "greedy_fuzzy_rows", "greedy_diff"])
def test_where_tiers_run_never_changes_greedy_output(mode):
    sampling, verification = MODES[mode]
    on_cpu = _decode({"target": "cpu", "base": "cpu", "small": "cpu"}, sampling, verification, 0)
    with VirtualDevices():
        for devices in PLACEMENTS.values():
            assert _decode(devices, sampling, verification, 0) == on_cpu


def test_the_check_refuses_what_cuda_refuses():
    with VirtualDevices():
        on_gpu = torch.full((2, VOCAB), 0.25, device="cuda:0")
        on_cpu = torch.full((2, VOCAB), 0.25)
        for fault in (
            lambda: torch.multinomial(on_gpu[0], 1, generator=torch.Generator()),
            lambda: torch.rand(2, generator=torch.Generator(device="cuda:0")),
            lambda: torch.cat([on_cpu, on_gpu]),
            lambda: on_gpu - on_cpu,
            lambda: on_gpu.to("cuda:1") * on_gpu,
            lambda: on_gpu.numpy(),
        ):
            with pytest.raises(DeviceMismatch):
                fault()
        assert device_of(on_gpu.cpu() - on_cpu) == "cpu" and str(on_gpu.device) == "cuda:0"


def test_the_check_catches_a_request_generator_used_on_another_device(monkeypatch):
    # The fault before placement: every draw used the request's CPU generator, wherever the logits were.
    def same(source, device):
        return source

    monkeypatch.setattr(placement, "generator_for", same)
    monkeypatch.setattr(sampling_module, "generator_for", same)
    with VirtualDevices(), pytest.raises(DeviceMismatch, match="generator"):
        _decode(PLACEMENTS["target_gpu0_base_gpu1_small_cpu"], SamplingParams(1.0), EXACT, 0)


def test_the_check_catches_draft_rows_reviewed_where_they_were_drafted(monkeypatch):
    # The fault before placement: the drafts' rows met the reviewer's probabilities on another device.
    monkeypatch.setattr(Draft, "for_reviewer", lambda self, target_probs: self)
    with VirtualDevices(), pytest.raises(DeviceMismatch, match="operands"):
        _decode(PLACEMENTS["target_gpu0_base_gpu1_small_cpu"], SamplingParams(1.0), EXACT, 0)


def test_draft_rows_reach_the_reviewer_on_its_device_in_float32():
    with VirtualDevices():
        rows = torch.full((3, VOCAB), 0.25, dtype=torch.bfloat16, device="cuda:1")
        target_probs = torch.full((4, VOCAB), 0.25, device="cuda:0")
        moved = placement.to_reviewer(rows, target_probs)
        assert device_of(moved) == "cuda:0" and moved.dtype == torch.float32
        host = placement.to_host(rows)
        assert device_of(host) == "cpu" and host.dtype == torch.float32


def test_an_empty_part_of_a_block_never_moves_the_other():
    # A block starts empty on the CPU: the first drafter's rows must stay where they were drafted.
    with VirtualDevices():
        start, rows = torch.zeros(0, VOCAB), torch.full((2, VOCAB), 0.25, device="cuda:1")
        assert placement.join_rows(start, rows) is rows and placement.join_rows(rows, start) is rows
        joined = placement.join_rows(rows, torch.full((1, VOCAB), 0.25))
        assert device_of(joined) == "cuda:1" and joined.shape == (3, VOCAB)


def test_cpu_draws_use_the_requests_generator_itself():
    # Seeded CPU outputs do not depend on the placement rule: the request's generator draws directly.
    generator = torch.Generator().manual_seed(3)
    assert placement.generator_for(generator, torch.device("cpu")) is generator
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draws = [sampling_module.sample(probs, torch.Generator().manual_seed(3)) for _ in range(2)]
    expected = int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(3)))
    assert draws == [expected, expected]


def test_draws_on_another_device_are_seeded_from_the_requests_generator():
    probs = None
    with VirtualDevices():
        probs = torch.tensor([0.1, 0.2, 0.3, 0.4], device="cuda:0")

        def draws(seed: int) -> list[int]:
            source = placement.request_generator(seed)
            return [sampling_module.sample(probs, source) for _ in range(40)]

        assert draws(5) == draws(5)  # reproducible from the request's seed
        assert draws(5) != draws(6)
        counts = Counter(draws(7) + draws(8) + draws(9))
        assert len(counts) == VOCAB  # not one fixed token: the device generator's stream goes on
        # One generator per request and device, made at its first draw there and kept, not one per draw.
        source, other = placement.request_generator(1), placement.request_generator(1)
        on_cuda = placement.generator_for(source, torch.device("cuda:0"))
        assert placement.generator_for(source, torch.device("cuda:0")) is on_cuda
        assert placement.generator_for(source, torch.device("cuda:1")) is not on_cuda
        assert placement.generator_for(other, torch.device("cuda:0")) is not on_cuda


def test_draws_on_another_device_need_no_weak_reference_to_a_generator(monkeypatch):
    # torch before 2.13 (the GPU images' 2.11) refuses weak references to a Generator; the first GPU
    # check failed every sampled cuda draw on a weak-keyed table of them. Refuse them here the same way.
    real_ref = weakref.ref

    def ref(obj, *args):
        if isinstance(obj, torch.Generator):
            raise TypeError(f"cannot create weak reference to {type(obj).__name__!r} object")
        return real_ref(obj, *args)

    monkeypatch.setattr(weakref, "ref", ref)
    with VirtualDevices():
        probs = torch.tensor([0.1, 0.2, 0.3, 0.4], device="cuda:0")
        seeded = [sampling_module.sample(probs, placement.request_generator(4)) for _ in range(2)]
        assert seeded[0] == seeded[1]
        plain = torch.Generator().manual_seed(4)  # not a request's: a device generator per call, still seeded
        assert placement.generator_for(plain, torch.device("cuda:0")) is not placement.generator_for(
            plain, torch.device("cuda:0")
        )


def test_host_at_reads_the_same_floats_as_a_gather_on_either_path():
    # A review's token_probs (core.review): element reads of numpy's view on the CPU in float32, a gather
    # elsewhere (float64 here stands for a tensor numpy's path does not take).
    rows = torch.softmax(torch.randn(5, 2048, generator=torch.Generator().manual_seed(3)), dim=-1)
    tokens = [7, 2047, 0, 7]
    gathered = rows[torch.arange(4), tokens].tolist()
    assert placement.host_at(rows, tokens) == gathered
    assert placement.host_at(rows[1:], tokens[:2]) == rows[1:][torch.arange(2), tokens[:2]].tolist()  # a view
    wide = rows.double()
    assert placement.host_at(wide, tokens) == wide[torch.arange(4), tokens].tolist()
    assert placement.host_at(rows, []) == []
