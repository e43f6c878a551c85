"""A lean model's batched pass over the KV pool in fixed shapes (issue 49, work in progress: not yet
wired into the batcher, not yet captured on a GPU).

On a GPU a small model's step is kernel launches and Python, not arithmetic (the shipped family's
target: 9.15 ms a row on an H200, where its arithmetic is microseconds). Capturing a pass as a CUDA
graph and replaying it removes both, but a graph replays fixed shapes and fixed addresses: nothing in
the pass may depend on the rows' lengths or read a value back to the host. This module is that pass:

- shapes come from buckets: rows B (ROW_BUCKETS), new tokens per row S (TOKEN_BUCKETS: the block sizes
  a schedule uses, k + 1) and context width W (a multiple of WIDTH_STEP); a pass outside them runs as
  today (models.poolpass);
- every index the pass needs is a tensor of those shapes (`StaticInputs`), filled on the host before the
  pass: the ids, their positions, the pool slots the new keys go to, the slots each row reads (its
  blocks, then the NULL block), and the additive mask. Padding rows and tokens write to the NULL block
  (block 0, which no request owns and every read masks) and read it;
- the pass (`static_forward`) writes with `index_copy_` and reads with `index_select` over the pool's
  flat slots: the same work for any rows of the same bucket.

What is left (issue 49 points 1 and 2): capturing `static_forward` per bucket on cuda (and again when
the pool's tensors grow: a captured graph holds their addresses), routing the batcher's passes of lean
models on cuda to it, and measuring it against torch.compile's reduce-overhead mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .kvpool import BLOCK, NULL, KVPool, PagedCache
from .lean import LeanLlama, rms_norm, rotate_half

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TOKEN_BUCKETS = (1, 2, 4, 8, 16)
WIDTH_STEP = 256  # context widths in steps of this many positions (16 blocks)


def bucket(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds n, or None past the largest."""
    return next((b for b in buckets if b >= n), None)


@dataclass
class StaticInputs:
    """A pass's indices in a bucket's shapes (B rows, S new tokens each, W positions read)."""

    ids: torch.Tensor  # [B, S] long: the new tokens (0 where padding)
    positions: torch.Tensor  # [B, S] long: their positions (0 where padding)
    write: torch.Tensor  # [B * S] long: the flat pool slot each new token's keys go to (NULL's where padding)
    read: torch.Tensor  # [B * W] long: the flat slots each row reads, its blocks in order, then NULL's
    mask: torch.Tensor  # [B, 1, S, W]: 0 where a query sees a key, the dtype's min elsewhere


def static_inputs(
    caches: Sequence[PagedCache], news: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device
) -> StaticInputs | None:
    """The inputs of a pass feeding `news[i]` to `caches[i]` (whose tables already hold blocks for
    them), in bucket shapes; None where the pass fits no bucket."""
    rows = bucket(len(caches), ROW_BUCKETS)
    steps = bucket(max(len(n) for n in news), TOKEN_BUCKETS)
    longest = max(c.length + len(n) for c, n in zip(caches, news))
    if rows is None or steps is None:
        return None
    width = -(-longest // WIDTH_STEP) * WIDTH_STEP
    ids = torch.zeros((rows, steps), dtype=torch.long)
    positions = torch.zeros((rows, steps), dtype=torch.long)
    write = torch.full((rows, steps), NULL * BLOCK, dtype=torch.long)
    read = torch.full((rows, width), NULL * BLOCK, dtype=torch.long)
    seen = torch.zeros((rows, steps, width), dtype=torch.bool)
    for i, (cache, new) in enumerate(zip(caches, news)):
        start, n = cache.length, len(new)
        table = torch.tensor(cache.table, dtype=torch.long)
        slots = (table[:, None] * BLOCK + torch.arange(BLOCK)).view(-1)[: start + n]
        ids[i, :n] = torch.tensor(list(new), dtype=torch.long)
        positions[i, :n] = torch.arange(start, start + n)
        write[i, :n] = slots[start : start + n]
        read[i, : start + n] = slots
        # Query j of row i sees keys 0 .. start + j.
        seen[i, :n, : start + n] = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
    # A padding query sees one key (NULL's), so its softmax has something to normalise: no NaN.
    seen[:, :, 0] |= ~seen.any(dim=-1)
    mask = torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, torch.finfo(dtype).min)[:, None]
    return StaticInputs(
        ids.to(device), positions.to(device), write.view(-1).to(device), read.view(-1).to(device), mask.to(device)
    )


