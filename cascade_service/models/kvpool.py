"""KV storage that a batched pass reads in place: one preallocated pool per model, one slot per request.

With a `DynamicCache` per request (models.packed), every pass over several requests copied each row's
keys and values into one left-padded tensor and copied the new ones back out: per layer, per row, per
pass, two Python-driven copies of the whole cache. On the demo zoo's large model (CPU) that was a
quarter of a 16-row pass.

Here every request's cache is a row (a slot) of one tensor per layer and per K/V,
[slots, kv_heads, capacity, head_dim]: slot i holds its request's L_i keys at positions 0..L_i-1. A
pass over rows R with s_i new tokens each writes the new keys at L_i..L_i+s_i-1 with one indexed store
per layer, and attends over pool[R, :, :W] (W = max L_i + s_i): a view, no copy, when R is a run of
consecutive slots (slots are handed out lowest first, so a steady batch is), one gather otherwise.
The keys past a row's own length are hidden by a 4D mask, so no row is padded on the left and a row's
positions are its own (L_i + j). Rolling back a rejected draft is setting the length; nothing moves.

The pool grows by doubling (slots, and capacity up to what a pass needs), at the start of a pass, so
no pass ever sees tensors being replaced; it never shrinks (a freed slot is reused). Its size is what
the model holds at the most concurrent requests it has seen: slots x capacity x layers x 2 x kv_heads
x head_dim x the dtype's bytes.
"""

from __future__ import annotations

import heapq
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, EncoderDecoderCache

from .rows import padded_inputs, split_outputs

FIRST_SLOTS = 4
FIRST_CAPACITY = 128


class SlotCache:
    """One request's KV cache: a slot of its model's `KVPool` and how many positions it holds.

    The scorer's interface of a cache (`get_seq_length`, `crop`), as `DynamicCache` has it. The slot
    goes back to the pool when this object is dropped.
    """

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.slot = pool.allocate()
        self.length = 0
        weakref.finalize(self, pool.release, self.slot)

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, remove: int) -> None:
        """Drop the last -`remove` positions (`remove` <= 0, as transformers' `DynamicCache.crop` takes it)."""
        if remove > 0:
            raise ValueError(f"crop takes the negative count of positions to drop, got {remove}")
        self.length = max(0, self.length + remove)


