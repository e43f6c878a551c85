"""Where a request's tensors live and how they move between tiers: the one rule (ARCHITECTURE invariant 6).

Each tier computes on its own device in its own dtype. What crosses between tiers are probabilities: a
draft block's rows ([k, V], the proposal distribution of each drafted token) and a verdict's rows for
the reviewer one level up. The rule:

1. Review math runs where the reviewer's `target_probs` are, in float32 (`PROBS_DTYPE`). Logits of any
   dtype become float32 probabilities on their own device (`core.sampling.SamplingParams.probs`), and
   a block's draft rows are moved there once, just before the review (`to_reviewer`). That is the only
   move between devices inside a process: a block joined from drafters on several devices keeps the
   device of its first rows until its review (`join_rows`), and rows leaving a process go as float32
   on the CPU (`to_host`), the wire's form.
2. Tensors made inside core take their device from the operands they meet (`device=like.device`).
   MaG's point masses are made on the CPU: MaG has no device, and its rows move with the block.
3. Reading a review's decision on the host: once per review, every value it needs (`host_reads`).
4. Randomness. A lossless sampled request draws by position (`keyed_exponentials`): the noise at
   sequence position t is a function of (the request's seed, t) alone, drawn on the sampled tensor's
   device with a generator seeded from that pair, so every tier and every round that looks at
   position t sees the same noise (core.sampling `race`). Other draws (lossy final rules, the inner
   reviews of a lossy request) come from the request's CPU generator (seeded once per request).
   torch draws from a tensor only with a generator on the tensor's device, so a draw for a tensor
   elsewhere uses the request's generator on that device: made the first time the request draws
   there, seeded from the request's generator, and kept on it (`RequestGenerator`, `generator_for`).
   On the CPU the request's generator is used as it is, so CPU outputs for a seed do not depend on
   this rule.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

PROBS_DTYPE = torch.float32  # every probability a review reads or a tier passes on


def to_reviewer(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Draft rows [k, V] on the device of the reviewer's `like` (its target_probs), in float32."""
    return rows.to(device=like.device, dtype=PROBS_DTYPE)


