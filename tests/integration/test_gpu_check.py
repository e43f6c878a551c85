"""The GPU check (.ci/gpu-check, cascade_service/bench/gpu_check.py) is tested here, on the CPU: its quick
mode runs the same steps with every tier on the CPU and must write every row of the table with a
figure; its wheel list must carry every runtime dependency the GPU machine lacks."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from cascade_service.bench.gpu_check import (
    EAGER_METHODS,
    METHODS,
    WHEEL_LIST,
    Step,
    WheelList,
    canonical,
    main,
    pytest_rows,
    read_wheel_list,
    run_step,
    unlisted,
)

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# tests/gpu's own needs from the test extra: pytest alone (its other imports are runtime dependencies).
GPU_SUITE_NEEDS = [d for d in PYPROJECT["optional-dependencies"]["test"] if Requirement(d).name == "pytest"]


def rows_of(table: str) -> dict[str, tuple[str, str]]:
    rows = [line.strip("|").split(" | ") for line in table.splitlines()[2:]]
    return {what.strip(): (figure.strip(), command.strip()) for what, figure, command in rows}


def first_number(text: str) -> float:
    return float(re.match(r"[\d.]+", text).group(0))


@pytest.mark.slow
def test_the_quick_cpu_check_writes_every_row_with_a_positive_figure(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "cascade_service.bench.gpu_check", "--device", "cpu", "--quick", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = rows_of((out / "gpu-check.md").read_text())

    assert rows["device"][0].startswith("cpu (")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", rows["date"][0])
    assert rows["torch"][0] == torch.__version__
    assert rows["transformers"][0] == metadata.version("transformers")
    assert rows["dependencies"][0].startswith("all ") and "within pyproject.toml" in rows["dependencies"][0]
    for method in METHODS:
        figure, _ = rows[f"bench {method}"]
        assert first_number(figure) > 0, method
        # Greedy in float32 on the CPU: every method must reproduce hf-ar's tokens (the bench's own check).
        assert "identical to hf-ar" in figure, (method, figure)
        if method != "hf-ar":
            assert float(re.search(r"([\d.]+)x hf-ar", figure).group(1)) > 0, method
    assert "--methods hf-ar,ar,sd:base,suffix,csd:base+small+mag" in rows["bench hf-ar"][1]
    for tier in ("large", "base", "small"):  # the shipped family's three models, each step timed
        assert first_number(rows[f"step {tier}"][0]) > 0, tier
        assert first_number(rows[f"step {tier} (graphs off)"][0]) > 0, tier
    for method in EAGER_METHODS:  # the same family with its fixed-shape passes off, in the same call
        assert "identical to hf-ar" in rows[f"bench {method} (graphs off)"][0], method
    assert "eager.yaml" in rows["bench hf-ar (graphs off)"][1]
    for streams in ("1 stream", "8 streams"):
        assert first_number(rows[f"served cascade-adaptive / plain, {streams}"][0]) > 0, streams
    for mode in ("cascade-adaptive", "plain"):
        figure = rows[f"served {mode}, 1 / 8 streams"][0]
        assert first_number(figure) > 0 and figure.endswith(", 0 errors"), figure
    assert "--concurrency 1,8" in rows["served cascade-adaptive / plain, 1 stream"][1]
    # No CUDA here: the suite ran and skipped every test, saying why.
    suite = rows["pytest -m gpu"][0]
    assert suite.startswith("0 passed, 0 failed, ") and int(re.search(r"(\d+) skipped", suite).group(1)) > 0, suite
    assert "needs CUDA" in rows["pytest skipped"][0]
    # What comes back from a device call: at most 8 files of at most 16 MiB.
    files = sorted(p.name for p in out.iterdir())
    assert {"gpu-check.md", "bench.log", "eager.log", "load.log", "pytest.log", "bench-results.json"} <= set(files)
    assert len(files) <= 8 and all((out / f).stat().st_size < 16 << 20 for f in files), files


def test_without_cuda_the_check_says_so_and_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU host, also on a GPU one
    monkeypatch.chdir(ROOT)
    assert main(["--device", "cuda", "--out", str(tmp_path)]) == 1
    rows = rows_of((tmp_path / "gpu-check.md").read_text())
    assert rows["device"][0] == "cuda requested: torch.cuda.is_available() is false"
    assert not [what for what in rows if what.startswith(("bench", "served", "pytest"))]  # nothing ran


def test_a_step_past_its_limit_is_stopped_with_its_children(tmp_path):
    # The load bench's servers are the step's children: a timeout must end them too, not orphan them.
    step = Step("sleeper", ["bash", "-c", "sleep 60 & echo child $!; wait"], tmp_path / "sleeper.log")
    run_step(step, 1.0, tmp_path)
    assert step.rc is None and step.seconds < 30 and step.failure().startswith("sleeper timed out after")
    child = re.search(r"child (\d+)", step.log.read_text()).group(1)
    stat = Path(f"/proc/{child}/stat")

    def gone() -> bool:  # exited (a zombie until its new parent reaps it) or reaped
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + 5  # the signal reaches the child at once, its exit may take a moment
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone()


def test_a_stopped_suite_is_counted_from_its_progress_and_a_finished_one_from_its_summary():
    stopped = Step("pytest", ["pytest"], Path("pytest.log"), rc=None, seconds=300)
    figure = pytest_rows("$ pytest\n..F.s..\n.E\n", stopped, "cmd")[0][1]
    assert figure.startswith("6 passed, 1 failed, 1 skipped, 1 error in 300 s (pytest timed out")
    finished = Step("pytest", ["pytest"], Path("pytest.log"), rc=1, seconds=200)
    log = (
        "FAILED tests/gpu/test_gpu_lean.py::test_lean[bfloat16] - AssertionError\n"
        "SKIPPED [1] tests/gpu/test_gpu_service.py:66: Ray is not importable here\n"
        "43 passed, 1 failed, 1 skipped in 200.12s (0:03:20)\n"
    )
    rows = pytest_rows(log, finished, "cmd")
    assert rows[0][1] == "43 passed, 1 failed, 1 skipped, 0 error in 200 s"
    assert rows[1][1] == "tests/gpu/test_gpu_lean.py::test_lean[bfloat16]"
    assert rows[2][1] == "1: Ray is not importable here"


def test_every_runtime_dependency_the_gpu_machine_lacks_has_a_pinned_wheel():
    wheels = read_wheel_list((ROOT / WHEEL_LIST).read_text())
    needed = [*PYPROJECT["dependencies"], *GPU_SUITE_NEEDS]
    assert unlisted(needed, wheels) == []
    # Each pin is a version pyproject.toml admits, and nothing is both provided and carried.
    ranges = {canonical(Requirement(d).name): Requirement(d).specifier for d in needed}
    for name, version in wheels.groups["base"].items():
        assert name not in wheels.provided, name
        if name in ranges:
            assert ranges[name].contains(version, prereleases=True), (name, version, str(ranges[name]))
    # The Ray group holds Ray itself; what it needs is checked by the fetch (pip's --no-deps names each).
    assert "ray" in wheels.groups["ray"]


def test_a_new_dependency_or_a_dropped_pin_is_caught():
    # Negative controls for the test above: the check is not vacuous.
    wheels = read_wheel_list((ROOT / WHEEL_LIST).read_text())
    assert unlisted([*PYPROJECT["dependencies"], "brand-new-lib>=1"], wheels) == ["brand-new-lib"]
    without_grpcio = WheelList(
        wheels.provided, {"base": {k: v for k, v in wheels.groups["base"].items() if k != "grpcio"}}
    )
    assert unlisted(PYPROJECT["dependencies"], without_grpcio) == ["grpcio"]
    with pytest.raises(ValueError, match=r"line 2: expected `provided NAME` or `GROUP NAME==VERSION`"):
        read_wheel_list("# a comment\nbase grpcio>=1.85\n")
