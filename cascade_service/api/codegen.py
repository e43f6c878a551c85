"""Generate the gRPC stubs in `cascade_service/api/v1/` from `protos/`, reproducibly.

    python -m cascade_service.api.codegen          # rewrite the stubs
    python -m cascade_service.api.codegen --check  # exit 1 if the committed stubs are stale

protoc writes `from cascade.v1 import cascade_pb2` into the gRPC module, an import that only works with
`protos/`'s output folder on sys.path, and names the message classes' module `cascade.v1.cascade_pb2`;
both are rewritten so the stubs live inside the package. The protoc version is part of the output, so
`--check` needs the pinned grpcio-tools.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos"
PROTOS = ("cascade/v1/cascade.proto", "cascade/v1/tier.proto")
OUT_DIR = Path(__file__).resolve().parent / "v1"
_HEADER = '"""Generated from protos/cascade/v1/*.proto by `python -m cascade_service.api.codegen`; do not edit."""\n'


def generate() -> dict[str, str]:
    """{file name: contents} of the generated stubs."""
    import grpc_tools
    from grpc_tools import protoc  # build-time tool: imported only here

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *PROTOS,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        files = {}
        for path in sorted((Path(tmp) / "cascade" / "v1").iterdir()):
            text = path.read_text()
            for module in ("cascade_pb2", "tier_pb2"):
                text = text.replace(f"from cascade.v1 import {module}", f"from . import {module}")
                # Message classes take their __module__ from this string; it must be the real module so
                # that pickling a message by reference (Ray does, between processes) finds it again.
                text = text.replace(f"'cascade.v1.{module}'", f"'cascade_service.api.v1.{module}'")
            files[path.name] = text
    files["__init__.py"] = _HEADER
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs differ")
    check = parser.parse_args(argv).check
    files = generate()
    stale = [
        name for name, text in files.items() if not (OUT_DIR / name).exists() or (OUT_DIR / name).read_text() != text
    ]
    if check:
        if stale:
            print(f"stale gRPC stubs: {', '.join(stale)}; run `python -m cascade_service.api.codegen`", file=sys.stderr)
            return 1
        return 0
    OUT_DIR.mkdir(exist_ok=True)
    for name, text in files.items():
        (OUT_DIR / name).write_text(text)
    print(f"wrote {len(files)} files to {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
