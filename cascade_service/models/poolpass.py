"""A forward pass over requests' paged KV caches (models.kvpool), read and written in place.

A pass over rows R with S new tokens each writes each row's new keys at its own positions L_i..L_i+S-1
with one indexed store per layer, and attends over its blocks gathered whole, once per layer (each
block one contiguous copy); a lone row over consecutive blocks reads a view. The 4D mask hides every
key past a row's own length, so no row is padded on the left and a row's positions are its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .cachearg import cache_kwargs
from .kvpool import BLOCK, NULL, KVPool, PagedCache
from .rows import padded_inputs, split_outputs


@dataclass
class PoolPass:
    """The cache a model sees during one pass over `caches` (duck-typed as transformers' `Cache`:
    attention layers call `update`, which stores the new keys and returns the rows' whole keys).

    Each row feeds `steps` positions (the pass's S) and gets blocks for them; a row with fewer real
    tokens writes its padding past its own length, where nothing reads it, and `commit` returns the
    blocks past its real length.
    """

    pool: KVPool
    caches: Sequence[PagedCache]
    steps: int
    _index: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Read by transformers' masking (4.54 - 4.57 without a default): a pool pass is never compiled.
    is_compileable = False

    def __post_init__(self) -> None:
        self.starts = [cache.length for cache in self.caches]
        self.width = max(self.starts) + self.steps
        if len(self.caches) > 1:  # whole blocks, gathered as they lie; the mask hides the rest
            self.width = -(-self.width // BLOCK) * BLOCK
        now = next(self.pool.clock)
        try:
            for cache, start in zip(self.caches, self.starts):
                self.pool.own_tail(cache, self.caches)
                self.pool.extend(cache, start + self.steps, self.caches)
                cache.used = now
        except BaseException:  # no room for the pass (KVBudgetExceeded): its rows are as they were
            self.abandon()
            raise
        table = self.caches[0].table
        # A lone row over consecutive blocks writes and reads a slice of the pool (no index tensors);
        # anything else is indexed and gathered.
        self._run = (
            len(self.caches) == 1
            and table[-1] - table[0] == len(table) - 1
            and table == list(range(table[0], table[-1] + 1))
        )

    def _indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(flat slots written [rows, S], the blocks read [rows * W / BLOCK], positions [rows, S])."""
        if device not in self._index:
            blocks = -(-self.width // BLOCK)
            tables = torch.tensor(
                [c.table[:blocks] + [NULL] * (blocks - len(c.table[:blocks])) for c in self.caches], device=device
            )
            flat = (tables[:, :, None] * BLOCK + torch.arange(BLOCK, device=device)).view(len(self.caches), -1)
            positions = torch.tensor(self.starts, device=device)[:, None] + torch.arange(self.steps, device=device)
            self._index[device] = (flat.gather(1, positions), tables.view(-1), positions)
        return self._index[device]

    def positions(self, device: torch.device) -> torch.Tensor:
        """position_ids [rows, S]: row i's new tokens sit at L_i, L_i + 1, ..."""
        return self._indices(device)[2]

    def mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The additive 4D mask [rows, 1, S, W]: query j of row i sees keys 0 .. L_i + j (its cache and
        its own earlier new tokens), nothing past them. Additive (0 / dtype's min), the form both
        transformers' eager and SDPA attention take as a custom mask."""
        positions = self._indices(device)[2]
        keys = torch.arange(self.width, device=device)
        hidden = keys[None, None, :] > positions[:, :, None]  # [rows, S, W]
        return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, torch.finfo(dtype).min)[
            :, None
        ]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pool = self.pool
        pool.reserve(layer_idx, key_states)
        heads, dim = key_states.shape[1], key_states.shape[3]
        keys, values = pool.keys[layer_idx], pool.values[layer_idx]  # [capacity, BLOCK, heads, dim]
        if self._run:
            flat_keys, flat_values = keys.view(-1, heads, dim), values.view(-1, heads, dim)
            lo = self.caches[0].table[0] * BLOCK
            new = slice(lo + self.starts[0], lo + self.width)
            flat_keys[new] = key_states[0].transpose(0, 1)  # [S, heads, dim]
            flat_values[new] = value_states[0].transpose(0, 1)
            window = slice(lo, lo + self.width)
            return flat_keys[window].transpose(0, 1)[None], flat_values[window].transpose(0, 1)[None]
        written, read, _ = self._indices(key_states.device)
        keys.view(-1, heads, dim)[written] = key_states.transpose(1, 2)  # [rows, S, heads, dim]
        values.view(-1, heads, dim)[written] = value_states.transpose(1, 2)
        # Whole blocks, each one contiguous copy: [rows, W, heads, dim] -> [rows, heads, W, dim] (a lone
        # row's W is its length, not whole blocks: the model made its mask for exactly that).
        rows = len(self.caches)
        return (
            keys.index_select(0, read).view(rows, -1, heads, dim)[:, : self.width].transpose(1, 2),
            values.index_select(0, read).view(rows, -1, heads, dim)[:, : self.width].transpose(1, 2),
        )

    # A lone row's pass gives no mask and no positions: the model makes them as for its own cache,
    # from these (transformers' masking_utils; models.lean reads get_seq_length), as before pools.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.starts[0]

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.starts[0]

    def get_mask_sizes(self, query_length: int | torch.Tensor, layer_idx: int = 0) -> tuple[int, int]:
        # transformers before 5.x's mask rework passes the pass's cache_position [S], later ones S.
        steps = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        return self.starts[0] + steps, 0

    def commit(self, news: Sequence[int]) -> None:
        """After the pass: each row's cache holds its real new tokens, and no block past them."""
        for cache, start, new in zip(self.caches, self.starts, news):
            cache.length = start + new
            self.pool.truncate(cache, cache.length)

    def abandon(self) -> None:
        """A failed pass: each row's cache is as it was (blocks it took for the pass go back)."""
        for cache, start in zip(self.caches, self.starts):
            self.pool.truncate(cache, start)


def forward_rows(model: Any, rows: Sequence[Any]) -> list[Any]:
    """One forward pass of `model` (an `HFModel`) over two or more `rows` (each a batcher's pass: fed,
    cache, keep, with_hidden), reading and writing their blocks in place; a lone row's pass is
    `HFModel.forward_now`'s.

    Returns per row its [keep, V] float32 logits, or (logits, hidden [keep, H]) where asked for.
    """
    device, pool = model.device, model.kv_pool
    ids, news, wanted = padded_inputs(rows, device)
    with pool.lock:
        step = PoolPass(pool, [row.cache for row in rows], ids.shape[1])
        try:
            out = model.module(
                input_ids=ids,
                attention_mask=step.mask(model.dtype, device),
                position_ids=step.positions(device),
                **cache_kwargs(model.module, step),
                use_cache=True,
                logits_to_keep=torch.tensor(wanted, device=device),
                output_hidden_states=any(row.with_hidden for row in rows),
            )
        except BaseException:
            step.abandon()
            raise
        step.commit(news)
    return split_outputs(out, rows, news, wanted)
