"""The timing loop and the figures: every runner on the same prompts, interleaved, in one process.

Interleaving (for each repeat, for each prompt, for each runner) spreads machine drift over all
methods alike; each runner is warmed up once first. SWI is the paper's standardized walltime
improvement (§5): n / (target calls + sum_i drafter calls_i * cost_i), MaG at cost 0. Sampled, every
runner draws with the same seed for a (repeat, prompt), so each sees the same requests.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from ..core.stats import Usage, absorb
from .methods import PLAIN, REFERENCE, Method, Outcome, Runner, Sampling, drafted_label
from .zoo import Zoo

# The warm-up run's length: enough for first-call allocations and a drafted round or two; a full-length
# warm-up would double a benchmark of a real target (0.5-0.7 s a step on the 2-core host).
WARM_UP_TOKENS = 16


@dataclass
class Tally:
    """Counters summed over every timed run of one runner."""

    generated: int = 0
    target_calls: int = 0
    drafter_calls: dict[str, int] = field(default_factory=dict)
    accepted_by_position: dict[str, list[int]] = field(default_factory=dict)  # reviewer -> counts
    drafted_by_position: dict[str, list[int]] = field(default_factory=dict)
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)  # tier -> calls / drafted / accepted
    rows: Usage = field(default_factory=Usage)  # the reviewers' counters summed, for how each row ran
    orchestration_s: float = 0.0  # the engine loop's time outside model passes, summed
    drafted_rounds: int = 0  # target rounds whose block held a draft, summed

    def add(self, outcome: Outcome) -> None:
        absorb(self.rows, Usage(reviews=outcome.rows))
        self.orchestration_s += outcome.orchestration_s
        self.drafted_rounds += outcome.drafted_rounds
        self.generated += len(outcome.token_ids)
        self.target_calls += outcome.target_calls
        for name, counts in outcome.tiers.items():
            mine = self.tiers.setdefault(name, dict.fromkeys(counts, 0))
            for key, value in counts.items():
                mine[key] += value
        for name, calls in outcome.drafter_calls.items():
            self.drafter_calls[name] = self.drafter_calls.get(name, 0) + calls
        for name, (accepted, drafted) in outcome.reviews.items():
            _add_into(self.accepted_by_position.setdefault(name, []), accepted)
            _add_into(self.drafted_by_position.setdefault(name, []), drafted)

    def swi(self, costs: Mapping[str, float]) -> float:
        spent = self.target_calls + sum(calls * costs.get(name, 0.0) for name, calls in self.drafter_calls.items())
        return _ratio(self.generated, spent)

    def acceptance_by_position(self) -> dict[str, list[float]]:
        # A reviewer that never saw a draft (the target alone, `ar`) has no curve.
        return {
            name: [_ratio(a, d) for a, d in zip(self.accepted_by_position[name], drafted)]
            for name, drafted in self.drafted_by_position.items()
            if drafted
        }


@dataclass
class RunnerLog:
    times: list[list[float]] = field(default_factory=list)  # [repeat][prompt] seconds
    tokens: list[list[list[int]]] = field(default_factory=list)  # [repeat][prompt] generated ids
    # [repeat][prompt] (seconds to the first output, tokens that came with it): Outcome.first_token_s
    first: list[list[tuple[float, int]]] = field(default_factory=list)
    tally: Tally = field(default_factory=Tally)


def run_bench(
    zoo: Zoo,
    methods: Sequence[Method],
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    repeats: int,
    temperature: float = 0.0,
) -> dict[str, RunnerLog]:
    """Time every runner of every method; returns runner label -> log."""
    runners = [r for m in methods for r in m.variants]
    for runner in runners:  # warm-up: first-call allocations and lazy inits stay out of the timings
        runner.run(zoo, prompts[0], min(max_new_tokens, WARM_UP_TOKENS), Sampling(temperature, seed=2**62))
    logs = {r.label: RunnerLog() for r in runners}
    bar = tqdm(total=repeats * len(prompts), desc="bench", unit="prompt", file=sys.stderr, disable=None)
    for repeat in range(repeats):
        zoo.forget()  # suffix decoding learns across prompts within a repeat, never from a repeat before
        for log in logs.values():
            log.times.append([])
            log.tokens.append([])
            log.first.append([])
        for i, prompt in enumerate(prompts):
            sampling = Sampling(temperature, seed=repeat * len(prompts) + i)  # the seed matters only sampled
            for runner in runners:
                _timed(runner, zoo, prompt, max_new_tokens, sampling, logs[runner.label])
            bar.update()
    bar.close()
    return logs


def _timed(
    runner: Runner, zoo: Zoo, prompt: list[int], max_new_tokens: int, sampling: Sampling, log: RunnerLog
) -> None:
    began = time.perf_counter()
    outcome = runner.run(zoo, prompt, max_new_tokens, sampling)
    log.times[-1].append(time.perf_counter() - began)
    log.tokens[-1].append(outcome.token_ids)
    log.first[-1].append((outcome.first_token_s, outcome.first_tokens))
    log.tally.add(outcome)


def summarize(
    methods: Sequence[Method],
    logs: Mapping[str, RunnerLog],
    costs: Mapping[str, Mapping[str, float]],
    greedy: bool = True,
) -> dict[str, dict]:
    """results.json's "methods": per method the figures of its fastest variant (plus any sweep).
    Sampled (`greedy` False), outputs are not compared with hf-ar's (identical_to_hf_ar is None)."""
    reference = logs[REFERENCE].tokens[0] if greedy else None  # [prompt] hf-ar's tokens in the first repeat
    out: dict[str, dict] = {}
    for method in methods:
        variants = [(r, _figures(logs[r.label], reference, costs)) for r in method.variants]
        best_at = max(range(len(variants)), key=lambda i: variants[i][1]["tokens_per_s"])
        runner, figures = variants[best_at]
        figures = {**figures, "setup": runner.describe()}
        if method.sweep_k:
            figures["best_k"] = method.sweep_k[best_at]
            figures["sweep"] = {str(k): f for k, (_, f) in zip(method.sweep_k, variants)}
        # Labels come from the counters of the run, in the order the method named its tiers.
        order = {tier: i for i, tier in enumerate(method.name.partition(":")[2].partition("@")[0].split("+"))}
        ranked = dict(sorted(figures.get("tiers", {}).items(), key=lambda kv: order.get(kv[0], len(order))))
        figures["label"] = drafted_label(method.name, ranked)
        out[method.name] = figures
    for key in ("tokens_per_s", "decode_tokens_per_s"):
        base = out[REFERENCE][key]
        plain = out[PLAIN][key] if PLAIN in out else 0.0
        prefix = "" if key == "tokens_per_s" else "decode_"
        for figures in [*out.values(), *(f for m in out.values() for f in m.get("sweep", {}).values())]:
            figures[f"{prefix}speedup_vs_hf_ar"] = _ratio(figures[key], base)
            figures[f"{prefix}speedup_vs_ar"] = _ratio(figures[key], plain)
    return out


