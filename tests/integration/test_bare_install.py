"""Optional dependencies are optional: with Ray, Redis and matplotlib missing, `generate` works and
what needs them fails naming the extra to install."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# Run in a child whose imports of the extras' modules fail, as on a bare `pip install cascade-service`.
BLOCK = textwrap.dedent("""
    import importlib.abc, sys

    class Bare(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("ray", "redis", "matplotlib"):
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, Bare())
    from cascade_service.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK, *args], capture_output=True, text=True, timeout=300)


def test_generate_works_without_the_extras(tiny_family):
    done = _cli(
        "generate",
        "--target",
        str(tiny_family["target"]),
        "--drafter",
        str(tiny_family["mid"]),
        "mag",
        "--k-matrix",
        "[[3, 1], [0, 3]]",
        "--prompt",
        "hello world",
        "--max-new-tokens",
        "8",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["token_ids"]) == 8


def test_what_needs_an_extra_names_it(tmp_path):
    done = _cli("serve", "--config", "configs/presets/tiny.yaml", "--frontend", "ray", "--grpc-port", "0")
    assert done.returncode == 2
    assert "pip install 'cascade-service[serve]'" in done.stderr, done.stderr
