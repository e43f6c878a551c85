"""The `t5` zoo preset: an encoder-decoder family (large, base, small) trained here, docstring -> code.

The paper's headline setting is FLAN-T5; this is its offline stand-in. The task has an input and an
output: the encoder reads a documented function's signature and docstring, the decoder writes its
body. Pairs come from this interpreter's standard library (the held-out modules of the `demo` zoo
excluded: its tuning prompts come from them); benchmark prompts from the installed packages the zoo
never reads (`evaluate.EVAL_PACKAGES`). The large model is trained on the pairs; base and small are
distilled from it (KL to its distributions on the same decoder inputs), so they agree with it.
"""

from __future__ import annotations

import ast
import json
import math
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForSeq2SeqLM, GenerationConfig, PreTrainedTokenizerFast, T5Config

from cascade_service.zoo import train
from cascade_service.zoo.build import held_out_modules, read_text_file, train_tokenizer, training_texts
from cascade_service.zoo.evaluate import ends_in_loop, eval_package_files
from cascade_service.zoo.prompts import write_prompts

TIERS = ("large", "base", "small")
BUILDER_VERSION = 2  # bump when the artefacts a spec produces change


@dataclass(frozen=True)
class T5Shape:
    d_model: int
    layers: int  # encoder and decoder each
    heads: int
    d_ff: int


@dataclass(frozen=True)
class T5Spec:
    name: str
    vocab_size: int
    large: T5Shape
    base: T5Shape
    small: T5Shape
    steps: int  # large's optimizer steps
    distill_steps: int  # each drafter's
    batch: int
    lr: float
    max_input: int = 96  # tokens of signature + docstring
    max_output: int = 96  # tokens of body (then </s>)
    corpus_chars: int | None = None  # a prefix of the sorted stdlib files this long; None: all
    prompts: int = 24
    tune_prompts: int = 8
    seed: int = 0


T5_PRESETS = {
    # A few minutes on 2 cores (report.json's build_s).
    "t5": T5Spec(
        name="t5",
        vocab_size=1024,
        large=T5Shape(d_model=128, layers=3, heads=4, d_ff=384),
        base=T5Shape(d_model=96, layers=2, heads=4, d_ff=256),
        small=T5Shape(d_model=64, layers=1, heads=2, d_ff=192),
        steps=1600,
        distill_steps=250,
        batch=16,
        lr=3e-3,
    ),
    # Pipeline checks in CI: seconds.
    "t5-test": T5Spec(
        name="t5-test",
        vocab_size=400,
        large=T5Shape(d_model=48, layers=1, heads=2, d_ff=96),
        base=T5Shape(d_model=32, layers=1, heads=2, d_ff=64),
        small=T5Shape(d_model=32, layers=1, heads=2, d_ff=64),
        steps=20,
        distill_steps=5,
        batch=4,
        lr=3e-3,
        max_input=48,
        max_output=48,
        corpus_chars=300_000,
        prompts=4,
        tune_prompts=2,
    ),
}


def function_pairs(sources: Iterable[str]) -> list[tuple[str, str]]:
    """(signature and docstring, body after the docstring) of every documented function with a body."""
    pairs = []
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or len(node.body) < 2:
                continue
            if ast.get_docstring(node) is None or node.body[0].end_lineno is None or node.end_lineno is None:
                continue
            head = "".join(lines[node.lineno - 1 : node.body[0].end_lineno])
            body = "".join(lines[node.body[0].end_lineno : node.end_lineno])
            indent = len(head) - len(head.lstrip())
            pairs.append((_dedent(head, indent), _dedent(body, indent)))
    return pairs


def _dedent(text: str, indent: int) -> str:
    return "".join(line[indent:] if line[:indent].isspace() else line for line in text.splitlines(keepends=True))


def _usable(tokenizer: PreTrainedTokenizerFast, source: str, spec: T5Spec) -> bool:
    """Whether an encoder input can be one: the decoder start (<pad>) never appears in it (core.encdec)."""
    return tokenizer.pad_token_id not in tokenizer(source).input_ids[: spec.max_input]


