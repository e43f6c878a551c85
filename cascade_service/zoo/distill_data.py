"""What `cascade-service distill` trains on: prompts, and the target's own continuations of them.

Prompts come from a JSON-lines file ({"prompt": "..."}, as `bench` reads them) or a folder of text and
code files cut into prompts at line starts, each a random length between two token counts (the context
lengths the drafter will serve). A fixed share, chosen by a hash of the prompt's text (so it is the
same share on every run and every resume), is held out for the report.

The sequences are on-policy (DistillSpec, Zhou et al. 2024): the target continues each training prompt
itself, greedily or by sampling at temperature 1, and the drafter learns the target's distribution
along the target's own tokens: the contexts it will draft from when the target reviews it. They are
kept on disk as JSON lines, one per prompt, written as they are made, so a stopped run continues
where it stopped and memory holds one batch of them at a time.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..prompts import read_prompts

TEXT_SUFFIXES = frozenset(
    {".py", ".pyi", ".txt", ".md", ".rst", ".c", ".h", ".cc", ".cpp", ".rs", ".go", ".java", ".js", ".ts", ".toml"}
)


@dataclass(frozen=True)
class Trajectory:
    """One training or held-out sequence: the prompt's tokens then the target's continuation."""

    ids: list[int]
    prompt: int  # how many of `ids` are the prompt's
    mode: str  # "greedy" or "sampled": how the target continued it


@dataclass(frozen=True)
class Corpus:
    """Texts already read, named for the report (a family's recipe gathers them from several places)."""

    name: str
    texts: tuple[str, ...]

    def __str__(self) -> str:
        return self.name


def source_texts(source: Path | Corpus) -> list[str]:
    """The texts prompts are cut from: the prompts of a JSON-lines file as they are, or every text or
    code file under a folder (sorted, so every run reads them in one order), or a Corpus's texts."""
    if isinstance(source, Corpus):
        if not source.texts:
            raise ValueError(f"prompts from {source.name}: no texts")
        return list(source.texts)
    if source.is_dir():
        files = sorted(p for p in source.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        texts = [p.read_text(errors="replace") for p in files]
        texts = [t for t in texts if t.strip()]
        if not texts:
            raise ValueError(f"--prompts {source}: no text or code files ({', '.join(sorted(TEXT_SUFFIXES))})")
        return texts
    if not source.is_file():
        raise ValueError(f"--prompts {source}: no such file or folder")
    return read_prompts(str(source))


def cut_prompts(
    texts: Sequence[str], tokenizer, count: int, min_tokens: int, max_tokens: int, seed: int
) -> list[list[int]]:
    """`count` prompts of min_tokens..max_tokens tokens each, from line starts of `texts` chosen at
    random (seeded); a text shorter than min_tokens gives itself whole, cut to max_tokens."""
    encoded = [tokenizer(t).input_ids for t in texts]
    usable = [ids for ids in encoded if ids]
    if not usable:
        raise ValueError("--prompts: every text encodes to no tokens")
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    newline = set(tokenizer("\n").input_ids)
    for _ in range(count):
        ids = rng.choice(usable)
        length = rng.randint(min_tokens, max_tokens)
        if len(ids) <= length:
            prompts.append(ids[-max_tokens:])
            continue
        starts = [0] + [i + 1 for i in range(len(ids) - length) if ids[i] in newline]
        start = rng.choice(starts)
        prompts.append(ids[start : start + length])
    return prompts


def held_out(prompt: Sequence[int], fraction: float) -> bool:
    """Whether a prompt is held out of training (for the report): by a hash of its tokens."""
    digest = hashlib.sha256(json.dumps(list(prompt)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def read_sequences(path: Path) -> list[Trajectory]:
    """The sequences written so far (a line cut short by a stop is dropped: it is made again)."""
    if not path.exists():
        return []
    done = []
    for line in path.read_text().splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            break
        done.append(Trajectory(item["ids"], item["prompt"], item["mode"]))
    return done


def continue_prompts(
    target,
    prompts: Sequence[list[int]],
    path: Path,
    tokens: int,
    sampled: float,
    pad_id: int,
    seed: int,
    batch: int = 8,
) -> Iterator[Trajectory]:
    """The target's continuations of `prompts`, `tokens` each, appended to `path` as they are made and
    yielded; those already in `path` (a resumed run) are yielded first and not made again. Greedy for
    the first 1 - `sampled` of every batch, sampled at temperature 1 for the rest."""
    done = read_sequences(path)
    path.write_text("".join(_line(s) for s in done))  # drops a line cut short
    yield from done
    device = next(target.parameters()).device
    with path.open("a") as out:
        for first in range(len(done), len(prompts), batch):
            group = prompts[first : first + batch]
            greedy = max(0, round(len(group) * (1 - sampled)))
            for mode, rows in (("greedy", group[:greedy]), ("sampled", group[greedy:])):
                if not rows:
                    continue
                made = _generate(target, rows, tokens, mode == "sampled", pad_id, seed + first, device)
                for prompt, continuation in zip(rows, made):
                    item = Trajectory(list(prompt) + continuation, len(prompt), mode)
                    out.write(_line(item))
                    out.flush()
                    yield item


def _generate(target, rows: Sequence[list[int]], tokens: int, sample: bool, pad_id: int, seed: int, device):
    """Each row's continuation by `target.generate`, the rows left-padded into one batch."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    options = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
    with torch.random.fork_rng(devices=[]), torch.inference_mode():
        torch.manual_seed(seed)  # sampled continuations are the same on every run
        out = target.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=tokens,
            min_new_tokens=tokens,  # a drafter learns from whole continuations, EOS or not
            pad_token_id=pad_id,
            **options,
        )
    return [row[width:].tolist() for row in out]


def _line(item: Trajectory) -> str:
    return json.dumps({"ids": item.ids, "prompt": item.prompt, "mode": item.mode}) + "\n"