@torch.inference_mode()
def static_forward(model: LeanLlama, pool: KVPool, inputs: StaticInputs) -> torch.Tensor:
    """The lean forward over `inputs` (every shape fixed by its bucket): [B, S, V] logits, the new
    keys and values written to the pool. No host read and no shape that depends on the rows' lengths."""
    rows, steps = inputs.ids.shape
    width = inputs.read.shape[0] // rows
    heads, kv, dim = model.heads, model.kv_heads, model.head_dim
    cos, sin = model.cos[inputs.positions].unsqueeze(1), model.sin[inputs.positions].unsqueeze(1)
    x = F.embedding(inputs.ids, model.embed)
    for index, layer in enumerate(model.blocks):
        h = rms_norm(x, layer.norm_in, model.eps)
        qkv = F.linear(h, layer.qkv).view(rows, steps, heads + 2 * kv, dim).transpose(1, 2)
        qk = qkv[:, : heads + kv]
        qk = qk * cos + rotate_half(qk) * sin
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv :]
        keys, values = pool.keys[index].view(-1, kv, dim), pool.values[index].view(-1, kv, dim)
        keys.index_copy_(0, inputs.write, k.transpose(1, 2).reshape(rows * steps, kv, dim))
        values.index_copy_(0, inputs.write, v.transpose(1, 2).reshape(rows * steps, kv, dim))
        k_all = keys.index_select(0, inputs.read).view(rows, width, kv, dim).transpose(1, 2)
        v_all = values.index_select(0, inputs.read).view(rows, width, kv, dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=inputs.mask, enable_gqa=heads != kv)
        x = x + F.linear(out.transpose(1, 2).reshape(rows, steps, heads * dim), layer.out)
        h = rms_norm(x, layer.norm_mid, model.eps)
        gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, layer.down)
    return model.lm_head(rms_norm(x, model.norm, model.eps))


def forward_static_rows(model: Any, fed: Sequence[Sequence[int]], caches: Sequence[PagedCache]) -> list[Any] | None:
    """Each row's [len(fed[i]), V] float32 logits from one fixed-shape pass of `model` (an HFModel over
    a LeanLlama with a pool), the caches then holding the new tokens; None (nothing done) where the pass
    fits no bucket."""
    if bucket(len(caches), ROW_BUCKETS) is None or bucket(max(map(len, fed)), TOKEN_BUCKETS) is None:
        return None  # before any block is taken: the eager pass takes them
    pool, lean = model.kv_pool, model.module
    with pool.lock:
        for cache, new in zip(caches, fed):
            pool.own_tail(cache, caches)
            pool.extend(cache, cache.length + len(new), caches)
        inputs = static_inputs(caches, fed, model.dtype, model.device)
        assert inputs is not None  # the buckets held it, checked above
        like = torch.empty(1, lean.kv_heads, 1, lean.head_dim, dtype=model.dtype, device=model.device)
        for layer in range(len(lean.blocks)):
            pool.reserve(layer, like)
        logits = static_forward(lean, pool, inputs)
        for cache, new in zip(caches, fed):
            cache.length += len(new)
            pool.truncate(cache, cache.length)
    return [logits[i, : len(new)].float() for i, new in enumerate(fed)]


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: StaticInputs  # the buffers the graph reads: each replay copies a pass's inputs into them
    logits: torch.Tensor  # the buffer it writes
    storage: tuple[int, ...]  # the pool tensors' addresses it was captured over


class CapturedPasses:
    """`static_forward` of one lean model on cuda as CUDA graphs, one per bucket (B, S, W), captured at
    its first use and again once the pool's tensors have grown (a graph holds their addresses).
    Unverified: no GPU has run this yet (issue 49)."""

    def __init__(self, model: LeanLlama, pool: KVPool):
        self.model, self.pool = model, pool
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.captures = 0

    def run(self, inputs: StaticInputs) -> torch.Tensor:
        """[B, S, V] logits of the pass over `inputs` (a copy: the graph's buffer is reused)."""
        rows, steps = inputs.ids.shape
        key = (rows, steps, inputs.read.shape[0] // rows)
        storage = tuple(t.data_ptr() for t in self.pool.keys + self.pool.values)
        entry = self.graphs.get(key)
        if entry is None or entry.storage != storage:
            entry = self.graphs[key] = self._capture(inputs, storage)
        else:
            for name in ("ids", "positions", "write", "read", "mask"):  # into the graph's own buffers
                getattr(entry.inputs, name).copy_(getattr(inputs, name))
            entry.graph.replay()
        return entry.logits.clone()

    def _capture(self, inputs: StaticInputs, storage: tuple[int, ...]) -> _Graph:
        # A warm-up pass on a side stream first (what torch's CUDA-graph recipe asks: lazy inits and
        # workspace allocations happen outside the capture); it writes this pass's keys, as the replay
        # would, so its result is the pass's.
        static = StaticInputs(
            *(t.clone() for t in (inputs.ids, inputs.positions, inputs.write, inputs.read, inputs.mask))
        )
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            static_forward(self.model, self.pool, static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = static_forward(self.model, self.pool, static)
        graph.replay()  # capturing records the work without doing it
        self.captures += 1
        return _Graph(graph, static, logits, storage)
