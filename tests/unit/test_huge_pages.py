"""Importing cascade_service has torch back its large CPU allocations (weights, KV pools) with transparent
huge pages: without them a server process's speed depended on where its pages fell, 0.76-1.19x between two
identical plain servers at 64 streams (docs/benchmarks.md, "Under load")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# A 64 MB tensor, written, then how much of the process's anonymous memory is in huge pages.
SCRIPT = """
import os, sys
if sys.argv[1] == "ours":
    import cascade_service  # noqa: F401
import torch
x = torch.empty(16 * 2**20)
x.fill_(1.0)
rollup = open("/proc/self/smaps_rollup").read()
huge_kb = int(rollup.split("AnonHugePages:")[1].split()[0])
print(os.environ.get("THP_MEM_ALLOC_ENABLE", "unset"), huge_kb)
"""


def _run(mode: str, setting: str | None = None) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if setting is not None:
        env["THP_MEM_ALLOC_ENABLE"] = setting
    run = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    value, huge_kb = run.stdout.split()
    return value, int(huge_kb)


def _kernel_offers_huge_pages() -> bool:
    """THP "always" or "madvise" (the kernel's choice is the bracketed one); "never" gives none to anyone."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[never]" not in path.read_text()


def test_a_process_that_imports_cascade_service_allocates_large_tensors_in_huge_pages():
    value, huge_kb = _run("ours")
    assert value == "1"
    if _kernel_offers_huge_pages():  # where the kernel has none to give, the setting is all there is to check
        assert huge_kb >= 32 * 1024, huge_kb


def test_without_it_torch_leaves_them_in_small_pages_where_the_kernel_waits_to_be_asked():
    # The control: torch alone asks for none; under THP "madvise" (this project's hosts) it then gets none.
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    value, huge_kb = _run("plain")
    assert value == "unset"
    if path.exists() and "[madvise]" in path.read_text():
        assert huge_kb < 32 * 1024, huge_kb


def test_an_operators_own_setting_stands():
    value, huge_kb = _run("ours", "0")
    assert value == "0"
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if path.exists() and "[madvise]" in path.read_text():
        assert huge_kb < 32 * 1024, huge_kb
