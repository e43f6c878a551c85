"""What a zoo's report says about its family, measured on code the zoo never trained on.

The evaluation source is the Python source of a few packages every install of this project has (its own
dependencies' dependencies), so it exists on any machine that can build the zoo, and the zoo's corpus
(the standard library) never contains it. Benchmarks and the demo read their prompts from it; tuning
reads its prompts from held-out standard-library modules, so a schedule is never tuned on the prompts
it is judged on.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast

from cascade_service.models.hf import HFModel
from cascade_service.zoo import train
from cascade_service.zoo.judged import EVAL_PACKAGES, distribution_version, eval_package_files
from cascade_service.zoo.tiny import greedy_tokens

__all__ = ["EVAL_PACKAGES", "eval_package_files"]  # defined with the rest of the judged code (zoo/judged.py)

CONTEXT_WINDOW = 1024  # positions of the windows loss and agreement are counted by position in
LOOP_WINDOW, LOOP_GRAM, LOOP_REPEATS = 32, 4, 4  # "ends in a loop": see ends_in_loop


def eval_source_versions(packages: Sequence[str]) -> dict[str, str]:
    """Import name -> the version of the distribution that provides it (markdown_it: markdown-it-py's;
    a distribution's name is not always its import name), "unknown" where no metadata names it."""
    provided = importlib.metadata.packages_distributions()
    return {name: distribution_version(name, provided) for name in packages}


def ends_in_loop(tokens: Sequence[int]) -> bool:
    """True when some 4-gram occurs 4 or more times in the last 32 tokens: the continuation has fallen
    into a cycle (``'name', 'name', 'name', ...``) rather than writing code."""
    tail = list(tokens[-LOOP_WINDOW:])
    grams = Counter(tuple(tail[i : i + LOOP_GRAM]) for i in range(len(tail) - LOOP_GRAM + 1))
    return bool(grams) and max(grams.values()) >= LOOP_REPEATS


def windows(stream: torch.Tensor, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens spread evenly over `stream`."""
    stride = max(1, (stream.numel() - length) // count)
    return [stream[i * stride : i * stride + length].tolist() for i in range(count)]


def evaluate_family(
    paths: dict[str, Path],
    tiers: Sequence[str],
    tokenizer: PreTrainedTokenizerFast,
    held: dict[str, torch.Tensor],
    prompts: Sequence[str],
    *,
    steps: int,
    window_count: int,
    window_len: int,
    thread_count: int,
    chars_per_token: dict[str, float],
) -> dict:
    """Per tier: size, decode step cost (absolute and relative to the first tier), greedy agreement with
    the first tier on `prompts`, and teacher-forced loss and agreement on windows of each `held` stream;
    for the first tier also how many of its greedy continuations end in a loop, with a few samples."""
    loaded = {name: HFModel.load(paths[name], name=name) for name in tiers}
    target_name = tiers[0]
    target, drafters = loaded[target_name], {n: loaded[n] for n in tiers[1:]}
    steps_ms = {n: train.step_times_ms(loaded, n) for n in (1, 2)}  # threads -> tier -> ms
    passes_ms = {n: train.pass_times_ms(target, n) for n in (1, 2)}  # threads -> [1..9 tokens] -> ms
    prompt_ids = [tokenizer(p).input_ids for p in prompts]
    with train.threads(thread_count):
        continuations = [greedy_tokens(target, ids, steps) for ids in prompt_ids]
        greedy = train.greedy_agreement(drafters, prompt_ids, continuations)
        forced = {
            source: train.teacher_forced(target, loaded, windows(s, window_count, window_len))
            for source, s in held.items()
        }
        # The same sources in windows as long as the service's contexts, counted by position.
        long = {source: windows(s, max(1, window_count // 4), CONTEXT_WINDOW) for source, s in held.items()}
        by_context = {source: train.by_context(target, loaded, w) for source, w in long.items() if w and w[0]}
    report: dict = {"tiers": {}}
    for name, model in loaded.items():
        report["tiers"][name] = {
            "params": model.num_parameters,
            "step_ms": {f"threads_{n}": steps_ms[n][name] for n in steps_ms},
            "step_ratio": {f"threads_{n}": round(steps_ms[n][name] / steps_ms[n][target_name], 3) for n in steps_ms},
            "greedy_agreement": greedy.get(name, 1.0),
            **{
                f"{source}_{key}": value for source, per_tier in forced.items() for key, value in per_tier[name].items()
            },
            **{
                f"{source}_bits_per_char": round(per_tier[name]["loss"] / math.log(2) / chars_per_token[source], 4)
                for source, per_tier in forced.items()
            },
        }
    report["tiers"][target_name]["pass_ms"] = {f"threads_{n}": ms for n, ms in passes_ms.items()}
    report["by_context"] = {"window": CONTEXT_WINDOW, "sources": by_context}
    looped = [ends_in_loop(c) for c in continuations]
    report["loops"] = {
        "continuations": len(continuations),
        "tokens": steps,
        "ending_in_a_loop": sum(looped),
        "rate": round(sum(looped) / max(1, len(looped)), 4),
        "samples": [tokenizer.decode(c, skip_special_tokens=True) for c in continuations[:3]],
    }
    return report


def format_report(report: dict) -> str:
    """A few lines for a terminal: one row per tier, the loop rate, then the build time."""
    sources = report["evaluation"]["sources"]
    rows = [
        f"zoo {report['preset']}: {report['corpus']['tokens']:,} corpus tokens, vocab {report['vocab_size']}, "
        f"trained on {report['training']['tokens']:,} tokens at {report['training']['tokens_per_s']:,.0f} tok/s",
        f"{'tier':6} {'params':>8} {'step ms 1t/2t':>14} {'ratio 1t/2t':>12} {'greedy':>7} "
        + " ".join(f"{s + ' loss':>14}" for s in sources),
    ]
    for name, t in report["tiers"].items():
        ms, ratio = t["step_ms"], t["step_ratio"]
        rows.append(
            f"{name:6} {t['params'] / 1e6:7.2f}M {ms['threads_1']:6.2f}/{ms['threads_2']:<7.2f} "
            f"{ratio['threads_1']:5.2f}/{ratio['threads_2']:<6.2f} {t['greedy_agreement']:7.3f} "
            + " ".join(f"{t[s + '_loss']:14.3f}" for s in sources)
        )
    target = next(iter(report["tiers"].values()))
    if "pass_ms" in target:  # what a review of k drafts costs the target: a pass over k + 1 tokens
        passes = target["pass_ms"]["threads_2"]
        rows.append(
            "target's pass over 1..9 new tokens, 2 threads: "
            + ", ".join(f"{ms:.2f}" for ms in passes)
            + f" ms ({passes[-1] / passes[0]:.2f}x a step at 9)"
        )
    rows += context_rows(report)
    loops = report["loops"]
    rows.append(
        f"large's greedy continuations ending in a loop: {loops['ending_in_a_loop']}/{loops['continuations']} "
        f"({loops['tokens']} tokens each, prompts from {', '.join(report['evaluation']['packages'])})"
    )
    rows.append("build s: " + ", ".join(f"{k} {v:.1f}" for k, v in report["build_s"].items()))
    return "\n".join(rows)


def context_rows(report: dict) -> list[str]:
    """One line per source and tier: loss and agreement by position in the report's long windows."""
    rows = []
    for source, per_tier in report.get("by_context", {}).get("sources", {}).items():
        for name, spans in per_tier.items():
            shown = ", ".join(f"{span} {v['loss']:.2f}/{v['agreement']:.2f}" for span, v in spans.items())
            rows.append(f"{name} on {source} by position (loss/agreement): {shown}")
    return rows


def encode_files(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str], progress: bool = True) -> torch.Tensor:
    """All texts as one token stream, each followed by EOS: [N] int64."""
    ids: list[int] = []
    chunk = 32
    for start in tqdm(range(0, len(texts), chunk), desc="tokenize corpus", unit="chunk", disable=not progress):
        for enc in tokenizer.backend_tokenizer.encode_batch(list(texts[start : start + chunk])):
            ids.extend(enc.ids)
            ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.int64)


def evaluate_sources(
    paths: dict[str, Path],
    tiers: Sequence[str],
    tokenizer: PreTrainedTokenizerFast,
    sources: dict[str, list[str]],
    prompts: list[str],
    steps: int,
    windows: int,
    window_len: int = 256,
    threads: int = 2,
) -> dict:
    """`evaluate_family` on named sources of text: each encoded once, losses per token and per character."""
    streams = {name: encode_files(tokenizer, texts, progress=False) for name, texts in sources.items()}
    return evaluate_family(
        paths,
        tiers,
        tokenizer,
        streams,
        prompts,
        steps=steps,
        window_count=windows,
        window_len=window_len,
        thread_count=threads,
        chars_per_token={name: sum(map(len, sources[name])) / max(1, streams[name].numel()) for name in sources},
    )
