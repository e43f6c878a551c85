"""`cascade-service distill`: a drafter trained to agree with a given target (zoo.distill_data makes the
sequences; this module trains and measures).

Each step takes a batch of the target's own continuations (on-policy), runs the target over them once
(no gradient) for its full next-token distribution at every position, and moves the drafter toward it
by a divergence (`DIVERGENCES`: forward KL, or total variation, the quantity speculative decoding's
acceptance rate is one minus of). The distributions are made per batch and dropped: memory holds one
batch, whatever the number of sequences. The loss covers the continuation's positions and the
prompt's last `prompt_positions` (the contexts a drafter drafts from are the target's tokens after a
prompt). Every `checkpoint_every` steps the drafter, its optimizer, the step and the settings are
written, so `--resume` continues the same run: the batch of step s is drawn from a generator seeded
with (seed, s), so a resumed run takes the steps an unstopped one would.

The report (`distill.json` in the output directory) measures on held-out prompts, before and after,
cut from packages the training never read (by default whole packages of the source held out,
zoo.distill_data.split_by_package; or another source, `report_source`):
acceptance by draft position (the drafter drafts k tokens greedily from points along the target's
greedy continuation; position j is accepted when its first j tokens are the target's) and agreement
(the drafter's argmax equals the target's, teacher-forced) by context position: 0-256, 256-512,
512-1,024, 1,024+.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from ..models.hf import load_tokenizer
from .distill_data import (
    Corpus,
    Trajectory,
    continue_prompts,
    cut_prompts,
    cut_sourced_prompts,
    source_texts,
    source_units,
    split_by_package,
)
from .train import cosine_lr, threads

TOP_K = 32  # the report's measure of how much top-k compression of the target's distributions would lose
REPORT_PROMPTS = 16  # held-out prompts the report measures on
STATE = ".distill"  # under the output directory: the sequences and the checkpoint
CONTEXT_BUCKETS = (0, 256, 512, 1024)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


@dataclass(frozen=True)
class DrafterShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


# --size: the shipped family's drafter shapes by name, or HIDDEN:LAYERS (heads of 32 dimensions).
SIZES = {"base": DrafterShape(128, 2, 4, 2, 352), "small": DrafterShape(96, 1, 4, 2, 256)}


def parse_size(text: str) -> DrafterShape:
    if text in SIZES:
        return SIZES[text]
    try:
        hidden, layers = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"--size must be one of {', '.join(SIZES)} or HIDDEN:LAYERS, got {text!r}") from None
    if hidden < 8 or layers < 1 or hidden % 8:
        raise ValueError(f"--size {text}: hidden must be a multiple of 8 (>= 8) and layers >= 1")
    heads = max(1, hidden // 32)
    return DrafterShape(hidden, layers, heads, max(1, heads // 2), -(-hidden * 8 // 3 // 32) * 32)


def _kl(log_q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    # KL(p || q) per row: the mass-covering divergence, Hinton's distillation at temperature 1
    return (p * (torch.log(p.clamp_min(1e-30)) - log_q)).sum(-1)


def _tv(log_q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    # total variation: 1 - sum(min(p, q)), one minus the chance a sampled draft is accepted
    return 0.5 * (p - log_q.exp()).abs().sum(-1)


DIVERGENCES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"kl": _kl, "tv": _tv}


@dataclass(frozen=True)
class Settings:
    steps: int = 600
    batch: int = 8  # sequences per step
    lr: float = 1e-3  # measured against 3e-3 (CHANGELOG.md "Benchmark history", distilling drafters)
    divergence: str = "kl"
    prompts: int = 1600  # training prompts cut (or read): 400 over-fit in 600 steps (measured)
    min_prompt_tokens: int = 300
    max_prompt_tokens: int = 800
    continuation: int = 64  # tokens the target continues each prompt by
    sampled: float = 0.5  # share of continuations sampled at temperature 1 (the rest greedy)
    prompt_positions: int = 64  # the prompt's last positions the loss covers too
    held_out: float = 0.05  # at most this share of the source's texts, whole packages, held out for the report
    draft_k: int = 5  # draft positions the report measures
    checkpoint_every: int = 50
    seed: int = 0
    threads: int = 2


def new_drafter(target_config, shape: DrafterShape, seed: int) -> LlamaForCausalLM:
    """A Llama drafter of `shape` over the target's vocabulary, positions and special tokens."""
    positions: int = getattr(target_config, "max_position_embeddings", None) or target_config.n_positions
    config = LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=positions,
        tie_word_embeddings=False,
        bos_token_id=target_config.bos_token_id,
        eos_token_id=target_config.eos_token_id,
        pad_token_id=target_config.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def load_model(path: Path):
    """A causal LM from its directory, in float32 (what distillation and its measures run in)."""
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)


