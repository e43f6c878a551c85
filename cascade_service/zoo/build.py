"""The offline model zoo: a Llama family (large, base, small) trained here on the Python standard library.

Offline and deterministic: the corpus is this interpreter's own stdlib sources, the tokenizer and the
models are trained from seeded initialisations with a fixed thread count, so one machine always builds
the same weights. A fixed set of stdlib files is held out: tuning prompts come from it. Benchmark prompts
and the report's figures come from code outside the stdlib altogether (`evaluate.EVAL_PACKAGES`).

Sized for the compute at hand (Chinchilla: C = 6ND, about 20 tokens per parameter): the `demo` family
gets about 8 minutes of 2-core CPU, a few times 10^13 FLOPs, so its large model has about a million
parameters and reads millions of tokens; a narrow, deep large model keeps the drafters' decode steps
cheap beside it. The drafters are distilled to agree with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from cascade_service.core.proposers.mag import BigramTable
from cascade_service.zoo import train
from cascade_service.zoo.evaluate import (
    encode_files,
    eval_package_files,
    eval_source_versions,
    evaluate_sources,
    format_report,
)
from cascade_service.zoo.prompts import extract_prompts, write_prompts
from cascade_service.zoo.shipped import zoo_paths
from cascade_service.zoo.tiny import BOS, EOS, PAD

BUILDER_VERSION = 2  # bump when the artefacts a spec produces change
STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Held out of training; prompts come from HELD_OUT_MODULES (real library code, not tests).
HELD_OUT_DIRS = frozenset({"test", "tests", "idlelib"})
HELD_OUT_MODULES = (
    "argparse",
    "calendar",
    "csv",
    "difflib",
    "fractions",
    "ftplib",
    "gettext",
    "ipaddress",
    "mailbox",
    "pprint",
    "sched",
    "shlex",
    "statistics",
    "tarfile",
    "textwrap",
)
# Left out altogether: not the stdlib, or generated data tables rather than code (codec charmaps,
# pydoc's topic dump, this build's sysconfig values).
_NOT_CODE = frozenset({"site-packages", "__pycache__", "encodings", "pydoc_data"})
TIERS = ("large", "base", "small")


@dataclass(frozen=True)
class Shape:
    """Llama dimensions of one tier."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int  # grouped-query attention, as in current Llama releases
    intermediate: int


@dataclass(frozen=True)
class ZooSpec:
    """Everything that determines a zoo's contents (the cache key, with the corpus hash)."""

    name: str
    vocab_size: int
    corpus_chars: int | None  # train on a prefix of the sorted files this long; None = all of them
    large: Shape
    base: Shape
    small: Shape
    schedule: train.Schedule
    prompts: int = 24  # prompts.jsonl, for benchmarks, from the evaluation packages
    tune_prompts: int = 8  # tune_prompts.jsonl, for parameter tuning, from the held-out stdlib modules
    max_prompt_tokens: int = 200
    eval_prompts: int = 24  # greedy agreement and loops: first prompts of prompts.jsonl ...
    eval_steps: int = 64  # ... times this many large-model greedy steps
    eval_windows: int = 16  # teacher-forced loss and agreement: windows of schedule.seq_len tokens per source
    seed: int = 0


