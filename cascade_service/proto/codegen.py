"""Generate the gRPC stubs in `cascade_service/proto/` from `protos/`, reproducibly.

    python -m cascade_service.proto.codegen          # rewrite the stubs
    python -m cascade_service.proto.codegen --check  # exit 1 if the committed stubs are stale

Each proto package has its folder: cascade.v1 (the client API) in `proto/v1/`, cascade.tier.v1 (the
tier API) in `proto/tier/v1/`. protoc writes `from cascade.v1 import cascade_pb2` into the gRPC module,
an import that only works with `protos/`'s output folder on sys.path, and names the message classes'
module `cascade.v1.cascade_pb2`; both are rewritten so the stubs live inside the package. The protoc
version is part of the output, so `--check` needs the pinned grpcio-tools.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos"
STUBS_DIR = Path(__file__).resolve().parent
# proto file -> (its folder of stubs under proto/, the proto's module name)
PROTOS = {
    "cascade/v1/cascade.proto": ("v1", "cascade_pb2"),
    "cascade/tier/v1/tier.proto": ("tier/v1", "tier_pb2"),
}
_HEADER = '"""Generated from protos/{} by `python -m cascade_service.proto.codegen`; do not edit."""\n'


def generate() -> dict[Path, str]:
    """{path under proto/: contents} of the generated stubs."""
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
        files: dict[Path, str] = {}
        for proto, (folder, module) in PROTOS.items():
            package = str(Path(proto).parent).replace("/", ".")  # cascade.tier.v1
            target = "cascade_service.proto." + folder.replace("/", ".")
            for path in sorted((Path(tmp) / Path(proto).parent).glob(f"{module}*")):
                text = path.read_text().replace(f"from {package} import {module}", f"from . import {module}")
                # Message classes take their __module__ from this string; it must be the real module so
                # that pickling a message by reference (Ray does, between processes) finds it again.
                text = text.replace(f"'{package}.{module}'", f"'{target}.{module}'")
                files[Path(folder) / path.name] = text
            files[Path(folder) / "__init__.py"] = _HEADER.format(proto)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs differ")
    check = parser.parse_args(argv).check
    files = generate()
    stale = [
        str(name)
        for name, text in files.items()
        if not (STUBS_DIR / name).exists() or (STUBS_DIR / name).read_text() != text
    ]
    if check:
        if stale:
            print(
                f"stale gRPC stubs: {', '.join(stale)}; run `python -m cascade_service.proto.codegen`", file=sys.stderr
            )
            return 1
        return 0
    for name, text in files.items():
        (STUBS_DIR / name).parent.mkdir(parents=True, exist_ok=True)
        (STUBS_DIR / name).write_text(text)
    print(f"wrote {len(files)} files under {STUBS_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
