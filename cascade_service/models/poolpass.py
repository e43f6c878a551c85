"""A forward pass over requests' paged KV caches (models.kvpool), read and written in place.

A pass over rows R with S new tokens each writes each row's new keys at its own positions L_i..L_i+S-1
with one indexed store per layer, and attends over its blocks gathered whole, once per layer (each
block one contiguous copy); a lone row over consecutive blocks reads a view. The 4D mask hides every
key past a row's own length, so no row is padded on the left and a row's positions are its own.

A ragged pass (`ragged`: a transformers model under SDPA) feeds rows of different new-token counts
without padding them: the embeddings, every linear layer and the LM head run over the rows'
s_1 + ... + s_R real tokens concatenated ([1, T]), and attention runs once per group of rows with the
same s (`ragged_attention`, a transformers attention function for this pass alone). So a k + 1-token
verification beside fifteen one-token decode rows costs k + 16 tokens, not 16 (k + 1): what a
verification adds to a shared pass is its extra tokens.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention import grouped_sdpa, pack_mask
from .cachearg import cache_kwargs
from .kvpool import BLOCK, NULL, KVPool, PagedCache
from .rows import kept_outputs, padded_inputs, split_outputs


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
    # Ragged: each row's real new tokens (the pass's S is their most); the model's inputs are the
    # rows' real tokens concatenated, and only those are written. None: every row feeds S.
    news: Sequence[int] | None = None
    _index: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _real: dict[torch.device, torch.Tensor] = field(default_factory=dict)
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
        """position_ids [rows, S]: row i's new tokens sit at L_i, L_i + 1, ... (ragged: [1, T], the real
        tokens' alone, in row order)."""
        positions = self._indices(device)[2]
        return positions.view(-1)[self.real(device)][None] if self.news is not None else positions

    def groups(self) -> list[tuple[slice, int, slice]]:
        """A ragged pass's runs of consecutive rows with the same new-token count s: (their rows, s, their
        tokens in the [T] concatenation). Slices, not index tensors: a run's queries, keys, values and
        mask rows are views of the pass's, where indexing copied each layer's gathered keys and values
        again (62% of a 60-row decode pass of the shipped target went to those copies). So that each
        count is one run, `_forward_ragged` feeds the rows ordered by their counts."""
        assert self.news is not None
        runs: list[tuple[slice, int, slice]] = []
        row = token = 0
        for steps, same in itertools.groupby(self.news):
            n = len(list(same))
            runs.append((slice(row, row + n), steps, slice(token, token + n * steps)))
            row, token = row + n, token + n * steps
        return runs

    def real(self, device: torch.device) -> torch.Tensor:
        """A ragged pass's real tokens as indices into its [rows * S] padded layout ([T], row order)."""
        if device not in self._real:
            assert self.news is not None
            self._real[device] = torch.tensor(
                [i * self.steps + j for i, n in enumerate(self.news) for j in range(n)], device=device
            )
        return self._real[device]

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

    # Never under autograd, whoever calls: a pool written under it would chain every pass's graph
    # to its tensors (memory grew ~90 MB a pass in a script that forgot inference_mode), and the
    # gather into the pool's scratch (`out=`) refuses tensors that need grad.
    @torch.no_grad()
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
        if self.news is not None:  # [1, heads, T, dim]: the real tokens' keys go to their slots alone
            written = written.view(-1)[self.real(key_states.device)]
            keys.view(-1, heads, dim)[written] = key_states[0].transpose(0, 1)  # [T, heads, dim]
            values.view(-1, heads, dim)[written] = value_states[0].transpose(0, 1)
        else:
            keys.view(-1, heads, dim)[written] = key_states.transpose(1, 2)  # [rows, S, heads, dim]
            values.view(-1, heads, dim)[written] = value_states.transpose(1, 2)
        # Whole blocks, each one contiguous copy: [rows, W, heads, dim] -> [rows, heads, W, dim] (a lone
        # row's W is its length, not whole blocks: the model made its mask for exactly that).
        # Gathered into the pool's scratch (KVPool.window), not a fresh tensor a layer.
        rows = len(self.caches)
        key_window, value_window = pool.window(read.shape[0], keys)
        torch.index_select(keys, 0, read, out=key_window)
        torch.index_select(values, 0, read, out=value_window)
        return (
            key_window.view(rows, -1, heads, dim)[:, : self.width].transpose(1, 2),
            value_window.view(rows, -1, heads, dim)[:, : self.width].transpose(1, 2),
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


# A ragged pass's attention: transformers' attention layers call the function registered under their
# config's `_attn_implementation`, so for the pass alone (under the pool's lock, which every pass of
# the model holds) the config names this one, and the pass's layout is this thread's. Registered with
# SDPA's mask function too, so a forward that met the name elsewhere would build SDPA's own mask.
RAGGED = "cascade-ragged"
_layout = threading.local()


def ragged_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Any,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A pool pass's attention (`pool_attention`), grouped-query heads packed, not repeated
    (models.attention). Ragged, one call per run of rows with the same new-token count
    (PoolPass.groups): query [1, heads, T] (the rows' real tokens) is cut into each run's
    [n, heads, s, dim], which attends to its rows' keys (of [R, kv_heads, W, dim]) under their rows of
    the pass's [R, 1, S, W] mask; the outputs come back as [1, T, heads, dim]. Grouped, not padded to
    S: on a small model attention is most of a pass, and a 7-token verification padding fifteen
    one-token rows to 7 queries tripled it. A lone row, or a padded pass: one call. Without a mask
    shared by the heads (a causal lone row, a position bias): transformers' SDPA itself."""
    if (
        mask is None
        or mask.shape[1] != 1
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or kwargs.get("dropout", 0.0)
    ):
        return sdpa_attention_forward(module, query, key, value, mask, *args, **kwargs)
    scale = kwargs.get("scaling")
    groups = getattr(_layout, "groups", None)
    group = query.shape[1] // key.shape[1]
    if groups is None or query.shape[0] == key.shape[0]:
        packed = _packed(mask, None, group, query.dtype)
        return grouped_sdpa(query, key, value, None, scale, packed).transpose(1, 2).contiguous(), None
    heads, dim = query.shape[1], query.shape[3]
    outs = []
    for rows, steps, tokens in groups:
        n = rows.stop - rows.start
        q = query[0, :, tokens].view(heads, n, steps, dim).transpose(0, 1)  # [n, heads, s, dim]
        packed = _packed(mask, (rows.start, rows.stop, steps), group, query.dtype)
        got = grouped_sdpa(q, key[rows], value[rows], None, scale, packed)  # [n, heads, s, dim]
        outs.append(got.transpose(1, 2).reshape(n * steps, heads, dim))
    return (outs[0] if len(outs) == 1 else torch.cat(outs))[None], None


def _packed(mask: torch.Tensor, run: tuple[int, int, int] | None, group: int, dtype: torch.dtype) -> Any:
    """The pass's mask for a run of rows (start, stop, new tokens; None: every row), packed for
    grouped attention and made additive (models.attention `pack_mask`): made by the first layer, read
    by the others. Every layer of a pass gets the same mask tensor, so the memo (this pass's:
    `pool_attention`) is keyed by it and the run."""
    memo = getattr(_layout, "masks", None)
    if memo is None:
        return pack_mask(_run_rows(mask, run), group, dtype)
    key = (id(mask), run, group, dtype)  # the pass holds `mask` alive: its id stays its own while the memo lives
    found = memo.get(key)
    if found is None:
        found = memo[key] = pack_mask(_run_rows(mask, run), group, dtype)
    return found


def _run_rows(mask: torch.Tensor, run: tuple[int, int, int] | None) -> torch.Tensor:
    return mask if run is None else mask[run[0] : run[1], :, : run[2]]


ALL_ATTENTION_FUNCTIONS.register(RAGGED, ragged_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(RAGGED, sdpa_mask)


def ragged(model: Any) -> bool:
    """Whether `model`'s batched pool passes run ragged: transformers' own forward (backend `hf`) under
    SDPA, whose attention this pass's replaces (the lean forward and eager attention do not look it up)."""
    config = getattr(model.module, "config", None)
    return (
        getattr(model, "backend", None) == "hf"
        and getattr(config, "_attn_implementation", None) == "sdpa"
        and not getattr(model, "encoder_decoder", False)
    )


@contextmanager
def pool_attention(model: Any, groups: list[tuple[slice, int, slice]] | None = None) -> Iterator[None]:
    """While a pool pass of `model` runs (under its pool's lock): its attention layers call
    `ragged_attention`, over `groups` (a ragged pass's runs) or as one call (a lone row). A model that
    is not `ragged` (the lean forward, eager attention) runs as it is."""
    if not ragged(model):
        yield
        return
    config = model.module.config
    _layout.groups = groups
    _layout.masks = {}
    previous, config._attn_implementation = config._attn_implementation, RAGGED
    try:
        yield
    finally:
        config._attn_implementation = previous
        _layout.groups = None
        _layout.masks = None


def forward_rows(model: Any, rows: Sequence[Any], allow_ragged: bool = True) -> list[Any]:
    """One forward pass of `model` (an `HFModel`) over two or more `rows` (each a batcher's pass: fed,
    cache, keep, with_hidden), reading and writing their blocks in place; a lone row's pass is
    `HFModel.forward_now`'s. Ragged where the model allows (`ragged`) and `allow_ragged` (False: a
    benchmark's padded pass beside it), else right-padded.

    Returns per row its [keep, V] float32 logits, or (logits, hidden [keep, H]) where asked for.
    """
    if allow_ragged and ragged(model):
        return _forward_ragged(model, rows)
    device, pool = model.device, model.kv_pool
    ids, news, wanted = padded_inputs(rows, device)
    with pool.lock:
        step = PoolPass(pool, [row.cache for row in rows], ids.shape[1])
        try:
            with pool_attention(model):  # one call a layer (a padded pass's rows share S)
                out = _module_pass(model, step, ids, wanted, rows)
        except BaseException:
            step.abandon()
            raise
        step.commit(news)
    return split_outputs(out, rows, news, wanted)


def _module_pass(model: Any, step: PoolPass, ids: torch.Tensor, wanted: list[int], rows: Sequence[Any]) -> Any:
    """The model's forward over a pool pass: its ids ([rows, S] padded, or [1, T] ragged), the pass's
    4D mask ([rows, 1, S, W], which transformers uses as it is) and positions, the LM head on `wanted`."""
    device = model.device
    return model.module(
        input_ids=ids,
        attention_mask=step.mask(model.dtype, device),
        position_ids=step.positions(device),
        **cache_kwargs(model.module, step),
        use_cache=True,
        logits_to_keep=torch.tensor(wanted, device=device),
        output_hidden_states=any(row.with_hidden for row in rows),
    )


def _forward_ragged(model: Any, rows: Sequence[Any]) -> list[Any]:
    # Rows with the same new-token count side by side, so that each count is one run of attention
    # (PoolPass.groups); each row's result goes back to its own place.
    order = sorted(range(len(rows)), key=lambda i: len(rows[i].fed))
    rows = [rows[i] for i in order]
    device, pool = model.device, model.kv_pool
    news = [len(row.fed) for row in rows]
    ids = torch.tensor([[t for row in rows for t in row.fed]], dtype=torch.long, device=device)  # [1, T]
    ends = list(itertools.accumulate(news))
    kept = [list(range(end - row.keep, end)) for row, end in zip(rows, ends)]  # each row's rows, flat
    wanted = sorted({j for row_kept in kept for j in row_kept})
    with pool.lock:
        step = PoolPass(pool, [row.cache for row in rows], max(news), news=news)
        try:
            with pool_attention(model, step.groups()):
                out = _module_pass(model, step, ids, wanted, rows)
        except BaseException:
            step.abandon()
            raise
        step.commit(news)
    results = kept_outputs(out, rows, [(0, row_kept) for row_kept in kept], wanted)
    back: list[Any] = [None] * len(rows)
    for place, result in zip(order, results):
        back[place] = result
    return back
