"""Paged KV storage that batched passes read in place, with a prefix cache: one block pool per model.

Every model's keys and values live in one tensor per layer and per K/V, [blocks, BLOCK, kv_heads,
head_dim]. A request's cache (`PagedCache`) is a block table: position p of the request sits at slot
p % BLOCK of block table[p // BLOCK]. A pass over rows R writes each row's new keys with one indexed
store per layer and attends over its positions 0..W-1 gathered once per layer; a lone row whose blocks
are consecutive reads a view, no copy. Keys past a row's own length are hidden by a 4D mask, so no row
is padded on the left and a row's positions are its own (L_i + j). Memory is what the requests' tokens
hold, to the block (not a slot of the longest request per request).

The prefix cache: a full block of committed tokens (below the request's `stable`, so it never changes
again) is published under a hash chained over every token before it and the request's salt (its API
key's: `cache_salt`, as vLLM has it), so a block is found only by a request with the same salt and
the same tokens up to the block's end. A new request attaches the longest published chain of its
prompt (its blocks are shared, read-only: a request writes only at or past its own length, which is
past every full block it shares) and feeds only the rest. Blocks nobody holds stay cached, least
recently used first to go, while the pool is under its budget.

Allocation, in order: a free block; a new block while under the budget; the least recently used
cached block (an eviction); the blocks of a request that is not in a pass (a preemption: its cache
is emptied, and its scorer re-reads what it held, through the prefix cache); else `KVBudgetExceeded`.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import struct
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from transformers import DynamicCache, EncoderDecoderCache

from cascade_service.core.tier import Overloaded

BLOCK = 16  # positions per block: small enough that a block's waste is little, large enough to gather fast
GROWTH = 1.1  # the tensors grow by this factor (capped at the budget): at most 10% above the blocks handed out
FIRST_BLOCKS = 32
NULL = 0  # block 0 holds no request's keys: rows' gathers past their table read it (masked)


class KVBudgetExceeded(Overloaded):
    """The requests in one pass need more blocks than the pool's budget holds: RESOURCE_EXHAUSTED at
    the edge, as a full queue is (retry later, or lower the batch)."""


@dataclass
class PoolCounters:
    """A pool's prefix-cache and block figures (Prometheus: cascade:prefix_cache_*, cascade:kv_*)."""

    queries: int = 0  # prompt tokens looked up in the prefix cache
    hits: int = 0  # of them, tokens whose keys were found there
    evictions: int = 0  # cached blocks given to other requests
    preemptions: int = 0  # requests' caches emptied to make room


class PagedCache:
    """One request's KV cache: its block table and how many positions it holds.

    The scorer's interface of a cache (`get_seq_length`, `crop`), as `DynamicCache` has it. Its blocks
    go back to the pool when it is cropped below them or dropped.
    """

    def __init__(self, pool: KVPool, salt: str = ""):
        self.pool = pool
        self.table: list[int] = []  # mutated in place, never replaced: the finalizer holds it
        self.length = 0
        self.root = pool.root(salt)
        self.chain: list[bytes] = []  # the hash of each of the first len(chain) blocks, as published
        self.pinned = 0  # > 0 while a pass of it is queued or running: never preempted then
        self.claims: tuple[Future, list[bytes]] | None = None  # blocks it is computing (KVPool.claim)
        self.used = 0  # the pool's clock at its last pass (preemption takes the least recent)
        pool.live.add(self)
        weakref.finalize(self, pool.drop, self.table)

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, remove: int) -> None:
        """Drop the last -`remove` positions (`remove` <= 0, as transformers' `DynamicCache.crop` takes it)."""
        if remove > 0:
            raise ValueError(f"crop takes the negative count of positions to drop, got {remove}")
        self.pool.truncate(self, max(0, self.length + remove))