class KVPool:
    """The KV storage of one model's requests (see the module doc). Thread-safe to allocate and
    release; a pass (`PoolPass`) must hold `lock` (the batcher's worker or a lone caller does)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # one pass at a time, and growth between passes
        self._slots_lock = threading.Lock()
        self._free: list[int] = []  # a heap
        self._next = 0  # slots handed out so far (the highest index + 1)
        self.keys: list[torch.Tensor] = []  # per layer [slots, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []

    def allocate(self) -> int:
        with self._slots_lock:
            if self._free:
                return heapq.heappop(self._free)  # lowest first: a steady batch stays a run of slots
            self._next += 1
            return self._next - 1

    def release(self, slot: int) -> None:
        with self._slots_lock:
            heapq.heappush(self._free, slot)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def reserve(self, layer: int, like: torch.Tensor, slots: int, positions: int) -> None:
        """Make layer `layer` hold at least `slots` slots of `positions` positions, shaped like `like`
        ([rows, kv_heads, new, head_dim]); growth doubles and keeps what is stored."""
        if layer < len(self.keys) and self.keys[layer].shape[0] >= slots and self.keys[layer].shape[2] >= positions:
            return  # the common case, first
        while len(self.keys) <= layer:
            self.keys.append(like.new_zeros((0, like.shape[1], 0, like.shape[3])))
            self.values.append(like.new_zeros((0, like.shape[1], 0, like.shape[3])))
        old = self.keys[layer]
        size = (_grown(old.shape[0], slots, FIRST_SLOTS), _grown(old.shape[2], positions, FIRST_CAPACITY))
        for store in (self.keys, self.values):
            grown = like.new_zeros((size[0], like.shape[1], size[1], like.shape[3]))
            grown[: old.shape[0], :, : old.shape[2]] = store[layer]
            store[layer] = grown


def _grown(have: int, need: int, first: int) -> int:
    size = max(have, first)
    while size < need:
        size *= 2
    return size


# The storages a model tier may name (config: `kv:`); config.base.KV_STORAGES is this one's keys.
STORAGES = {
    "pool": "one preallocated pool per model, a slot per request, read in place (this module)",
    "dynamic": "a DynamicCache per request, packed into one per batched pass (models.packed)",
}

# A request's KV cache as the scorer and the batcher hold it: a pool slot, or its own (`kv: dynamic`),
# or an encoder-decoder model's (models.seq2seq.Seq2SeqCache).
KVCache = SlotCache | DynamicCache | EncoderDecoderCache


@dataclass
class PoolPass:
    """The cache a model sees during one pass over `caches` (duck-typed as transformers' `Cache`:
    attention layers call `update`, which stores the new keys and returns the rows' whole keys).

    Each row feeds `steps` positions (the pass's S); a row with fewer real tokens writes its padding
    past its own length, where nothing reads it and the next pass overwrites it.
    """

    pool: KVPool
    caches: Sequence[SlotCache]
    steps: int

    def __post_init__(self) -> None:
        self.slots = [cache.slot for cache in self.caches]
        self.starts = [cache.length for cache in self.caches]
        self.width = max(self.starts) + self.steps
        first = self.slots[0]
        # A run of consecutive slots in order is a view of the pool; anything else is gathered once a layer.
        self._run = self.slots == list(range(first, first + len(self.slots)))
        self._device: torch.device | None = None
        self._top = max(self.slots) + 1

    def _indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._device != device:
            self._slot_index = torch.tensor(self.slots, device=device)
            starts = torch.tensor(self.starts, device=device)
            self._positions = starts[:, None] + torch.arange(self.steps, device=device)  # [rows, S]
            self._device = device
        return self._slot_index, self._positions

    def positions(self, device: torch.device) -> torch.Tensor:
        """position_ids [rows, S]: row i's new tokens sit at L_i, L_i + 1, ..."""
        return self._indices(device)[1]

    def mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The additive 4D mask [rows, 1, S, W]: query j of row i sees keys 0 .. L_i + j (its cache and
        its own earlier new tokens), nothing past them. Additive (0 / dtype's min), the form both
        transformers' eager and SDPA attention take as a custom mask."""
        positions = self._indices(device)[1]
        keys = torch.arange(self.width, device=device)
        hidden = keys[None, None, :] > positions[:, :, None]  # [rows, S, W]
        return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, torch.finfo(dtype).min)[
            :, None
        ]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pool = self.pool
        pool.reserve(layer_idx, key_states, self._top, self.width)
        keys, values = pool.keys[layer_idx], pool.values[layer_idx]
        if len(self.slots) == 1:  # a lone row: plain slices, no index tensors
            slot, start = self.slots[0], self.starts[0]
            keys[slot, :, start : start + self.steps] = key_states[0]
            values[slot, :, start : start + self.steps] = value_states[0]
            return keys[slot : slot + 1, :, : self.width], values[slot : slot + 1, :, : self.width]
        slots, positions = self._indices(key_states.device)
        # [rows, 1] x [rows, S] indices around the heads' slice: the stored block is [rows, S, heads, dim].
        keys[slots[:, None], :, positions] = key_states.transpose(1, 2)
        values[slots[:, None], :, positions] = value_states.transpose(1, 2)
        if self._run:
            lo = self.slots[0]
            return keys[lo : lo + len(self.slots), :, : self.width], values[lo : lo + len(self.slots), :, : self.width]
        return keys[slots, :, : self.width], values[slots, :, : self.width]

    # A lone row's pass gives no mask and no positions: the model makes them as for its own cache,
    # from these (transformers' masking_utils; models.lean reads get_seq_length), as before pools.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.starts[0]

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.starts[0]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.starts[0] + query_length, 0

    def commit(self, news: Sequence[int]) -> None:
        """After the pass: each row's cache holds its real new tokens."""
        for cache, new in zip(self.caches, news):
            cache.length += new


def forward_rows(model: Any, rows: Sequence[Any]) -> list[Any]:
    """One forward pass of `model` (an `HFModel`) over two or more `rows` (each a batcher's pass: fed,
    cache, keep, with_hidden), reading and writing their slots in place; a lone row's pass is
    `HFModel._forward`'s.

    Returns per row its [keep, V] float32 logits, or (logits, hidden [keep, H]) where asked for.
    """
    device, pool = model.device, model.kv_pool
    ids, news, wanted = padded_inputs(rows, device)
    with pool.lock:
        step = PoolPass(pool, [row.cache for row in rows], ids.shape[1])
        out = model.module(
            input_ids=ids,
            attention_mask=step.mask(model.dtype, device),
            position_ids=step.positions(device),
            past_key_values=step,
            use_cache=True,
            logits_to_keep=torch.tensor(wanted, device=device),
            output_hidden_states=any(row.with_hidden for row in rows),
        )
        step.commit(news)
    return split_outputs(out, rows, news, wanted)
