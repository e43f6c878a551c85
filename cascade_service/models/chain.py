"""Greedy drafting without a host read per token: a drafter's k passes chained on the device.

Drafting k tokens greedily is k passes, each fed the argmax of the one before. Read back to build the
next pass, every token is a device-to-host copy that waits for the pass to finish, so on a GPU the
host idles while the device works and the device idles while the host builds the next pass. Nothing
but the token's value depends on the previous pass: each step's positions, pool slots and reads are
known before the first runs. So a chained pass (a batcher `Pass` with `chain` = k > 1) takes every
block the chain needs up front, builds each step's fixed-shape inputs (models.staticpass), runs the
steps back to back with each step's ids taken on the device from the argmax of the step before, and
reads the k tokens and their probabilities back in one copy at the end.

Only plain greedy drafting chains (core.local decides: no logit bias, penalties, grammar or adaptive
stopping, whose next step needs the host), and only a model with a fixed-shape runner
(`graphs: auto` on cuda; `eager` anywhere). A chain past the buckets, or after the runner was dropped,
runs its steps as ordinary passes with a host read each (`chain_eagerly`): the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from .kvpool import PagedCache
from .poolhold import holding, replayed
from .staticpass import CaptureFailed, drop_runner, fits, static_inputs

Forward = Callable[[Any, list[Any]], list[Any]]  # models.batching.forward_batch


def greedy_step(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] logits -> (argmax [B], its probability [B]) on their device: what a greedy draft step
    decides (softmax in float32, the first of equal maxima, as core.placement.host_reads reads it)."""
    probs = torch.softmax(logits.float(), dim=-1)
    best = probs.argmax(dim=-1)
    return best, probs.gather(-1, best[:, None])[:, 0]


def chained(model: Any, batch: Sequence[Any]) -> list[Any] | None:
    """The batch's passes as one chained fixed-shape run (see the module doc): per row, its [keep, V]
    float32 logits where `chain` is 1, else (tokens, probabilities) of its `chain` greedy steps. None
    (nothing done) where the model has no runner or the batch fits no bucket; a runner that fails is
    dropped (models.staticpass.drop_runner) and None returned, the caches as they were."""
    try:
        return _chained(model, batch)
    except CaptureFailed as exc:
        drop_runner(model, exc)
        return None


def _chained(model: Any, batch: Sequence[Any]) -> list[Any] | None:
    if not fits(model, batch):
        return None
    device = model.device
    caches = [item.cache for item in batch]
    steps = max(item.chain for item in batch)
    with holding(model, caches, [len(item.fed) + item.chain - 1 for item in batch]) as starts:
        plans = _plans(batch, caches, starts, steps, device)
        firsts, drafted = replayed(_run, model.static, batch, plans, device)
    read = drafted.tolist() if drafted is not None else []  # the run's one device-to-host copy
    results: list[Any] = []
    for i, (item, first) in enumerate(zip(batch, firsts)):
        if item.chain == 1:
            results.append(first)
        else:
            results.append(([int(t) for t in read[i][: item.chain]], read[len(batch) + i][: item.chain]))
    return results


def _plans(batch: Sequence[Any], caches: Sequence[PagedCache], starts: list[int], steps: int, device: torch.device):
    """Each step's fixed-shape inputs, built before any step runs: step 0 feeds every row its tokens,
    step j > 0 one token to each row whose chain is longer than j (its value filled on the device)."""
    plans = []
    for j in range(steps):
        news = [item.fed if j == 0 else ([0] if item.chain > j else []) for item in batch]
        for cache, start, item in zip(caches, starts, batch):  # the length each row's step j starts at
            cache.length = start + (0 if j == 0 else len(item.fed) + min(j, item.chain) - 1)
        inputs = static_inputs(caches, news, device)
        assert inputs is not None  # rows and the first step's tokens were checked; later steps feed one
        plans.append(inputs)
    return plans


def _run(runner: Any, batch: Sequence[Any], plans: list[Any], device: torch.device):
    rows = len(batch)
    firsts: list[Any] = []
    tokens, probs = [], []
    feed = None
    # Every host value a step needs goes to the device here, before the first step: a copy inside the
    # loop would be a blocking transfer per step (the chain's point is one read per run).
    last = torch.tensor([len(item.fed) - 1 for item in batch], device=device)
    width = plans[0].ids.shape[0]
    uses = torch.tensor(
        [[item.chain > j + 1 for item in batch] + [False] * (width - rows) for j in range(len(plans) - 1)],
        device=device,
    ).reshape(len(plans) - 1, width)  # step j + 1 feeds row i when its chain is longer than j + 1
    for j, inputs in enumerate(plans):
        logits = runner.run(inputs, feed)  # [B, S, V]
        if j == 0:
            firsts = [
                logits[i, len(item.fed) - item.keep : len(item.fed)].float() if item.chain == 1 else None
                for i, item in enumerate(batch)
            ]
            rows_last = logits[torch.arange(rows, device=device), last]  # [rows, V]
        else:
            rows_last = logits[:rows, 0]
        best, p_best = greedy_step(rows_last)
        tokens.append(best)
        probs.append(p_best)
        if j + 1 < len(plans):
            feed = (_padded(best, inputs.ids.shape[0]), uses[j])
    if len(plans) == 1 and all(item.chain == 1 for item in batch):
        return firsts, None
    # tokens as float32 beside their probabilities: ids below 2**24 are exact, and one copy reads both
    return firsts, torch.cat([torch.stack(tokens, 1).float(), torch.stack(probs, 1)])


def _padded(values: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows] from the batch's [len(batch)]: the bucket's padding rows take zeros (False)."""
    if values.shape[0] == rows:
        return values
    return torch.cat([values, values.new_zeros(rows - values.shape[0])])


@torch.inference_mode()
def chain_eagerly(model: Any, batch: Sequence[Any], forward: Forward) -> list[Any]:
    """The batch with every chain run as ordinary passes, a host read per step: the first step for
    every row together, later steps one row at a time (the fallback: a chain past the buckets, or a
    model whose runner was dropped)."""
    firsts = forward(model, [replace(item, chain=1, keep=1 if item.chain > 1 else item.keep) for item in batch])
    results: list[Any] = []
    for item, logits in zip(batch, firsts):
        if item.chain == 1:
            results.append(logits)
            continue
        tokens: list[int] = []
        probs: list[float] = []
        while True:
            best, p_best = greedy_step(logits[-1:])
            tokens.append(int(best[0]))
            probs.append(float(p_best[0]))
            if len(tokens) == item.chain:
                break
            logits = forward(model, [replace(item, fed=[tokens[-1]], chain=1, keep=1)])[0]
        results.append((tokens, probs))
    return results