def distill(
    target_dir: Path,
    source: Path | Corpus,
    out: Path,
    start: Path | None = None,
    size: str | None = None,
    settings: Settings = Settings(),
    resume: bool = False,
    progress: bool = True,
    report_source: Path | Corpus | None = None,
) -> dict:
    """Train a drafter for the target in `target_dir` (see the module doc); returns the report, also
    written to `out/distill.json`, the drafter to `out` as a model directory. The report's prompts are
    cut from `source`'s held-out packages (`split_by_package`: the training never reads them), or from
    `report_source` where given (then the training reads all of `source`)."""
    if (start is None) == (size is None):
        raise ValueError("give one of --drafter (a model directory to start from) and --size")
    if settings.divergence not in DIVERGENCES:
        raise ValueError(f"--divergence must be one of {', '.join(DIVERGENCES)}, got {settings.divergence!r}")
    began = time.perf_counter()
    state = out / STATE
    state.mkdir(parents=True, exist_ok=True)
    with threads(settings.threads):
        target = load_model(target_dir).eval()
        tokenizer = load_tokenizer(target_dir)
        if start is not None:
            drafter = load_model(start)
        else:
            drafter = new_drafter(target.config, parse_size(size or ""), settings.seed)
        vocab, wanted = drafter.config.vocab_size, target.config.vocab_size
        if vocab != wanted:
            raise ValueError(f"--drafter {start}: a vocabulary of {vocab}, the target's is {wanted}")
        texts, packages = source_units(source)
        if report_source is None:
            (texts, packages), (held_texts, held_packages) = split_by_package(
                texts, packages, settings.held_out, str(source)
            )
            total = len(texts) + len(held_texts)
            shown = f"packages of --prompts held out of training ({len(held_texts)} of its {total} texts)"
        else:
            held_texts, held_packages = source_units(report_source)
            shown = str(report_source)
        s, lo, hi = settings, settings.min_prompt_tokens, settings.max_prompt_tokens
        train_prompts = [ids for ids, _ in cut_sourced_prompts(texts, packages, tokenizer, s.prompts, lo, hi, s.seed)]
        # As cut_report_prompts cuts them (`acceptance` measures a drafter on the same prompts).
        held = cut_sourced_prompts(held_texts, held_packages, tokenizer, REPORT_PROMPTS, lo, hi, s.seed + 1)
        report_prompts = [ids for ids, _ in held]
        pad = pad_id(tokenizer)
        made = time.perf_counter()
        made_at = state / "sequences.jsonl"
        generate = continue_prompts(target, train_prompts, made_at, s.continuation, s.sampled, pad, s.seed)
        sequences = list(tqdm(generate, total=len(train_prompts), desc="target continues", disable=not progress))
        reference = list(
            continue_prompts(
                target, report_prompts, state / "held_out.jsonl", settings.continuation, 0.0, pad, settings.seed
            )
        )
        generated_s = time.perf_counter() - made
        checkpoint = state / "checkpoint"
        saved = _restore(checkpoint) if resume else None
        before = saved["before"] if saved else measure(target, drafter, reference, settings.draft_k)
        trained = _train(target, drafter, sequences, settings, checkpoint, saved, before, progress)
        after = measure(target, drafter, reference, settings.draft_k)
    drafter.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (target_dir / name).exists():
            shutil.copy2(target_dir / name, out / name)
    report = {
        "target": str(target_dir),
        "start": str(start) if start else None,
        "prompts": str(source),
        "report_prompts": shown,
        # The packages each side read: no report prompt comes from a package the training read.
        "training_packages": sorted(set(packages)),
        "report_packages": sorted(set(held_packages)),
        "report_prompt_packages": [package for _, package in held],
        "size": size,
        "settings": asdict(settings),
        "sequences": len(sequences),
        "held_out_prompts": len(reference),
        "tokens_per_sequence": round(sum(len(s.ids) for s in sequences) / len(sequences), 1),
        "before": before,
        "after": after,
        "steps": trained,
        "seconds": {"continuations": round(generated_s, 1), "total": round(time.perf_counter() - began, 1)},
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    (out / "distill.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def cut_report_prompts(source: Path | Corpus, tokenizer, settings: Settings) -> list[list[int]]:
    """The report's prompts cut from other text than training's (`--report-prompts`)."""
    lo, hi = settings.min_prompt_tokens, settings.max_prompt_tokens
    return cut_prompts(source_texts(source), tokenizer, REPORT_PROMPTS, lo, hi, settings.seed + 1)


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


def _train(target, drafter, sequences: Sequence[Trajectory], s: Settings, checkpoint: Path, saved, before, progress):
    drafter.train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, agree = 0, None
    if saved is not None:
        drafter.load_state_dict(saved["drafter"])
        opt.load_state_dict(saved["optimizer"])
        step, agree = saved["step"], saved["agree"]
    divergence = DIVERGENCES[s.divergence]
    bar = tqdm(total=s.steps, initial=step, desc=f"distill ({s.divergence})", disable=not progress)
    while step < s.steps:
        picks = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(s.seed * 100_003 + step))
        batch = [sequences[i] for i in picks[: s.batch].tolist()]
        ids, mask = _batch(batch, s.prompt_positions)
        with torch.no_grad():
            p = torch.softmax(target(input_ids=ids).logits[mask].float(), dim=-1)  # [N, V]
        log_q = torch.log_softmax(drafter(input_ids=ids).logits[mask].float(), dim=-1)
        loss = divergence(log_q, p).mean()
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, s.steps, s.lr)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        matched = float((log_q.argmax(-1) == p.argmax(-1)).float().mean())
        agree = matched if agree is None else 0.95 * agree + 0.05 * matched
        step += 1
        bar.set_postfix({"loss": f"{float(loss.detach()):.3f}", "agreement": f"{agree:.3f}"}, refresh=False)
        bar.update()
        if step % s.checkpoint_every == 0 or step == s.steps:
            _save(checkpoint, drafter, opt, step, agree, before, s)
    bar.close()
    drafter.eval()
    return step