def _spread(items: Sequence[str], count: int) -> list[str]:
    """`count` of `items`, evenly spread over them."""
    return [items[i * len(items) // count] for i in range(count)]


def _encode(tokenizer: PreTrainedTokenizerFast, pairs: Sequence[tuple[str, str]], spec: T5Spec) -> list:
    eos, out = tokenizer.eos_token_id, []
    for source, target in pairs:
        ids = tokenizer(source).input_ids[: spec.max_input]
        if tokenizer.pad_token_id not in ids:  # as _usable, without encoding the source twice
            out.append((ids, tokenizer(target).input_ids[: spec.max_output - 1] + [eos]))
    return out


def _batch(examples: Sequence[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    width_in = max(len(i) for i, _ in examples)
    width_out = max(len(o) for _, o in examples)
    ids = torch.zeros((len(examples), width_in), dtype=torch.long)
    labels = torch.full((len(examples), width_out), -100, dtype=torch.long)
    for row, (i, o) in enumerate(examples):
        ids[row, : len(i)] = torch.tensor(i)
        labels[row, : len(o)] = torch.tensor(o)
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": labels}


def _new_model(shape: T5Shape, tokenizer: PreTrainedTokenizerFast, seed: int):
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=shape.d_model,
        d_kv=shape.d_model // shape.heads,
        d_ff=shape.d_ff,
        num_layers=shape.layers,
        num_decoder_layers=shape.layers,
        num_heads=shape.heads,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.decoder_start_token_id = tokenizer.pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForSeq2SeqLM.from_config(config)


def _train(student, teacher, data, steps: int, spec: T5Spec, seed: int) -> list[float]:
    """AdamW with cosine decay; cross-entropy on the body (teacher None) or KL to the teacher's rows."""
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(student.parameters(), lr=spec.lr, weight_decay=0.0)
    losses = []
    student.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = spec.lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        picks = torch.randint(len(data), (spec.batch,), generator=gen).tolist()
        batch = _batch([data[i] for i in picks])
        out = student(**batch)
        if teacher is None:
            loss = out.loss
        else:
            with torch.no_grad():
                target = teacher(**batch).logits.log_softmax(-1)
            mask = batch["labels"] != -100
            kl = F.kl_div(out.logits.log_softmax(-1), target, log_target=True, reduction="none").sum(-1)
            loss = (kl * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
    student.eval()
    return losses


@torch.inference_mode()
def loops(model, tokenizer, prompts: Sequence[str], steps: int = 64) -> dict:
    """How many of `model`'s greedy continuations of `prompts` end in a loop (evaluate.ends_in_loop)."""
    looped = 0
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt).input_ids])
        out = model.generate(ids, do_sample=False, max_new_tokens=steps)[0, 1:].tolist()
        looped += ends_in_loop(out)
    return {"continuations": len(prompts), "greedy_steps": steps, "ending_in_a_loop": looped}


@torch.inference_mode()
def _evaluate(models: dict, data) -> dict:
    """Teacher-forced loss per body token and top-1 agreement with large, on held-out pairs."""
    batch = _batch(data)
    mask = batch["labels"] != -100
    rows = {name: m(**batch).logits for name, m in models.items()}
    report = {}
    for name, logits in rows.items():
        loss = F.cross_entropy(logits[mask], batch["labels"][mask])
        agree = (logits.argmax(-1) == rows["large"].argmax(-1))[mask].float().mean()
        report[name] = {"heldout_loss": round(float(loss), 3), "agreement_with_large": round(float(agree), 3)}
    return report


def build_t5_zoo(preset: str, out_dir: str | Path, progress: bool = True) -> dict[str, Path]:
    """Build (or reuse) the encoder-decoder family of a T5_PRESETS preset in `out_dir`."""
    if preset not in T5_PRESETS:
        raise ValueError(f"unknown encoder-decoder preset {preset!r}; expected one of {sorted(T5_PRESETS)}")
    spec = T5_PRESETS[preset]
    out = Path(out_dir).expanduser()
    paths = {name: out / name for name in TIERS} | {
        "report": out / "report.json",
        "prompts": out / "prompts.jsonl",  # for benchmarks: code the zoo never read
        "tune_prompts": out / "tune_prompts.jsonl",  # for `tune`: the held-out stdlib modules
    }
    marker, stamp = out / "zoo.json", {"builder": BUILDER_VERSION, "spec": asdict(spec), "torch": torch.__version__}
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return paths
    marker.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    texts = training_texts(spec.corpus_chars, progress)
    tokenizer = train_tokenizer(texts, spec.vocab_size, progress=False)
    data = _encode(tokenizer, function_pairs(texts), spec)
    held_pairs = function_pairs(read_text_file(p) for p in held_out_modules())
    held = _encode(tokenizer, held_pairs, spec)[:64]
    tune = [s for s, _ in held_pairs[64:] if _usable(tokenizer, s, spec)]
    write_prompts(paths["tune_prompts"], _spread(tune, spec.tune_prompts))
    external = [
        source for source, _ in function_pairs(read_text_file(p) for f in eval_package_files().values() for p in f)
    ]
    prompts = _spread([s for s in external if _usable(tokenizer, s, spec)], spec.prompts)
    write_prompts(paths["prompts"], prompts)
    family = {name: _new_model(getattr(spec, name), tokenizer, spec.seed * 100 + i) for i, name in enumerate(TIERS)}
    curves = {}
    with train.threads(2):
        curves["large"] = _train(family["large"], None, data, spec.steps, spec, spec.seed)
        for name in TIERS[1:]:
            curves[name] = _train(family[name], family["large"], data, spec.distill_steps, spec, spec.seed + 1)
        evaluation = _evaluate(family, held)
        looped = loops(family["large"], tokenizer, prompts)
    for name, module in family.items():
        module.generation_config = GenerationConfig(
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
        shutil.rmtree(paths[name], ignore_errors=True)
        module.save_pretrained(paths[name])
        tokenizer.save_pretrained(str(paths[name]))
    report = {
        "preset": spec.name,
        "spec": asdict(spec),
        "build_s": round(time.perf_counter() - began, 1),
        "pairs": {"train": len(data), "heldout": len(held), "prompts": spec.prompts},
        "parameters": {name: sum(p.numel() for p in m.parameters()) for name, m in family.items()},
        "final_train_loss": {name: round(sum(c[-20:]) / len(c[-20:]), 3) for name, c in curves.items()},
        "tiers": evaluation,
        "loops": looped,  # of large's greedy continuations of prompts.jsonl
    }
    paths["report"].write_text(json.dumps(report, indent=1) + "\n")
    marker.write_text(json.dumps(stamp, indent=1))
    return paths