class KVPool:
    """The KV storage of one model's requests (see the module doc). A pass (`PoolPass`) and every
    change of blocks hold `lock`.

    layer_bytes_per_token: one layer's K and V bytes for one position (None: no budget can be set);
    budget_bytes: the most the pool's tensors may hold (None: unbounded).
    """

    def __init__(self, layers: int = 0, layer_bytes_per_token: int = 0, budget_bytes: int | None = None):
        self.lock = threading.RLock()
        self.keys: list[torch.Tensor] = []  # per layer [capacity, BLOCK, kv_heads, head_dim]
        self.values: list[torch.Tensor] = []
        self.block_bytes = layers * layer_bytes_per_token * BLOCK  # every layer's, K and V
        self.max_blocks = budget_bytes // self.block_bytes if budget_bytes and self.block_bytes else None
        if self.max_blocks is not None and self.max_blocks < 2:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block ({self.block_bytes} bytes each)")
        self.blocks = 1  # block ids handed out so far (block 0 is NULL)
        self.refs = [1]  # per block: the caches holding it (NULL is held forever)
        self._free: list[int] = []  # a heap: lowest first, so a request's blocks tend to be consecutive
        self.index: dict[bytes, int] = {}  # a published chain hash -> its block
        self.hash_of: dict[int, bytes] = {}
        self.cached: OrderedDict[int, None] = OrderedDict()  # published blocks nobody holds, oldest first
        # Blocks a request is computing now (chain hash -> its claim): a request that needs one of them
        # waits for that prefill instead of computing the same keys beside it (`claim`).
        self.pending: dict[bytes, Future] = {}
        self.live: weakref.WeakSet[PagedCache] = weakref.WeakSet()
        self.counters = PoolCounters()
        self.held = 0  # blocks some request holds (NULL not counted)
        # Where events go besides `counters` (models.hf sets the process's metrics: metrics.KV_EVENTS).
        self.report: Callable[[str, int], None] = _ignore
        self.clock = itertools.count(1)
        # How much the tensors grow at a time; models.staticpass doubles it under captured graphs (a
        # growth moves the tensors, and every graph holding their addresses is captured again).
        self.growth = GROWTH
        # Bumped whenever the tensors are replaced: a captured graph holds their addresses, and after
        # `empty_cache()` a new tensor can take an old one's address with another capacity, so the
        # addresses alone cannot tell a stale graph (models.staticpass `pool_identity`).
        self.generation = 0
        # Where a batched pass gathers its rows' keys and values, layer after layer (`window`).
        self._windows: tuple[torch.Tensor, torch.Tensor] | None = None

    # --- what it holds ------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Blocks the tensors hold now (NULL included)."""
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def used_blocks(self) -> int:
        """Blocks some request holds."""
        return self.held

    def free_blocks(self) -> int:
        """Blocks a request could take without evicting or preempting (free, and not yet grown)."""
        room = (self.max_blocks - self.blocks) if self.max_blocks is not None else 0
        return len(self._free) + room

    # --- blocks -------------------------------------------------------------------------------------

    def take(self, busy: Sequence[PagedCache] = ()) -> int:
        """A block for a request's new positions (see the module doc for the order)."""
        with self.lock:
            while True:
                if self._free:
                    block = heapq.heappop(self._free)
                elif self.max_blocks is None or self.blocks < self.max_blocks:
                    block, self.blocks = self.blocks, self.blocks + 1
                    self.refs.append(0)
                elif self.cached:
                    block, _ = self.cached.popitem(last=False)
                    del self.index[self.hash_of.pop(block)]
                    self.counters.evictions += 1
                    self.report("evictions", 1)
                elif not self._preempt(busy):
                    raise KVBudgetExceeded(
                        f"the KV budget of {self.max_blocks} blocks of {BLOCK} positions is held by the "
                        "requests of one pass; raise kv_budget_mb or lower max_batch"
                    )
                else:
                    continue
                self.refs[block] = 1
                self.held += 1
                return block

    def _preempt(self, busy: Sequence[PagedCache]) -> bool:
        spare = set(map(id, busy))
        victims = [c for c in self.live if c.table and not c.pinned and id(c) not in spare]
        if not victims:
            return False
        victim = min(victims, key=lambda c: c.used)
        self.truncate(victim, 0)
        self.counters.preemptions += 1
        self.report("preemptions", 1)
        return True

    def _release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.held -= 1
            if block in self.hash_of:
                self.cached[block] = None  # stays findable until evicted
            else:
                heapq.heappush(self._free, block)

    def truncate(self, cache: PagedCache, length: int) -> None:
        """`cache` holds its first `length` positions; blocks past them go back."""
        with self.lock:
            cache.length = min(cache.length, length)
            keep = -(-cache.length // BLOCK)
            for block in cache.table[keep:]:
                self._release(block)
            del cache.table[keep:]
            del cache.chain[cache.length // BLOCK :]

    def drop(self, table: list[int]) -> None:
        """A dropped cache's blocks (its finalizer)."""
        with self.lock:
            for block in table:
                self._release(block)
            table.clear()

    def extend(self, cache: PagedCache, positions: int, busy: Sequence[PagedCache]) -> None:
        """Give `cache` blocks for its first `positions` positions."""
        while len(cache.table) * BLOCK < positions:
            cache.table.append(self.take(busy))

    def own_tail(self, cache: PagedCache, busy: Sequence[PagedCache]) -> None:
        """Before `cache` writes into its partly kept last block (a re-fed token after a rollback):
        if that block is published or shared, `cache` takes a copy of it (copy on write), so what
        other requests read never changes."""
        i = cache.length // BLOCK
        if cache.length % BLOCK == 0 or i >= len(cache.table):
            return
        old = cache.table[i]
        if self.refs[old] == 1 and old not in self.hash_of:
            return
        new = self.take(busy)
        for store in (self.keys, self.values):
            for layer, tensor in enumerate(store):
                if tensor.shape[0] <= new:
                    tensor = store[layer] = self._grown(tensor)
                tensor[new] = tensor[old]
        cache.table[i] = new
        self._release(old)

    def _grown(self, old: torch.Tensor, at_least: int = 0) -> torch.Tensor:
        size = max(self.blocks, FIRST_BLOCKS, int(old.shape[0] * self.growth), at_least)
        if self.max_blocks is not None:
            size = min(size, self.max_blocks)
        grown = old.new_zeros((size, *old.shape[1:]))
        grown[: old.shape[0]] = old
        self.generation += 1
        return grown

    # --- the prefix cache ---------------------------------------------------------------------------

    def root(self, salt: str) -> bytes:
        return hashlib.blake2b(salt.encode(), digest_size=16, person=b"cascade-kv").digest()

    @staticmethod
    def link(parent: bytes, tokens: Sequence[int]) -> bytes:
        """The chain hash of a block: its parent's and its own tokens (a block is found only after
        exactly the same tokens, under the same salt). Each token as 4 little-endian signed bytes, packed
        in one call: a request's first pass hashes every block of its prompt."""
        data = parent + struct.pack(f"<{len(tokens)}i", *tokens)
        return hashlib.blake2b(data, digest_size=16).digest()

    def attach(self, cache: PagedCache, tokens: Sequence[int], limit: int) -> int:
        """An empty `cache` takes the longest published chain of `tokens[:limit]`; returns its length
        in positions (a multiple of BLOCK, 0 on a miss)."""
        with self.lock:
            if cache.length:
                raise ValueError("attach: the cache already holds positions")
            parent = cache.root
            for start in range(0, limit - BLOCK + 1, BLOCK):
                digest = self.link(parent, tokens[start : start + BLOCK])
                block = self.index.get(digest)
                if block is None:
                    break
                if self.refs[block] == 0:
                    del self.cached[block]
                    self.held += 1
                self.refs[block] += 1
                cache.table.append(block)
                cache.chain.append(digest)
                parent = digest
            cache.length = len(cache.table) * BLOCK
            return cache.length

    def looked_up(self, queries: int, hits: int) -> None:
        """A request's lookup (`attach`, as often as it had to wait): `queries` tokens, `hits` found."""
        with self.lock:
            self.counters.queries += queries
            self.counters.hits += hits
        self.report("queries", queries)
        self.report("hits", hits)

    def claim(self, cache: PagedCache, tokens: Sequence[int], limit: int) -> Future | None:
        """Before `cache` computes the full blocks of `tokens[:limit]` past what it holds: if another
        request is computing the first of them now, its claim (wait for it, then `attach` again);
        else None, and these blocks are claimed by `cache` until `settle(cache)`."""
        with self.lock:
            parent = cache.chain[-1] if cache.chain else cache.root
            digests = []
            for start in range(cache.length, limit - BLOCK + 1, BLOCK):
                parent = self.link(parent, tokens[start : start + BLOCK])
                digests.append(parent)
            if not digests or cache.length % BLOCK:
                return None
            theirs = self.pending.get(digests[0])
            if theirs is not None:
                return theirs
            mine: Future = Future()
            for digest in digests:
                if digest not in self.index:
                    self.pending.setdefault(digest, mine)
            cache.claims = (mine, digests)
            return None

    def settle(self, cache: PagedCache) -> None:
        """`cache`'s prefill is over (done or failed): whoever waited on its claim looks again."""
        with self.lock:
            if cache.claims is None:
                return
            mine, digests = cache.claims
            for digest in digests:
                if self.pending.get(digest) is mine:
                    del self.pending[digest]
            cache.claims = None
        mine.set_result(None)

    def publish(self, cache: PagedCache, tokens: Sequence[int], stable: int) -> None:
        """Publish `cache`'s full blocks of committed tokens (`tokens[:stable]`, which `cache` holds)."""
        with self.lock:
            upto = min(stable, cache.length) // BLOCK
            while len(cache.chain) < upto:
                i = len(cache.chain)
                parent = cache.chain[-1] if cache.chain else cache.root
                digest = self.link(parent, tokens[i * BLOCK : (i + 1) * BLOCK])
                block = cache.table[i]
                if digest not in self.index and block not in self.hash_of:
                    self.index[digest] = block
                    self.hash_of[block] = digest
                cache.chain.append(digest)  # another request's copy may be the published one

    # --- storage ------------------------------------------------------------------------------------

    def window(self, blocks: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch for one layer's gathered keys and values, `blocks` blocks each ([blocks, BLOCK,
        kv_heads, head_dim], `like`'s dtype and device), reused by every layer of every pass (a pass
        holds `lock`, and a layer is done with them before the next gathers). A fresh tensor each
        layer cost its allocation each time: with torch's huge pages on (cascade_service/__init__.py)
        a 2 MB one is new pages, 548 us against 36 us to fill one kept (16 rows of 512 positions of
        the shipped family; docs/benchmarks.md "KV storage"). Grows by half again at
        a time, never shrinks: the most a pass of this model has needed (not counted in `nbytes`,
        which is the cache's)."""
        have = self._windows
        if (
            have is None
            or have[0].shape[0] < blocks
            or have[0].shape[1:] != like.shape[1:]  # a model whose layers differ in KV heads
            or have[0].dtype != like.dtype
            or have[0].device != like.device
        ):
            size = max(blocks, int(have[0].shape[0] * 1.5) if have is not None else 0)
            shape = (size, *like.shape[1:])
            have = self._windows = (like.new_empty(shape), like.new_empty(shape))
        return have[0][:blocks], have[1][:blocks]

    def reserve(self, layer: int, like: torch.Tensor, at_least: int = 0) -> None:
        """Make layer `layer` hold every block handed out so far, and `at_least` blocks (capped by the
        budget), shaped like `like` ([rows, kv_heads, new, head_dim]); growth keeps what is stored."""
        if self.max_blocks is not None and at_least > self.max_blocks:
            at_least = self.max_blocks  # the budget caps what is asked for
        if layer < len(self.keys) and self.keys[layer].shape[0] >= max(self.blocks, at_least):
            return  # the common case
        while len(self.keys) <= layer:
            self.keys.append(like.new_zeros((0, BLOCK, like.shape[1], like.shape[3])))
            self.values.append(like.new_zeros((0, BLOCK, like.shape[1], like.shape[3])))
        for store in (self.keys, self.values):
            store[layer] = self._grown(store[layer], at_least)


# The storages a model tier may name (config: `kv:`); config.base.KV_STORAGES is this one's keys.
STORAGES = {
    "pool": "one paged block pool per model with a prefix cache, read in place (this module)",
    "dynamic": "a DynamicCache per request, packed into one per batched pass (models.packed); no prefix cache",
}

# A request's KV cache as the scorer and the batcher hold it: a pool's, or its own (`kv: dynamic`),
# or an encoder-decoder model's (models.seq2seq.Seq2SeqCache).
KVCache = PagedCache | DynamicCache | EncoderDecoderCache


def _ignore(event: str, amount: int) -> None:
    pass
