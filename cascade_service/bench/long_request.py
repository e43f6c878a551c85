"""Short requests beside one long one: what a long prompt and a long stream cost everybody else.

    cascade-service bench long-request [--model DIR] [--short 16] [--long-prompt 3500]
        [--prefill-chunks 0,64] [--turns fair,oldest] [--repeats 3]

Plain greedy decoding of one model with continuous batching, in this process. Three conditions,
alternated per repeat so machine drift hits them alike:
- alone: N short requests (a short prompt, `--short-tokens` new tokens each) start together;
- prefill: the same, starting just after one long request (`--long-prompt` tokens) was submitted,
  so they arrive while its prefill runs;
- decode: the same, starting once the long request streams, so they share passes with its decoding.
The long request streams until the short ones are done. Each prefill chunk size and each way of
taking turns (`ForwardBatcher.FAIR`: by model time had, or the oldest pass first) is a variant; within
a repeat the variants run one after another. Printed per variant and condition: median and p90 of the
short requests' latencies (pooled over repeats), the ratio of medians to `alone`, and the largest rise
of this process's resident memory during one run of the condition; per variant, the long request's
time to its first token alone and beside the short ones and its tokens per second while it streams
alone and beside them (medians). End-of-sequence is ignored, so
every request decodes its full budget.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import torch

from ..config import GenerationConfig, ModelTierConfig, make_cascade
from ..engine.core import queue_of
from ..inprocess import InProcess
from ..models.batching import PREFILL_CHUNK
from ..paths import zoo_dir
from ..zoo.tiny import build_family, random_prompts
from . import tools

CONDITIONS = ("alone", "prefill", "decode")
TURNS = {"fair": True, "oldest": False}  # --turns: ForwardBatcher.FAIR


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        help="model directory (default: the demo zoo's large model if built, else the tiny random llama target)",
    )
    parser.add_argument("--short", type=int, default=16, help="concurrent short requests")
    parser.add_argument("--short-prompt", type=int, default=32, help="tokens in each short prompt")
    parser.add_argument("--short-tokens", type=int, default=32, help="new tokens per short request")
    parser.add_argument("--long-prompt", type=int, default=3500, help="tokens in the long prompt")
    parser.add_argument(
        "--prefill-chunks",
        default=f"0,{PREFILL_CHUNK}",
        help="prefill chunk sizes compared side by side (0: a prompt in one pass)",
    )
    parser.add_argument(
        "--turns",
        default="fair",
        help="how passes that cannot share take turns, compared side by side: fair (by model "
        "time had), oldest (the oldest waiting pass first)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared CPU)")


def run(args: argparse.Namespace) -> int:
    chunks = [int(c) for c in args.prefill_chunks.split(",")]
    turns = args.turns.split(",")
    if unknown := set(turns) - set(TURNS):
        raise ValueError(f"--turns: unknown {sorted(unknown)}; choose from {sorted(TURNS)}")
    torch.set_num_threads(args.threads)
    engine = _engine(args.model)
    batcher = queue_of(engine.local_target())
    limit = getattr(engine.local_target().config, "max_position_embeddings", None) or 2048
    if args.long_prompt + 16 > limit:
        raise ValueError(f"--long-prompt must leave room to stream below the model's {limit} positions")
    vocab = engine.target.vocab_size
    shorts = random_prompts(args.short, args.short_prompt, vocab, seed=1)
    long_prompt = random_prompts(1, args.long_prompt, vocab, seed=2)[0]
    bench = _Bench(engine, shorts, args.short_tokens, long_prompt, limit - args.long_prompt - 8)
    bench.shorts()  # warm-up: first passes at each batch size allocate
    runs = {(c, t): _Variant() for c in chunks for t in turns}
    for _ in range(args.repeats):
        for (chunk, turn), variant in runs.items():  # variants alternate within each repeat: drift hits all alike
            batcher.prefill_chunk = chunk
            batcher.FAIR = TURNS[turn]
            before = Counter(batcher.batch_sizes)
            variant.first_token_alone.append(bench.long_first_token())
            for condition in CONDITIONS:
                with _PeakRss() as rss:
                    variant.latencies[condition] += bench.run(condition)
                variant.memory[condition] = max(variant.memory[condition], rss.rise)
            variant.first_token_beside.append(bench.last_first_token)
            variant.pace_alone.append(bench.long_pace[0])
            variant.pace_beside.append(bench.long_pace[1])
            variant.passes += Counter(batcher.batch_sizes) - before
    print(
        f"model {engine.target.name} ({engine.target.num_parameters / 1e6:.1f}M parameters), "
        f"{args.short} short requests ({args.short_prompt}-token prompts, {args.short_tokens} new tokens) "
        f"beside one {args.long_prompt}-token prompt; {args.repeats} repeats, {args.threads} torch threads"
    )
    for (chunk, turn), variant in runs.items():
        variant.report(f"prefill chunk {chunk or 'off'}, turns {turn}")
    return 0


@dataclass
class _Variant:
    latencies: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in CONDITIONS})
    memory: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CONDITIONS, 0))
    first_token_alone: list[float] = field(default_factory=list)
    first_token_beside: list[float] = field(default_factory=list)
    pace_alone: list[float] = field(default_factory=list)  # the long request's tokens/s while it streams
    pace_beside: list[float] = field(default_factory=list)
    passes: Counter = field(default_factory=Counter)

    def report(self, name: str) -> None:
        print(
            f"{name}: the long prompt's first token after {statistics.median(self.first_token_alone):.2f} s alone, "
            f"{statistics.median(self.first_token_beside):.2f} s beside the short requests; its stream "
            f"{statistics.median(self.pace_alone):.1f} tokens/s alone, {statistics.median(self.pace_beside):.1f} "
            f"beside them; passes by batch size {dict(sorted(self.passes.items()))}"
        )
        base = statistics.median(self.latencies["alone"])
        for condition in CONDITIONS:
            lat = sorted(self.latencies[condition])
            median = statistics.median(lat)
            print(
                f"  {condition:<8} median {median:.3f} s  p90 {lat[int(0.9 * (len(lat) - 1))]:.3f} s  "
                f"x{median / base:.2f} of alone  peak RSS +{self.memory[condition] / 2**20:.0f} MiB"
            )


def _engine(path: str | None) -> InProcess:
    if path is None:
        large = zoo_dir("demo") / "large"
        # The tiny family is built in seconds; its target allows 4096 positions like the zoo's.
        path = str(large if large.is_dir() else build_family(Path(tempfile.mkdtemp()) / "tiny")["target"])
    engine = InProcess(make_cascade(ModelTierConfig("target", path), [], [], 1.0))
    engine.eos_ids = frozenset()  # every request decodes its whole budget: equal work per run
    return engine


def _rate(times: list[float], start: float, end: float) -> float:
    """Tokens per second among `times` within [start, end)."""
    return sum(start <= t < end for t in times) / (end - start) if end > start else 0.0


class _Bench:
    PACE_S = 0.5  # how long the long request streams alone before the short requests come

    def __init__(
        self, engine: InProcess, shorts: list[list[int]], short_tokens: int, long_prompt: list[int], long_tokens: int
    ):
        self.engine = engine
        self.short_prompts = shorts
        self.short_gen = GenerationConfig(max_new_tokens=short_tokens)
        self.long_prompt = long_prompt
        self.long_gen = GenerationConfig(max_new_tokens=long_tokens)
        self.last_first_token = 0.0  # of the long request, in the last "prefill" run
        self.long_pace = (0.0, 0.0)  # its tokens per second alone and beside, in the last "decode" run

    def run(self, condition: str) -> list[float]:
        """The short requests' latencies under `condition` (see the module docstring)."""
        if condition == "alone":
            return self.shorts()
        submitted, streaming, done = threading.Event(), threading.Event(), threading.Event()
        times: list[float] = []  # when each of the long request's tokens came

        def long_request() -> None:
            submitted.set()
            began = time.perf_counter()
            for _ in self.engine.stream(self.long_prompt, self.long_gen):
                times.append(time.perf_counter())
                if not streaming.is_set() and condition == "prefill":
                    self.last_first_token = times[-1] - began
                streaming.set()
                if done.is_set():
                    break
            streaming.set()  # a stream that ended early must not hang the short requests

        thread = threading.Thread(target=long_request)
        thread.start()
        (submitted if condition == "prefill" else streaming).wait()
        # The long request's pass is under way; while it streams, its pace alone is measured first.
        time.sleep(0.02 if condition == "prefill" else self.PACE_S)
        began = time.perf_counter()
        try:
            return self.shorts()
        finally:
            ended = time.perf_counter()
            done.set()
            thread.join()
            if condition == "decode":
                self.long_pace = (_rate(times, times[0], began), _rate(times, began, ended))

    def long_first_token(self) -> float:
        """Seconds to the long request's first token with nothing beside it."""
        began = time.perf_counter()
        next(iter(self.engine.stream(self.long_prompt, GenerationConfig(max_new_tokens=1))))
        return time.perf_counter() - began

    def shorts(self) -> list[float]:
        latencies = [0.0] * len(self.short_prompts)
        start = threading.Barrier(len(self.short_prompts))

        def short_request(i: int) -> None:
            start.wait()
            began = time.perf_counter()
            self.engine.generate(self.short_prompts[i], self.short_gen)
            latencies[i] = time.perf_counter() - began

        threads = [threading.Thread(target=short_request, args=(i,)) for i in range(len(self.short_prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return latencies


class _PeakRss:
    """The largest rise of this process's resident memory while the block runs (sampled every 10 ms)."""

    def __enter__(self) -> Self:
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.rise = self.peak - self.start

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss())


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # resident pages


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cascade_service.bench.long_request`: the same as `cascade-service bench long-request`."""
    return tools.main("long_request", argv, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
