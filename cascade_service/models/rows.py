"""The inputs and outputs of a forward pass over requests' rows, whatever holds their KV caches.

A batched pass (models.kvpool's in place, models.packed's over packed caches) feeds each row's new
tokens right-padded to the longest, sends through the LM head only the positions some row asked for,
and hands each row back its last `keep` rows; a lone pass (HFModel.forward_now, models.seq2seq) only the
last `keep`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def padded_inputs(batch: Sequence[Any], device: torch.device) -> tuple[torch.Tensor, list[int], list[int]]:
    """(input ids [rows, S] right-padded with 0, new tokens per row, the positions some row keeps)."""
    news = [len(item.fed) for item in batch]
    ids = torch.zeros((len(batch), max(news)), dtype=torch.long, device=device)
    for i, item in enumerate(batch):
        ids[i, : news[i]] = torch.tensor(list(item.fed), dtype=torch.long, device=device)
    # Only the rows some request asked for go through the LM head (a prefill asks for one of many).
    wanted = sorted({j for item, s in zip(batch, news) for j in range(s - item.keep, s)})
    return ids, news, wanted


def split_outputs(out: Any, batch: Sequence[Any], news: Sequence[int], wanted: Sequence[int]) -> list[Any]:
    """Each row's [keep, V] float32 logits of a padded pass ([rows, S]) whose head ran on `wanted`,
    with its [keep, H] final hidden states where it asked for them."""
    kept = [(i, list(range(s - item.keep, s))) for i, (item, s) in enumerate(zip(batch, news))]
    return kept_outputs(out, batch, kept, wanted)


def kept_outputs(
    out: Any, batch: Sequence[Any], kept: Sequence[tuple[int, list[int]]], wanted: Sequence[int]
) -> list[Any]:
    """Each row's kept logits (float32), with its final hidden states where it asked for them: row r's
    are at sequence `kept[r][0]`, positions `kept[r][1]`, of a pass whose head ran on `wanted` (a
    padded pass: row i's own sequence; a ragged one: every row in sequence 0)."""
    index = {j: k for k, j in enumerate(wanted)}
    results: list[Any] = []
    for item, (seq, positions) in zip(batch, kept):
        logits = out.logits[seq, [index[j] for j in positions]].float()  # [keep, V]
        if item.with_hidden:
            results.append((logits, out.hidden_states[-1][seq, positions].float()))
        else:
            results.append(logits)
    return results


def last_rows(logits: torch.Tensor, hidden: torch.Tensor | None, keep: int) -> Any:
    """A lone row's last `keep` rows: [keep, V] float32 logits, with [keep, H] hidden states where given
    (the final-norm output, what the LM head consumed)."""
    rows = logits[0, -keep:].float()
    return rows if hidden is None else (rows, hidden[0, -keep:].float())
