"""Short requests beside one long one: what a long prompt and a long stream cost everybody else.

    python -m cascade_service.bench.long_request [--model DIR] [--short 16] [--long-prompt 3500] [--repeats 3]

Plain greedy decoding of one model with continuous batching, in this process. Three conditions,
alternated per repeat so machine drift hits them alike:
- alone: N short requests (a short prompt, `--short-tokens` new tokens each) start together;
- prefill: the same, starting just after one long request (`--long-prompt` tokens) was submitted,
  so they arrive while its prefill runs;
- decode: the same, starting once the long request streams, so they share passes with its decoding.
The long request streams until the short ones are done. Printed per condition: median and p90 of the
short requests' latencies (pooled over repeats), their ratio to `alone`, and the largest rise of this
process's resident memory during one run of the condition. End-of-sequence is ignored, so every
request decodes its full budget.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Self

import torch

from ..config import GenerationConfig, ModelTierConfig, make_cascade
from ..engine import Engine
from ..models.tiny import build_family, random_prompts
from ..paths import zoo_dir

CONDITIONS = ("alone", "prefill", "decode")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the demo zoo's large model if built, "
                                        "else the tiny random llama target)")
    parser.add_argument("--short", type=int, default=16, help="concurrent short requests")
    parser.add_argument("--short-prompt", type=int, default=32, help="tokens in each short prompt")
    parser.add_argument("--short-tokens", type=int, default=32, help="new tokens per short request")
    parser.add_argument("--long-prompt", type=int, default=3500, help="tokens in the long prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared CPU)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = _engine(args.model)
    limit = getattr(engine.target.config, "max_position_embeddings", None) or 2048
    if args.long_prompt + 16 > limit:
        parser.error(f"--long-prompt must leave room to stream below the model's {limit} positions")
    vocab = engine.target.vocab_size
    shorts = random_prompts(args.short, args.short_prompt, vocab, seed=1)
    long_prompt = random_prompts(1, args.long_prompt, vocab, seed=2)[0]
    bench = _Bench(engine, shorts, args.short_tokens, long_prompt, limit - args.long_prompt - 8)
    bench.shorts()  # warm-up: first passes at each batch size allocate
    latencies: dict[str, list[float]] = {c: [] for c in CONDITIONS}
    memory: dict[str, int] = dict.fromkeys(CONDITIONS, 0)
    for _ in range(args.repeats):
        for condition in CONDITIONS:
            with _PeakRss() as rss:
                latencies[condition] += bench.run(condition)
            memory[condition] = max(memory[condition], rss.rise)
    print(f"model {engine.target.name} ({engine.target.num_parameters / 1e6:.1f}M parameters), "
          f"{args.short} short requests ({args.short_prompt}-token prompts, {args.short_tokens} new tokens) "
          f"beside one {args.long_prompt}-token prompt; {args.repeats} repeats, {args.threads} torch threads")
    assert engine.target.batcher is not None
    print(f"passes by batch size: {dict(sorted(engine.target.batcher.batch_sizes.items()))}")
    base = statistics.median(latencies["alone"])
    for condition in CONDITIONS:
        lat = sorted(latencies[condition])
        median = statistics.median(lat)
        print(f"  {condition:<8} median {median:.3f} s  p90 {lat[int(0.9 * (len(lat) - 1))]:.3f} s  "
              f"x{median / base:.2f} of alone  peak RSS +{memory[condition] / 2**20:.0f} MiB")
    return 0


def _engine(path: str | None) -> Engine:
    if path is None:
        large = zoo_dir("demo") / "large"
        # The tiny family is built in seconds; its target allows 4096 positions like the zoo's.
        path = str(large if large.is_dir() else build_family(Path(tempfile.mkdtemp()) / "tiny")["target"])
    engine = Engine(make_cascade(ModelTierConfig("target", path), [], [], 1.0))
    engine.eos_ids = frozenset()  # every request decodes its whole budget: equal work per run
    engine.target.enable_batching()
    return engine


class _Bench:
    def __init__(self, engine: Engine, shorts: list[list[int]], short_tokens: int, long_prompt: list[int],
                 long_tokens: int):
        self.engine = engine
        self.short_prompts = shorts
        self.short_gen = GenerationConfig(max_new_tokens=short_tokens)
        self.long_prompt = long_prompt
        self.long_gen = GenerationConfig(max_new_tokens=long_tokens)

    def run(self, condition: str) -> list[float]:
        """The short requests' latencies under `condition` (see the module docstring)."""
        if condition == "alone":
            return self.shorts()
        submitted, streaming, done = threading.Event(), threading.Event(), threading.Event()

        def long_request() -> None:
            submitted.set()
            for _ in self.engine.stream(self.long_prompt, self.long_gen):
                streaming.set()
                if done.is_set():
                    break
            streaming.set()  # a stream that ended early must not hang the short requests

        thread = threading.Thread(target=long_request)
        thread.start()
        (submitted if condition == "prefill" else streaming).wait()
        time.sleep(0.02)  # the long request's pass is under way
        try:
            return self.shorts()
        finally:
            done.set()
            thread.join()

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


if __name__ == "__main__":
    raise SystemExit(main())