PRESETS = {
    # About 9 minutes on 2 cores (see report.json and docs/benchmarks.md "The demo zoo").
    "demo": ZooSpec(
        name="demo",
        vocab_size=1024,
        corpus_chars=None,
        large=Shape(hidden=96, layers=8, heads=4, kv_heads=2, intermediate=256),
        base=Shape(hidden=96, layers=2, heads=4, kv_heads=2, intermediate=256),
        small=Shape(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=176),
        schedule=train.Schedule(
            batch=16,
            seq_len=256,
            lm_steps=1150,
            distill_steps=80,
            lm_lr=5e-3,
            drafter_lr=5e-3,
            embed_lr=0.1,
            drafters_from=0.65,
        ),
    ),
    # About an hour on 2 cores (estimated from measured step times: 0.89 s per step of large alone, 1.22
    # with the drafters), for better benchmark figures: a larger family, about 5 epochs. The shipped
    # family is this one lengthened to 2,048 positions (zoo/lengthen.py: preset quality).
    "quality-short": ZooSpec(
        name="quality-short",
        vocab_size=2048,
        corpus_chars=None,
        large=Shape(hidden=192, layers=8, heads=6, kv_heads=2, intermediate=512),
        base=Shape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=352),
        small=Shape(hidden=96, layers=1, heads=4, kv_heads=2, intermediate=256),
        schedule=train.Schedule(
            batch=16,
            seq_len=256,
            lm_steps=3400,
            distill_steps=200,
            lm_lr=3e-3,
            drafter_lr=4e-3,
            embed_lr=0.1,
            drafters_from=0.6,
        ),
    ),
    # Pipeline checks in CI: seconds, and the models learn only a little.
    "test": ZooSpec(
        name="test",
        vocab_size=512,
        corpus_chars=1_000_000,
        large=Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=176),
        base=Shape(hidden=48, layers=1, heads=4, kv_heads=2, intermediate=128),
        small=Shape(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=88),
        schedule=train.Schedule(
            batch=4, seq_len=64, lm_steps=60, distill_steps=20, lm_lr=3e-3, drafter_lr=3e-3, threads=1
        ),
        eval_prompts=2,
        eval_steps=8,
        eval_windows=2,
    ),
}


def _stdlib_sources(root: Path) -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _NOT_CODE]  # pruned: site-packages alone is huge
        found += [Path(folder, f) for f in files if f.endswith(".py") and not f.startswith("_sysconfigdata")]
    return sorted(found)


def _is_held_out(path: Path, root: Path) -> bool:
    parts = path.relative_to(root).parts
    return not HELD_OUT_DIRS.isdisjoint(parts[:-1]) or (len(parts) == 1 and path.stem in HELD_OUT_MODULES)


def corpus_files(root: Path = STDLIB) -> list[Path]:
    """Training sources, sorted: stdlib *.py minus the held-out set and the data tables."""
    return [p for p in _stdlib_sources(root) if not _is_held_out(p, root)]


def held_out_modules(root: Path = STDLIB) -> list[Path]:
    """The held-out top-level modules that exist in this Python, in HELD_OUT_MODULES order."""
    return [root / f"{m}.py" for m in HELD_OUT_MODULES if (root / f"{m}.py").is_file()]


def read_text_file(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _stamp(spec: ZooSpec, files: Sequence[Path], eval_files: dict[str, list[Path]]) -> dict:
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(STDLIB)).encode() + b"\0" + path.read_bytes() + b"\0")
    evaluation = hashlib.sha256()
    for package, paths in eval_files.items():
        for path in paths:
            evaluation.update(f"{package}/{path.name}".encode() + b"\0" + path.read_bytes() + b"\0")
    return {
        "eval_sha256": evaluation.hexdigest(),
        "builder": BUILDER_VERSION,
        "spec": asdict(spec),
        "corpus_sha256": digest.hexdigest(),
    } | built_with()


def built_with() -> dict[str, str]:
    """The versions a family's weights depend on (float results differ between them)."""
    return {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__}


def build_zoo(preset: str | ZooSpec, out_dir: str | Path, progress: bool = True) -> dict[str, Path]:
    """Build (or reuse) a zoo in `out_dir`; returns paths of large/base/small, bigram, report, prompts.

    `preset` is a PRESETS name or a ZooSpec. A zoo already there with the same spec, corpus and library
    versions is returned at once; anything else there is rebuilt.
    """
    if isinstance(preset, str) and preset not in PRESETS:
        raise ValueError(f"unknown zoo preset {preset!r}; expected one of {sorted(PRESETS)}")
    spec = PRESETS[preset] if isinstance(preset, str) else preset
    out = Path(out_dir).expanduser()
    paths = zoo_paths(out)
    marker = out / "zoo.json"
    stamp = _stamp(spec, corpus_files() + held_out_modules(), eval_package_files())
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return paths
    marker.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" bars are only noise here
    try:
        report = _build(spec, paths, progress)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    paths["report"].write_text(json.dumps(report, indent=1) + "\n")
    if progress:
        print(format_report(report), file=sys.stderr)
    # Written last: a half-built zoo (crash, Ctrl-C) is never mistaken for a complete one.
    marker.write_text(json.dumps(stamp, indent=1))
    return paths


