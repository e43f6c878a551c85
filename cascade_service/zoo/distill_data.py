"""What `cascade-service distill` trains on: prompts, and the target's own continuations of them.

Prompts come from a JSON-lines file ({"prompt": "..."}, as `bench` reads them) or a folder of text and
code files cut into prompts at line starts, each a random length between two token counts (the context
lengths the drafter will serve). The report measures on code the drafter never trained on: whole
packages are held out, never windows of the files it trains on (a window of a file trained on is not
held out: the rest of the file, its names and its idioms were seen). A folder's package is each entry
directly under it (a folder, with everything under it; a file directly under it counts alone); a
JSON-lines prompt's is the package its "source" names ("<package> <version>: <module>", as the
benchmarks' prompt sets say), else the prompt alone. Which packages are held out is chosen by a hash of
their names, so it is the same on every run and every resume (`split_by_package`).

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
    """Texts already read, named for the report (a family's recipe gathers them from several places),
    with the package each comes from (`packages`, one per text; empty: each text is a package alone)."""

    name: str
    texts: tuple[str, ...]
    packages: tuple[str, ...] = ()

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
        return [text for _, text in _folder(source)]
    if not source.is_file():
        raise ValueError(f"--prompts {source}: no such file or folder")
    return read_prompts(str(source))


def _folder(source: Path) -> list[tuple[Path, str]]:
    """The text and code files under a folder that are not blank, sorted, with their texts."""
    files = sorted(p for p in source.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    read = [(p, p.read_text(errors="replace")) for p in files]
    read = [(p, t) for p, t in read if t.strip()]
    if not read:
        raise ValueError(f"--prompts {source}: no text or code files ({', '.join(sorted(TEXT_SUFFIXES))})")
    return read


def source_units(source: Path | Corpus) -> tuple[list[str], list[str]]:
    """`source_texts(source)` and the package each text comes from (see the module doc)."""
    if isinstance(source, Corpus):
        texts = source_texts(source)
        if source.packages and len(source.packages) != len(texts):
            raise ValueError(f"{source.name}: {len(source.packages)} package names for {len(texts)} texts")
        return texts, list(source.packages) or [f"{source.name}[{i}]" for i in range(len(texts))]
    if source.is_dir():
        read = _folder(source)
        return [t for _, t in read], [p.relative_to(source).parts[0] for p, _ in read]
    texts = source_texts(source)
    packages = []
    for number, line in enumerate(source.read_text().splitlines(), 1):
        if line.strip():  # as read_prompts skips blank lines
            named = json.loads(line).get("source")
            word = named.split()[0].rstrip(":") if isinstance(named, str) and named.split() else ""
            packages.append(word or f"line {number}")
    return texts, packages


def split_by_package(
    texts: Sequence[str], packages: Sequence[str], fraction: float, name: str
) -> tuple[tuple[list[str], list[str]], tuple[list[str], list[str]]]:
    """(texts, packages) to train on and (texts, packages) held out: whole packages, taken in the order of
    a hash of their names while the held-out texts stay within `fraction` of all (at least one package
    held out, at least one trained on). `name` names the source in errors."""
    sizes: dict[str, int] = {}
    for package in packages:
        sizes[package] = sizes.get(package, 0) + 1
    order = sorted(sizes, key=lambda p: hashlib.sha256(p.encode()).digest())
    held: set[str] = set()
    count = 0
    for package in order:
        if count + sizes[package] <= fraction * len(texts):
            held.add(package)
            count += sizes[package]
    if not held and fraction > 0:
        held = {min(order, key=lambda p: sizes[p])}  # the smallest; the first by hash among equals
    if not held or len(held) == len(sizes):
        raise ValueError(
            f"--prompts {name}: {len(sizes)} package(s) at --held-out {fraction}; the report holds whole "
            "packages out of training, so it needs at least two and a share above 0 (or give --report-prompts)"
        )
    train = [(t, p) for t, p in zip(texts, packages) if p not in held]
    out = [(t, p) for t, p in zip(texts, packages) if p in held]
    return ([t for t, _ in train], [p for _, p in train]), ([t for t, _ in out], [p for _, p in out])


def cut_prompts(
    texts: Sequence[str], tokenizer, count: int, min_tokens: int, max_tokens: int, seed: int
) -> list[list[int]]:
    """`count` prompts of min_tokens..max_tokens tokens each, from line starts of `texts` chosen at
    random (seeded); a text shorter than min_tokens gives itself whole, cut to max_tokens."""
    sourced = cut_sourced_prompts(texts, [""] * len(texts), tokenizer, count, min_tokens, max_tokens, seed)
    return [ids for ids, _ in sourced]


def cut_sourced_prompts(
    texts: Sequence[str],
    packages: Sequence[str],
    tokenizer,
    count: int,
    min_tokens: int,
    max_tokens: int,
    seed: int,
) -> list[tuple[list[int], str]]:
    """`cut_prompts`, each prompt with the package of the text it was cut from."""
    encoded = [(tokenizer(t).input_ids, p) for t, p in zip(texts, packages)]
    usable = [(ids, p) for ids, p in encoded if ids]
    if not usable:
        raise ValueError("--prompts: every text encodes to no tokens")
    rng = random.Random(seed)
    prompts: list[tuple[list[int], str]] = []
    newline = set(tokenizer("\n").input_ids)
    for _ in range(count):
        ids, package = rng.choice(usable)
        length = rng.randint(min_tokens, max_tokens)
        if len(ids) <= length:
            prompts.append((ids[-max_tokens:], package))
            continue
        starts = [0] + [i + 1 for i in range(len(ids) - length) if ids[i] in newline]
        start = rng.choice(starts)
        prompts.append((ids[start : start + length], package))
    return prompts


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
