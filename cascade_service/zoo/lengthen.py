"""A family that serves the contexts users send, made from one trained on short windows.

The zoo's recipes train on windows of 256 tokens (zoo/build.py: the compute a CPU hour has); a model
with rotary positions then runs on positions it never saw as soon as a prompt is longer, its loss past
256 positions climbs (the shipped family's large: 3.2 nats/token at 0-256, 5.9 at 512-1,024 on code
outside its corpus), and its drafters part from it there. Here the trained family's large model is
trained further on windows of `window` tokens, from its own corpus and several installed packages
(`packages`; none that a benchmark judges on nor any that depends on one: zoo/judged.py refuses them
before anything is trained), and declares `window` positions, so the service
refuses longer contexts by name instead of serving them badly. Then its drafters are distilled in
order with `cascade-service distill` (zoo/distill.py; on-policy, against full distributions): base
against the new large, small against the new base, each starting from the source's own drafter, on
prompts of 300-800 tokens cut from the same texts; each distillation's report (acceptance by draft
position on the held-out evaluation packages, before and after) goes into the family's report.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from cascade_service.zoo import train
from cascade_service.zoo.distill import TOKENIZER_FILES, Settings, distill
from cascade_service.zoo.distill_data import Corpus
from cascade_service.zoo.evaluate import (
    EVAL_PACKAGES,
    encode_files,
    eval_package_files,
    eval_source_versions,
    evaluate_sources,
)
from cascade_service.zoo.judged import check_training_packages, judged_packages

TIERS = ("large", "base", "small")
# Packages every install of this project brings (through Ray Serve, transformers and rich): pure
# Python, documented, unlike the standard library in style. A missing one stops the build (the training
# text would depend on the machine). Never a package a benchmark judges on (zoo.judged: the evaluation
# packages, those every shipped prompt set is cut from) nor one that depends on one: the build refuses
# them. The shipped family's weights were trained with fastapi and jsonschema too, before that check
# existed; fastapi depends on starlette and anyio, jsonschema on attrs (all three judged by
# disagree.jsonl), so the recipe no longer has them.
TRAIN_PACKAGES = ("markdown_it", "pydantic", "requests", "rich", "urllib3")


@dataclass(frozen=True)
class LongSpec:
    """Everything that determines a lengthened family (the cache key, with the source's weights)."""

    name: str
    source: str  # the family it lengthens: a zoo preset (shipped, or built here first)
    window: int  # tokens per training window of the large model, and the positions every tier declares
    steps: int  # the large model's further training
    batch: int
    lr: float
    packages: tuple[str, ...] = TRAIN_PACKAGES
    drafters: Settings = field(default_factory=Settings)  # each drafter's distillation
    seed: int = 0
    threads: int = 2
    eval_prompts: int = 24
    eval_steps: int = 64
    eval_windows: int = 16


LONG_PRESETS = {
    # The shipped family: 2,048-token windows (0.2 epochs of the corpus); then base and small distilled.
    "quality": LongSpec(name="quality", source="quality-short", window=2048, steps=250, batch=2, lr=1e-3),
    # CI: from the test zoo, seconds.
    "long-test": LongSpec(
        name="long-test",
        source="test",
        window=128,
        steps=4,
        batch=2,
        lr=1e-3,
        packages=("markdown_it",),
        drafters=Settings(
            steps=3,
            batch=2,
            prompts=40,
            min_prompt_tokens=40,
            max_prompt_tokens=90,
            continuation=8,
            checkpoint_every=2,
            draft_k=2,
            threads=1,
        ),
        threads=1,
        eval_prompts=2,
        eval_steps=8,
        eval_windows=2,
    ),
}


def build_long(preset: str, out_dir: str | Path, source: dict[str, Path], progress: bool = True) -> dict[str, Path]:
    """Build (or reuse) the lengthened family of a LONG_PRESETS preset in `out_dir` from `source`, the
    paths of the family its spec names (`zoo.families.family` finds them and calls this)."""
    if preset not in LONG_PRESETS:
        raise ValueError(f"unknown lengthened preset {preset!r}; expected one of {sorted(LONG_PRESETS)}")
    from cascade_service.zoo.grown import derived

    spec = LONG_PRESETS[preset]
    out = Path(out_dir).expanduser()
    # Before anything is read or reused: judged code, code depending on it, or a package missing here.
    judged = judged_packages()
    cleared = check_training_packages(spec.packages, judged, who=spec.name)
    return derived(spec, source, out, lambda paths: _build(spec, source, paths, progress, judged, cleared), progress)


def _build(
    spec: LongSpec,
    source: dict[str, Path],
    paths: dict[str, Path],
    progress: bool,
    judged: dict[str, list[str]],
    cleared: dict[str, dict],
) -> dict:
    from cascade_service.zoo.build import held_out_modules, read_text_file, training_texts

    lap = train.Laps()
    source_report = json.loads(source["report"].read_text())
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(source["large"]), local_files_only=True)
    corpus = training_texts(source_report["spec"]["corpus_chars"], progress)
    package_files = eval_package_files(spec.packages)
    packages = [read_text_file(p) for files in package_files.values() for p in files]
    external_files = eval_package_files()
    external = [read_text_file(p) for files in external_files.values() for p in files]
    stream = encode_files(tokenizer, corpus + packages, progress)
    large = LlamaForCausalLM.from_pretrained(str(source["large"]), local_files_only=True, dtype=torch.float32)
    with train.threads(spec.threads):
        log = lengthen(large, stream, spec, progress)
    _save(_declaring(large, spec.window), tokenizer, paths["large"], source["large"])
    lap("large")
    names = ", ".join(package_files)
    labels = ("stdlib",) * len(corpus) + tuple(n for n, files in package_files.items() for _ in files)
    texts = Corpus(f"the source's corpus and packages {names}", tuple(corpus + packages), labels)
    held_labels = tuple(n for n, files in external_files.items() for _ in files)
    held = Corpus(f"evaluation packages {', '.join(external_files)}", tuple(external), held_labels)
    reports = {}
    work = paths["large"].parent / ".distill"
    for drafter, reviewer in (("base", "large"), ("small", "base")):
        run = work / drafter
        shutil.rmtree(run, ignore_errors=True)
        settings = replace(spec.drafters, seed=spec.seed)
        reports[drafter] = distill(
            paths[reviewer], texts, run, start=source[drafter], settings=settings, progress=progress, report_source=held
        )
        module = LlamaForCausalLM.from_pretrained(str(run), local_files_only=True, dtype=torch.float32)
        _save(_declaring(module, spec.window), tokenizer, paths[drafter], source[drafter])
        lap(drafter)
    shutil.rmtree(work)
    for key in ("bigram", "prompts", "tune_prompts"):
        paths[key].write_bytes(source[key].read_bytes())
    prompts = [json.loads(line)["prompt"] for line in paths["prompts"].read_text().splitlines() if line.strip()]
    evaluation = evaluate_sources(
        paths,
        TIERS,
        tokenizer,
        {"heldout": [read_text_file(p) for p in held_out_modules()], "external": external},
        prompts[: spec.eval_prompts],
        steps=spec.eval_steps,
        windows=spec.eval_windows,
        threads=spec.threads,
    )
    lap("evaluate")
    evaluation["tiers"]["large"]["train"] = log.summary()
    return {
        "preset": spec.name,
        "spec": asdict(spec),
        "lengthened_from": {"family": spec.source, "preset": source_report["preset"]},
        "build_s": lap.total(),
        "corpus": {"files": len(corpus) + len(packages), "tokens": int(stream.numel())},
        "training_packages": eval_source_versions(list(package_files)),
        # How training and judging were kept apart (zoo/judged.py): what each training package depends
        # on, transitively, from installed metadata, and the judged packages none of it may be.
        "training_dependencies": {name: found["depends_on"] for name, found in cleared.items()},
        "judged_packages": judged,
        "vocab_size": len(tokenizer),
        "training": {"tokens": log.tokens, "tokens_per_s": round(log.tokens / max(1e-9, log.seconds), 1)},
        "distill": {name: _portable(report) for name, report in reports.items()},
        "evaluation": {
            "sources": ["heldout", "external"],
            "packages": eval_source_versions(list(external_files)),
            "missing": [name for name in EVAL_PACKAGES if name not in external_files],
            "prompts": spec.eval_prompts,
            "greedy_steps": spec.eval_steps,
            "windows": spec.eval_windows,
            "window_tokens": 256,
        },
        **evaluation,
    }


