"""A family with a real deployment's cost shape, made in minutes from a trained one: the target grown.

A compute-optimal family for a CPU hour has a small target, whose decode step is mostly interpreter
overhead, so its drafters cost a large share of it (the shipped family: 0.1-0.3). Real targets cost
arithmetic and memory traffic, and their drafters a few percent of that. Here the trained family's
large model is grown function-preservingly (zoo/grow.py: wider, with more heads, MLP units and
layers, all new output weights at zero) to tens of millions of parameters, trained further briefly
on the same corpus, and its drafters (the family's own base and small) are distilled against it, so
that they agree with it as a real family's small models agree with their large one. It is a
growth-initialised model, not one trained from scratch at that size: its quality is the source's
plus what the short training adds; its cost is a model of its size.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from cascade_service.zoo import train
from cascade_service.zoo.build import built_with
from cascade_service.zoo.evaluate import encode_files, eval_package_files, evaluate_sources, format_report
from cascade_service.zoo.grow import Growth, grow

TIERS = ("large", "base", "small")


@dataclass(frozen=True)
class GrownSpec:
    """Everything that determines a grown family (the cache key, with the source's manifest)."""

    name: str
    source: str  # the family it grows from: a shipped one, or a zoo preset built here
    growth: Growth
    schedule: train.Schedule  # the grown target's further training; drafters distilled alongside and after
    seed: int = 0
    eval_prompts: int = 24
    eval_steps: int = 64
    eval_windows: int = 16


GROWN_PRESETS = {
    # From the shipped family (quality: hidden 192, 6 heads of 32, 8 layers): 27M parameters.
    "grown": GrownSpec(
        name="grown",
        source="quality",
        growth=Growth(hidden=384, heads=12, kv_heads=4, intermediate=1024, layers=16),
        schedule=train.Schedule(
            batch=8, seq_len=256, lm_steps=60, distill_steps=60, lm_lr=6e-4, drafter_lr=1e-3, embed_lr=6e-4
        ),
    ),
    # CI: from the test zoo, seconds.
    "grown-test": GrownSpec(
        name="grown-test",
        source="test",
        growth=Growth(hidden=128, heads=8, kv_heads=4, intermediate=352, layers=4),
        schedule=train.Schedule(
            batch=4, seq_len=64, lm_steps=6, distill_steps=6, lm_lr=1e-3, drafter_lr=1e-3, embed_lr=1e-3, threads=1
        ),
        eval_prompts=2,
        eval_steps=8,
        eval_windows=2,
    ),
}


def build_grown(preset: str, out_dir: str | Path, source: dict[str, Path], progress: bool = True) -> dict[str, Path]:
    """Build (or reuse) the grown family of a GROWN_PRESETS preset in `out_dir` from `source`, the paths
    of the family its spec names (`zoo.families.family(preset)` finds them and calls this)."""
    if preset not in GROWN_PRESETS:
        raise ValueError(f"unknown grown preset {preset!r}; expected one of {sorted(GROWN_PRESETS)}")
    spec = GROWN_PRESETS[preset]
    source_report = json.loads(source["report"].read_text())
    out = Path(out_dir).expanduser()
    return derived(spec, source, out, lambda paths: _build(spec, source, source_report, paths, progress), progress)


def derived(
    spec, source: dict[str, Path], out: Path, make: Callable[[dict[str, Path]], dict], progress: bool = True
) -> dict[str, Path]:
    """A family made from `source` by `spec` in `out`: reused when `out` holds one made by the same spec
    from the same weights, else made by `make` (which writes the tiers and returns the report)."""
    paths = {name: out / name for name in TIERS} | {
        key: out / source[key].name for key in ("bigram", "prompts", "tune_prompts", "report")
    }
    stamp = {"spec": asdict(spec), "source": _fingerprint(source)} | built_with()
    marker = out / "zoo.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return paths
    marker.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    report = make(paths)
    paths["report"].write_text(json.dumps(report, indent=1) + "\n")
    if progress:
        print(format_report(report), file=sys.stderr)
    marker.write_text(json.dumps(stamp, indent=1))  # last: a half-built family is never reused
    return paths


def _build(spec: GrownSpec, source: dict[str, Path], source_report: dict, paths: dict[str, Path], progress: bool):
    from cascade_service.zoo.build import held_out_modules, read_text_file, save_model, training_texts

    began = time.perf_counter()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(source["large"]), local_files_only=True)
    texts = training_texts(source_report["spec"]["corpus_chars"], progress)
    stream = encode_files(tokenizer, texts, progress)  # the source's corpus, as it was tokenized
    family = {name: LlamaForCausalLM.from_pretrained(str(source[name])) for name in TIERS}
    family["large"] = grow(family["large"], spec.growth, spec.seed)
    with train.threads(spec.schedule.threads):
        logs = train.train_family(
            family["large"], {n: family[n] for n in TIERS[1:]}, stream, spec.schedule, spec.seed, progress
        )
    for name, module in family.items():
        save_model(module, tokenizer, paths[name])
    for key in ("bigram", "prompts", "tune_prompts"):
        paths[key].write_bytes(source[key].read_bytes())
    trained = time.perf_counter()
    prompts = [json.loads(line)["prompt"] for line in paths["prompts"].read_text().splitlines() if line.strip()]
    external = [read_text_file(p) for files in eval_package_files().values() for p in files]
    held = [read_text_file(p) for p in held_out_modules()]
    evaluation = evaluate_sources(
        paths,
        TIERS,
        tokenizer,
        {"heldout": held, "external": external},
        prompts[: spec.eval_prompts],
        steps=spec.eval_steps,
        windows=spec.eval_windows,
        window_len=spec.schedule.seq_len,
        threads=spec.schedule.threads,
    )
    for name, log in logs.items():
        evaluation["tiers"][name]["train"] = log.summary()
    large = logs["large"]
    return {
        "preset": spec.name,
        "spec": asdict(spec),
        "grown_from": {
            "family": spec.source,
            "preset": source_report["preset"],
            "shape": source_report["spec"]["large"],
        },
        "build_s": {"train": round(trained - began, 2), "evaluate": round(time.perf_counter() - trained, 2)},
        "corpus": {"files": len(texts), "tokens": int(stream.numel())},
        "vocab_size": len(tokenizer),
        "training": {
            "tokens": large.tokens,
            "tokens_per_s": round(large.tokens / max(1e-9, large.seconds), 1),
        },
        "evaluation": {
            "sources": ["heldout", "external"],
            "packages": source_report["evaluation"]["packages"],
            "prompts": spec.eval_prompts,
            "greedy_steps": spec.eval_steps,
            "windows": spec.eval_windows,
            "window_tokens": spec.schedule.seq_len,
        },
        **evaluation,
    }


def _fingerprint(source: dict[str, Path]) -> dict[str, str]:
    """The source family's weights, by SHA-256 of each tier's safetensors file."""
    from cascade_service.zoo.shipped import sha256

    return {name: sha256(source[name] / "model.safetensors") for name in TIERS}