def _figures(log: RunnerLog, reference: list[list[int]] | None, costs: Mapping[str, Mapping[str, float]]) -> dict:
    tally, n = log.tally, log.tally.generated
    by_repeat = [_ratio(sum(map(len, toks)), sum(times)) for toks, times in zip(log.tokens, log.times)]
    decode_by_repeat = [_decode_rate(*run) for run in zip(log.tokens, log.times, log.first)]
    figures: dict[str, Any] = {
        "tokens_per_s": statistics.median(by_repeat),
        # Decoding apart from the prompt's read: tokens after the first output over the time after it
        # (each repeat's prompts summed; the median repeat), and the time to first token (median run).
        "decode_tokens_per_s": statistics.median(decode_by_repeat),
        "ttft_s": statistics.median(t for first in log.first for t, _ in first),
        "speedup_vs_hf_ar": 0.0,  # filled in once hf-ar's speed is known
        "speedup_vs_ar": 0.0,  # and ar's: plain decoding through our engine, at the same load
        "swi_params": tally.swi(costs.get("params", {})),
        "swi_measured": tally.swi(costs.get("measured", {})),
        "target_calls_per_token": _ratio(tally.target_calls, n),
        "mean_accepted_length": _ratio(n, tally.target_calls),
        # the engine's own time per target round (wall time outside model passes; 0 for transformers')
        "orchestration_per_round_ms": 1e3 * _ratio(tally.orchestration_s, tally.target_calls),
        # the share of target rounds that drafted (the rest were plain steps: the floor's doing, or a lookup's miss)
        "drafted_round_share": _ratio(tally.drafted_rounds, tally.target_calls),
        # Every repeat of every prompt, not just one: a flaky mismatch must not hide. None: sampled.
        "identical_to_hf_ar": None if reference is None else all(toks == reference for toks in log.tokens),
        "drafter_calls_per_token": {name: _ratio(calls, n) for name, calls in tally.drafter_calls.items()},
        "tiers": tally.tiers,  # per tier: calls, drafted and accepted tokens, summed over every run
        # per reviewer: how its K-matrix row ran, entry by entry (core.stats.ReviewCounters.row)
        "rows": {name: review.row() for name, review in tally.rows.reviews.items()},
        "tokens_per_s_by_repeat": by_repeat,
        "decode_tokens_per_s_by_repeat": decode_by_repeat,
        "per_prompt": _per_prompt(log, reference),
    }
    if acceptance := tally.acceptance_by_position():
        figures["acceptance_by_position"] = acceptance
    return figures


def _per_prompt(log: RunnerLog, reference: list[list[int]] | None) -> list[dict]:
    rows = []
    for i in range(len(log.tokens[0])):
        time_s = statistics.median(times[i] for times in log.times)
        tokens = statistics.median(len(toks[i]) for toks in log.tokens)
        same = None if reference is None else all(toks[i] == reference[i] for toks in log.tokens)
        rows.append(
            {
                "generated_tokens": tokens,
                "time_s": time_s,  # median over repeats
                "tokens_per_s": _ratio(tokens, time_s),
                "ttft_s": statistics.median(first[i][0] for first in log.first),
                "decode_tokens_per_s": statistics.median(
                    _decode_rate([toks[i]], [times[i]], [first[i]])
                    for toks, times, first in zip(log.tokens, log.times, log.first)
                ),
                "identical_to_hf_ar": same,
            }
        )
    return rows


def _decode_rate(tokens: Sequence[list[int]], times: Sequence[float], first: Sequence[tuple[float, int]]) -> float:
    """Tokens after each run's first output over the time after it, summed over the runs."""
    after = sum(len(toks) - n for toks, (_, n) in zip(tokens, first))
    return _ratio(after, sum(t - at for t, (at, _) in zip(times, first)))


def _add_into(total: list[int], counts: Sequence[int]) -> None:
    total.extend([0] * (len(counts) - len(total)))
    for i, c in enumerate(counts):
        total[i] += c


def _ratio(a: float, b: float) -> float:
    return float(a) / b if b else 0.0