def _save(path: Path, drafter, opt, step: int, agree, before, settings: Settings) -> None:
    """The checkpoint: tensors in safetensors (the drafter's, the optimizer's moments), the rest in
    JSON beside them (no pickle: a checkpoint is data, never code)."""
    optimizer = opt.state_dict()
    tensors = {f"drafter.{k}": v.contiguous() for k, v in drafter.state_dict().items()}
    for index, moments in optimizer["state"].items():
        tensors |= {f"optimizer.{index}.{k}": v.contiguous() for k, v in moments.items()}
    meta = {"step": step, "agree": agree, "before": before, "settings": asdict(settings)}
    meta["param_groups"] = optimizer["param_groups"]
    for suffix, write in ((".safetensors", lambda part: save_file(tensors, part)), (".json", _json(meta))):
        part = path.with_suffix(suffix + ".part")
        write(part)
        os.replace(part, path.with_suffix(suffix))  # a stop while writing leaves the last whole file
    # The JSON is written last and names the step: a checkpoint is whole when its step matches.


def _json(meta: dict) -> Callable[[Path], None]:
    def write(part: Path) -> None:
        part.write_text(json.dumps(meta))

    return write


def _restore(path: Path) -> dict | None:
    """The checkpoint `_save` wrote, as (drafter state, optimizer state, step, ...), or None."""
    meta_path, tensor_path = path.with_suffix(".json"), path.with_suffix(".safetensors")
    if not meta_path.exists() or not tensor_path.exists():
        return None
    meta, tensors = json.loads(meta_path.read_text()), load_file(tensor_path)
    drafter = {k.removeprefix("drafter."): v for k, v in tensors.items() if k.startswith("drafter.")}
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    optimizer = {"state": state, "param_groups": meta["param_groups"]}
    return {"drafter": drafter, "optimizer": optimizer} | {k: meta[k] for k in ("step", "agree", "before")}


def _batch(batch: Sequence[Trajectory], prompt_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids [B, W] right-padded, and the mask of positions the loss covers: those predicting a
    continuation token, and the prompt's last `prompt_positions`."""
    width = max(len(t.ids) for t in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.bool)
    for i, t in enumerate(batch):
        ids[i, : len(t.ids)] = torch.tensor(t.ids)
        mask[i, max(0, t.prompt - 1 - prompt_positions) : len(t.ids) - 1] = True
    return ids, mask


@torch.inference_mode()
def measure(target, drafter, reference: Sequence[Trajectory], k: int) -> dict:
    """Acceptance by draft position and agreement by context position on the held-out `reference`
    (the target's greedy continuations), as the module doc says."""
    accepted = [0] * k
    points = 0
    by_context: dict[str, list[int]] = {}
    top_mass: list[float] = []
    for t in reference:
        seq = torch.tensor([t.ids])
        logits = target(input_ids=seq).logits[0]
        want = logits.argmax(-1)  # [L]
        top_mass.append(float(torch.softmax(logits.float(), -1).topk(TOP_K, -1).values.sum(-1).mean()))
        got = drafter(input_ids=seq).logits[0].argmax(-1)
        last = len(t.ids) - 1
        for lo, hi in zip(CONTEXT_BUCKETS, (*CONTEXT_BUCKETS[1:], None)):
            rows = range(min(lo, last), min(hi if hi is not None else last, last))
            if rows:
                tally = by_context.setdefault(f"{lo}-{hi if hi is not None else ''}", [0, 0])
                tally[0] += int((got[rows.start : rows.stop] == want[rows.start : rows.stop]).sum())
                tally[1] += len(rows)
        for start in range(t.prompt, len(t.ids) - k, 8):  # points along the target's own continuation
            drafted = drafter.generate(
                seq[:, :start],
                attention_mask=torch.ones_like(seq[:, :start]),
                max_new_tokens=k,
                min_new_tokens=k,
                do_sample=False,
                pad_token_id=0,
            )
            same = (drafted[0, start:] == seq[0, start : start + k]).tolist()
            run = next((j for j, ok in enumerate(same) if not ok), k)
            for j in range(run):
                accepted[j] += 1
            points += 1
    return {
        "acceptance_by_position": [round(a / max(1, points), 4) for a in accepted],
        "agreement_by_context": {name: round(n / total, 4) for name, (n, total) in by_context.items()},
        "points": points,
        # What keeping only the target's top TOP_K probabilities per position would drop (they are
        # never stored here: each batch's are made from one target pass and dropped).
        f"target_top{TOP_K}_mass": round(sum(top_mass) / max(1, len(top_mass)), 4),
    }
