"""The trained family shipped with the package (`cascade_service/zoo/families/<name>/`), so that the demo
and the shipped configs need no training.

A shipped family is a zoo as `zoo build` writes it (large/, base/, small/ as Hugging Face directories
in safetensors, float32, exactly as trained; bigram.json; prompts; report.json) plus `MANIFEST.json`:
every file's size and SHA-256, and the recipe (preset and builder version) that made it. Loading
checks the manifest, so a truncated checkout or a file changed by hand fails at once with the file's
name, never as a strange model. `cascade-service zoo ship DIR` copies a built zoo in and writes the
manifest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from ..paths import families

MANIFEST = "MANIFEST.json"
SHIPPED = "quality"  # the family the demo and the shipped configs use
# What a zoo directory holds that is shipped (zoo.json, the build's cache stamp, is machine-specific).
_KEEP = ("large", "base", "small", "bigram.json", "prompts.jsonl", "tune_prompts.jsonl", "report.json")


class ShippedFamilyError(RuntimeError):
    """A shipped family is missing or does not match its manifest; the message names the file."""


def family_dir(name: str = SHIPPED) -> Path:
    return families() / name


def shipped_zoo(name: str = SHIPPED) -> dict[str, Path]:
    """The shipped family's paths, as `zoo.build.build_zoo` returns a built zoo's, after checking the
    manifest (sizes and SHA-256 of every file)."""
    root = family_dir(name)
    verify(root)
    return zoo_paths(root)


def zoo_paths(root: Path) -> dict[str, Path]:
    """The paths of the family (a built zoo, or a shipped one) in `root`, by key."""
    return {tier: root / tier for tier in ("large", "base", "small")} | {
        "bigram": root / "bigram.json",
        "report": root / "report.json",
        "prompts": root / "prompts.jsonl",
        "tune_prompts": root / "tune_prompts.jsonl",
    }


def verify(root: Path) -> dict:
    """The manifest of the family in `root`, once every file it lists is there with its size and hash,
    and nothing else is."""
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ShippedFamilyError(f"{root / MANIFEST}: cannot read the shipped family's manifest ({exc})") from None
    files = manifest.get("files", {})
    for rel, expected in files.items():
        path = root / rel
        if not path.is_file():
            raise ShippedFamilyError(f"{path}: listed in {MANIFEST} but missing")
        if path.stat().st_size != expected["size"] or sha256(path) != expected["sha256"]:
            raise ShippedFamilyError(
                f"{path}: does not match {MANIFEST} (size or SHA-256 differs; a partial checkout, or a "
                "file changed after it was shipped)"
            )
    extra = sorted(str(p.relative_to(root)) for p in _files(root) if str(p.relative_to(root)) not in files)
    if extra:
        raise ShippedFamilyError(f"{root / extra[0]}: not in {MANIFEST}")
    return manifest


def ship(built: Path, name: str = SHIPPED) -> Path:
    """Copy a built zoo into the package as family `name` and write its manifest."""
    report = json.loads((built / "report.json").read_text())
    stamp = json.loads((built / "zoo.json").read_text())
    root = family_dir(name)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for item in _KEEP:
        source = built / item
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, root / item)
    files = {str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": sha256(p)} for p in sorted(_files(root))}
    manifest = {
        "family": name,
        "preset": report["preset"],
        # a trained zoo's recipe version and corpus; a family made from another, that one's weights
        **{key: stamp[key] for key in ("builder", "corpus_sha256", "source") if key in stamp},
        "built_with": {k: stamp[k] for k in ("python", "torch", "transformers")},
        "files": files,
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return root


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


HELP = "ship a built zoo with the package: copy it into zoo/families/<name> and write its manifest"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("built", help="the built zoo's directory, e.g. $CASCADE_SERVICE_HOME/zoo/quality")
    parser.add_argument("--name", default=SHIPPED, help=f"the family's name in the package (default {SHIPPED})")


def run(args: argparse.Namespace) -> int:
    root = ship(Path(args.built), args.name)
    size = sum(p.stat().st_size for p in _files(root))
    print(f"shipped {args.built} as {root} ({size / 1e6:.1f} MB)", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cascade_service.zoo.shipped`: the same as `cascade-service zoo ship`."""
    parser = argparse.ArgumentParser(prog="python -m cascade_service.zoo.shipped", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