def lengthen(large: LlamaForCausalLM, stream: torch.Tensor, spec: LongSpec, progress: bool) -> train.TrainLog:
    """Train `large` further, in place, on windows of `spec.window` tokens of `stream`: the zoo's own
    training (train.train_family) with no drafters beside it; returns its log."""
    schedule = train.Schedule(
        batch=spec.batch,
        seq_len=spec.window,
        lm_steps=spec.steps,
        distill_steps=0,
        lm_lr=spec.lr,
        drafter_lr=spec.lr,
        embed_lr=spec.lr,
        threads=spec.threads,
    )
    return train.train_family(large, {}, stream, schedule, spec.seed, progress)["large"]


def _declaring(module: LlamaForCausalLM, positions: int) -> LlamaForCausalLM:
    """The model declaring the positions it was trained on (the service refuses longer contexts)."""
    module.config.max_position_embeddings = positions
    return module


def _save(module: LlamaForCausalLM, tokenizer, path: Path, source: Path) -> None:
    """The model as the zoo saves one, with the source tier's tokenizer files as they were (saving a
    loaded tokenizer again adds the loader's own keys to its config)."""
    from cascade_service.zoo.build import save_model

    save_model(module, tokenizer, path)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, path / name)


def _portable(report: dict) -> dict:
    """A distillation's report without this machine's paths."""
    return {k: v for k, v in report.items() if k not in ("target", "start", "prompts")}


HELP = "lengthen a built family into a directory: large trained on longer windows, its drafters distilled again"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="quality", choices=sorted(LONG_PRESETS))
    parser.add_argument("--source", required=True, help="the source family's directory (a built or shipped zoo)")
    parser.add_argument("--out", required=True)


def run(args: argparse.Namespace) -> int:
    """The second stage alone, on a family already in --source (`zoo build --preset quality` runs both
    stages, the first one's too)."""
    from cascade_service.zoo.shipped import zoo_paths

    paths = build_long(args.preset, args.out, zoo_paths(Path(args.source)))  # prints the report
    print(paths["report"])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cascade_service.zoo.lengthen`: the same as `cascade-service zoo lengthen`."""
    parser = argparse.ArgumentParser(prog="python -m cascade_service.zoo.lengthen", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