def _build(spec: ZooSpec, paths: dict[str, Path], progress: bool) -> dict:
    lap = train.Laps()
    texts = training_texts(spec.corpus_chars, progress)
    tokenizer = train_tokenizer(texts, spec.vocab_size, progress)
    lap("tokenizer")
    stream = encode_files(tokenizer, texts, progress)  # [N] with EOS after each file
    BigramTable.from_tokens(stream, len(tokenizer)).save(paths["bigram"])
    held = [read_text_file(p) for p in held_out_modules()]
    packages = eval_package_files()
    external = [read_text_file(p) for files in packages.values() for p in files]
    prompts = extract_prompts(external, tokenizer, spec.prompts, spec.max_prompt_tokens)
    write_prompts(paths["prompts"], prompts)
    write_prompts(paths["tune_prompts"], extract_prompts(held, tokenizer, spec.tune_prompts, spec.max_prompt_tokens))
    lap("corpus")
    family = {name: _new_model(getattr(spec, name), tokenizer, spec.seed * 100 + i) for i, name in enumerate(TIERS)}
    with train.threads(spec.schedule.threads):
        logs = train.train_family(
            family["large"], {n: family[n] for n in TIERS[1:]}, stream, spec.schedule, spec.seed, progress
        )
    for name, module in family.items():
        save_model(module, tokenizer, paths[name])
    lap("train")
    sources = {"heldout": held, "external": external}  # held-out stdlib modules; the evaluation packages
    evaluation = evaluate_sources(
        paths,
        TIERS,
        tokenizer,
        sources,
        prompts[: spec.eval_prompts],
        steps=spec.eval_steps,
        windows=spec.eval_windows,
        window_len=spec.schedule.seq_len,
        threads=spec.schedule.threads,
    )
    lap("evaluate")
    for name, log in logs.items():
        evaluation["tiers"][name]["train"] = log.summary()
    large = logs["large"]
    return {
        "preset": spec.name,
        "spec": asdict(spec),
        "build_s": lap.total(),
        "corpus": {
            "files": len(texts),
            "chars": sum(map(len, texts)),
            "tokens": int(stream.numel()),
            "held_out_modules": [p.name for p in held_out_modules()],
            "held_out_dirs": sorted(HELD_OUT_DIRS),
        },
        "vocab_size": len(tokenizer),
        "training": {
            "tokens": large.tokens,
            "epochs": round(large.tokens / max(1, stream.numel()), 2),
            # the large model's tokens over the seconds of its phase, drafters learning alongside
            "tokens_per_s": round(large.tokens / max(1e-9, large.seconds), 1),
            "flops": 6 * _compute_params(family["large"]) * large.tokens,
        },
        "evaluation": {
            "sources": list(sources),
            "packages": eval_source_versions(list(packages)),
            "prompts": spec.eval_prompts,
            "greedy_steps": spec.eval_steps,
            "windows": spec.eval_windows,
            "window_tokens": spec.schedule.seq_len,
        },
        **evaluation,
    }


def _compute_params(module: LlamaForCausalLM) -> int:
    """Parameters that cost FLOPs per token: all but the input embedding (a lookup)."""
    embedding = module.get_input_embeddings().weight
    assert isinstance(embedding, torch.Tensor)
    return sum(p.numel() for p in module.parameters()) - embedding.numel()


def training_texts(limit: int | None, progress: bool) -> list[str]:
    texts, chars = [], 0
    for path in tqdm(corpus_files(), desc="read corpus", unit="file", disable=not progress):
        if limit is not None and chars >= limit:
            break
        texts.append(read_text_file(path))
        chars += len(texts[-1])
    return texts


# The zoo's models know code, not dialogue: a chat turns into comments, and the reply is the code after
# them. Enough for `/v1/chat/completions` to work as clients expect on the demo family.
CHAT_TEMPLATE = (
    "{% for message in messages %}# {{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, progress: bool = True) -> PreTrainedTokenizerFast:
    """A byte-level BPE (every byte a symbol, so any text round-trips) with <pad>, <s>, </s> as ids 0-2."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = list(texts)
    bpe.train_from_iterator(tqdm(texts, desc="train tokenizer", unit="file", disable=not progress), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _new_model(shape: Shape, tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # seeded init without disturbing the caller's RNG
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def save_model(module: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, path: Path) -> None:
    module.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    shutil.rmtree(path, ignore_errors=True)
    module.save_pretrained(path)
    tokenizer.save_pretrained(str(path))
