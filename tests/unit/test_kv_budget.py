"""A model's default KV budget (models.kvsize.default_budget): a share of the device's memory, and on a GPU
within half of what is free once the weights are in (issue 59 point 1: the pool is made at up to this
size before the first graph capture, so it must fit beside what else the GPU holds). The CUDA queries
are replaced by fakes: the arithmetic is what is tested here; tests/gpu load models on a real one."""

from __future__ import annotations

import torch

from cascade_service.models import kvsize

GIB = 2**30


def _fake_gpu(monkeypatch, total: int, free: int) -> None:
    class Properties:
        total_memory = total

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))


def test_on_an_empty_gpu_the_budget_is_a_tenth_of_its_memory(monkeypatch):
    _fake_gpu(monkeypatch, total=80 * GIB, free=79 * GIB)
    assert kvsize.default_budget(torch.device("cuda", 0)) == int(80 * GIB * kvsize.DEFAULT_FRACTION)


def test_on_a_gpu_others_fill_the_budget_is_half_of_what_is_free(monkeypatch):
    _fake_gpu(monkeypatch, total=80 * GIB, free=6 * GIB)
    assert kvsize.default_budget(torch.device("cuda", 0)) == 3 * GIB  # not the 8 GiB a tenth would take


def test_on_the_cpu_the_budget_is_a_tenth_of_its_ram():
    assert kvsize.default_budget(torch.device("cpu")) == int(kvsize.device_memory(torch.device("cpu")) * 0.1)