def join_rows(head: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """[a, V] then [b, V] -> [a + b, V] on head's device; an empty part passes the other through.

    A block starts empty on the CPU and is extended by drafters that may each sit elsewhere; the
    rows move to the reviewer's device only at the review (`to_reviewer`), so an empty start must
    not pull the first drafter's rows back to the CPU.
    """
    if not len(tail):
        return head
    if not len(head):
        return tail
    return torch.cat([head, tail.to(device=head.device, dtype=head.dtype)])


def to_host(rows: torch.Tensor) -> torch.Tensor:
    """Rows leaving this process (a tier's reply, a coordinator's message): float32 on the CPU.

    The receiver may have no GPU at all, and numpy (the wire's array type) holds neither GPU memory
    nor bfloat16.
    """
    return rows.detach().to(device="cpu", dtype=PROBS_DTYPE)


class RequestGenerator(torch.Generator):
    """A request's CPU generator, which keeps the request's generators on other devices with it (they
    live and die with the request's). Not a weak-keyed table beside it: torch's Generator accepts
    weak references only from 2.13 on, and the GPU images we run on have 2.11, where every sampled
    draw on a cuda tensor failed with a TypeError (the first GPU check, 2026-11-27)."""

    __slots__ = ("elsewhere",)
    elsewhere: dict[torch.device, torch.Generator]


def request_generator(seed: int) -> RequestGenerator:
    """A request's generator, seeded (its draws move to a sampled tensor's device: `generator_for`)."""
    gen = RequestGenerator()
    gen.manual_seed(seed)
    gen.elsewhere = {}
    return gen


def generator_for(source: torch.Generator, device: torch.device) -> torch.Generator:
    """A generator for drawing from a tensor on `device`: `source` itself when it lives there, else the
    request's generator on `device`, made on its first draw there, seeded from `source` (one draw from
    it), and kept on a `RequestGenerator`: a round draws on the device without making a generator
    (CUDA's Philox streams under distinct seeds are independent, so a request's draws stay independent
    of other requests'). Any other generator gets a fresh one per call, seeded the same way. A
    request's draws come from one thread at a time (its decode), so no lock is taken.
    """
    if source.device == device:
        return source
    elsewhere: dict[torch.device, torch.Generator] | None = getattr(source, "elsewhere", None)
    found = elsewhere.get(device) if elsewhere is not None else None
    if found is None:
        seed = int(torch.randint(0, 2**62, (1,), generator=source, device=source.device))
        found = torch.Generator(device=device).manual_seed(seed)
        if elsewhere is not None:
            elsewhere[device] = found
    return found


def uniform(shape: tuple[int, ...], like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """U[0, 1) draws of `shape` on `like`'s device (acceptance tests compare them with ratios there)."""
    return torch.rand(shape, generator=generator_for(generator, like.device), device=like.device)


def host_reads(probs: torch.Tensor, tokens: list[int]) -> tuple[list[int], list[float], list[float]]:
    """What a greedy review decides on, read to the host at once: each row's argmax and its probability
    ([n] each, of `probs`'s [n, V]) and probs[i, tokens[i]] for each of `tokens` (at most n of them).

    On a GPU: one device-to-host copy. On the CPU the rows are read through numpy's view of them, with
    no copy: torch's argmax over a few rows of a 4,096-token vocabulary costs ~40 us on a CPU, numpy's
    ~2 us, and a review is on every round's critical path. Both take the first of equal maxima.
    """
    n, rows = len(tokens), len(probs)
    if probs.device.type == "cpu" and probs.dtype == PROBS_DTYPE:
        return _numpy_reads(probs.numpy(), tokens)
    top = probs.max(dim=-1)
    parts = [top.indices.to(PROBS_DTYPE), top.values.to(PROBS_DTYPE)]  # token ids are exact in float32
    if n:
        parts.append(probs[torch.arange(n, device=probs.device), torch.tensor(tokens, device=probs.device)])
    read = torch.cat(parts).tolist()
    return [int(t) for t in read[:rows]], read[rows : 2 * rows], read[2 * rows :]


def host_race(
    probs: torch.Tensor, noise: torch.Tensor, tokens: Sequence[int]
) -> tuple[list[int], list[float], list[float]]:
    """`host_reads` of the race scores probs / noise ([n, V] each, on one device): each row's winner, its
    score and the score of each of `tokens`. On the CPU (float32) the division runs in numpy over the
    tensors' own memory: the same IEEE quotients as torch's, without a slice and a division op that
    run cold after a forward pass (core.sampling `race`, review.KeyedReview)."""
    if probs.device.type == "cpu" and probs.dtype == PROBS_DTYPE and noise.dtype == PROBS_DTYPE:
        return _numpy_reads(probs.numpy() / noise.numpy(), tokens)
    return host_reads(probs / noise, list(tokens))


def _numpy_reads(host: Any, tokens: Sequence[int]) -> tuple[list[int], list[float], list[float]]:
    """`host_reads` of a CPU array [n, V]: each row's argmax (the first of equal maxima, as torch's), its
    value, and host[i, tokens[i]], by element reads (cheaper than index arrays for a handful)."""
    best = host.argmax(-1).tolist()
    return best, [host.item(i, t) for i, t in enumerate(best)], [host.item(i, t) for i, t in enumerate(tokens)]


def host_at(rows: torch.Tensor, tokens: Sequence[int]) -> list[float]:
    """rows[i, tokens[i]] for each of `tokens` (at most len(rows)), read to the host: on the CPU (float32)
    by element reads of numpy's view, as `host_reads` does, where an index tensor and a gather took ~10 us
    on every sampled round for a few floats; elsewhere one gather and one copy. The same floats either way."""
    if rows.device.type == "cpu" and rows.dtype == PROBS_DTYPE:
        host = rows.numpy()
        return [host.item(i, t) for i, t in enumerate(tokens)]
    return rows[torch.arange(len(tokens), device=rows.device), list(tokens)].tolist()


def host_argmax(rows: torch.Tensor) -> list[int]:
    """Each of `rows`' ([n, V]) argmax, read to the host (the first of equal maxima, as `host_reads`):
    on the CPU through numpy's view of float32 rows, no copy; on a GPU, n ids in one copy."""
    if rows.device.type == "cpu" and rows.dtype == PROBS_DTYPE:
        return rows.numpy().argmax(-1).tolist()
    return rows.argmax(dim=-1).tolist()


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / phi, splitmix64's increment


def _mix64(z: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit words in which every input bit moves every output bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def position_key(seed: int, position: int) -> int:
    """The seed of the draws at sequence `position` of a request seeded `seed` (63 bits, as torch's
    manual_seed takes them): distinct (seed, position) pairs give unrelated streams, so the noise at
    one position says nothing of another's, nor of another request's."""
    return _mix64((_mix64(seed & _MASK64) + _GOLDEN * (position + 1)) & _MASK64) >> 1


class _KeyedGenerators(threading.local):
    """One generator per device and thread, re-seeded for every position (a seed is host state only:
    setting it launches nothing and waits for nothing on a GPU), and the rows it drew last.

    A position's noise is drawn again and again: a drafter races position t, then its reviewer races
    the same t, and a block cut short is drafted again from its first rejected position. The noise is a
    function of (seed, position, device, V) alone, so a row drawn once is kept (`NOISE_CACHE_BYTES` of
    them a thread, every device's together, the oldest dropped first) and handed out again: on this host a row drawn
    cold after a forward pass cost ~50 us at 2,048 tokens and ~0.5-0.7 ms at Qwen2.5's 151,936."""

    def __init__(self) -> None:
        self.by_device: dict[torch.device, torch.Generator] = {}
        self.rows: dict[tuple[torch.device, int, int], torch.Tensor] = {}  # insertion order: oldest first

    def on(self, device: torch.device) -> torch.Generator:
        found = self.by_device.get(device)
        if found is None:
            found = self.by_device[device] = torch.Generator(device=device)
        return found

    def row(self, device: torch.device, vocab: int, seed: int, position: int) -> torch.Tensor:
        """Position `position`'s Exp(1) noise, [V] (read only: it may be handed out again)."""
        # Keyed by what the draws are a function of: the generator's seed, not (seed, position) itself
        key = (device, vocab, position_key(seed, position))
        found = self.rows.get(key)
        if found is not None:
            return found
        gen = self.on(device)
        gen.manual_seed(key[2])
        found = torch.empty(vocab, dtype=PROBS_DTYPE, device=device).uniform_(generator=gen).log_().neg_()
        keep = max(NOISE_CACHE_MIN_ROWS, NOISE_CACHE_BYTES // (4 * vocab))
        while len(self.rows) >= keep:
            del self.rows[next(iter(self.rows))]
        self.rows[key] = found
        return found


# What each thread keeps of the noise rows it drew, every device's together (`_KeyedGenerators`): a block's rows
# and its reviewer's, a few rounds back, at any vocabulary (16 MiB is 27 rows of Qwen2.5's).
NOISE_CACHE_BYTES = 16 << 20
NOISE_CACHE_MIN_ROWS = 16

_KEYED = _KeyedGenerators()


def keyed_exponentials(rows: int, like: torch.Tensor, seed: int, start: int) -> torch.Tensor:
    """[rows, V] Exp(1) noise on `like`'s device (V = like's last dimension): row i is the noise of
    sequence position start + i, a function of (seed, start + i) and the device's kind alone. Read
    only: the rows are kept and handed out again (`_KeyedGenerators`).

    -log U with U ~ U[0, 1): U = 0 gives +inf (a token that then never wins), U < 1 gives a positive
    finite value, so p / E is never NaN. Tiers on devices of different kinds (a CPU drafter, a CUDA
    target) draw different noise for a position: the output stays exact, its drafts agree less.
    """
    vocab, device = like.shape[-1], like.device
    if rows == 1:
        return _KEYED.row(device, vocab, seed, start)[None]
    return torch.stack([_KEYED.row(device, vocab, seed, start + i) for i in range(rows)])
