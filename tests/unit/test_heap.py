"""engine.heap: a serving process's start-up heap frozen out of the cyclic collector's walks. What was alive
at the freeze is in the permanent generation (no collection walks it) and counted on /metrics; what comes
after is collected as before, cycles included. The freeze runs in a process of its own
(tests/helpers/heap_probe.py says why)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_what_was_alive_at_the_freeze_is_left_out_and_what_comes_after_is_collected():
    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.heap_probe"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("heap probe: ok"), done.stdout
