"""The GPU check (`.ci/gpu-check run`, docs/devices.md "GPU check"): in one call on a GPU machine, the
shipped family's methods with every tier on the device (hf-ar and ar again with `graphs: off`: what
the captured passes change), the load bench at 1 and 8 streams and the GPU suite, written as one
table (gpu-check.md) with the raw logs beside it.

    python -m cascade_service.bench.gpu_check --device cuda --out DIR [--quick]

Each step is a subprocess with its own time limit, so the whole check ends inside one device call
(8 minutes) and a hung step costs only its share. `--device cpu --quick` runs the same steps on the
CPU with tiny settings: the plumbing is tested where no GPU is (tests/integration/test_gpu_check.py).
Run it from the repository's root (it reads configs/, tests/gpu and pyproject.toml).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import yaml

from ..paths import families

METHODS = ("hf-ar", "ar", "sd:base", "suffix", "csd:base+small+mag")
EAGER_METHODS = ("hf-ar", "ar")  # again with `graphs: off`: what the captured passes changed, one run apart
LOAD_MODE = "cascade-adaptive"  # the cascade adapting to load, against plain decoding of its target
STREAMS = (1, 8)
WHEEL_LIST = ".ci/gpu-wheels.txt"


@dataclass(frozen=True)
class Settings:
    prompts: int  # the first N of the shipped family's prompts.jsonl (code it never saw in training)
    max_new_tokens: int
    repeats: int
    sd_ks: str  # sd:base's k sweep; its fastest k is reported
    load_s: float  # seconds per load level (each server also warms up for min(5, this))
    budget_s: float  # the whole check; the suite gets what the benches leave
    bench_s: float  # the methods bench's cap
    eager_s: float  # the graphs-off bench's cap
    load_cap_s: float  # the load bench's cap (two servers' start-up included)


FULL = Settings(6, 64, 2, "2,3,4", 10.0, 480.0, 120.0, 45.0, 110.0)
QUICK = Settings(2, 8, 1, "3", 1.0, 240.0, 100.0, 60.0, 100.0)


@dataclass
class Step:
    name: str
    command: list[str]
    log: Path
    rc: int | None = None  # None: timed out
    seconds: float = 0.0

    def shown(self, work: Path) -> str:
        words = ["python", *self.command[1:]] if self.command[0] == sys.executable else self.command
        return shlex.join(words).replace(str(work), "WORK")

    def failure(self) -> str | None:
        if self.rc is None:
            return f"{self.name} timed out after {self.seconds:.0f} s (see {self.log.name})"
        return f"{self.name} exited with {self.rc} (see {self.log.name})" if self.rc else None


def run_step(step: Step, limit_s: float, root: Path) -> Step:
    # A session of its own, so a timeout ends the step's children too (the load bench's servers).
    start = time.monotonic()
    with step.log.open("w") as log:
        log.write(f"$ {shlex.join(step.command)}\n")
        log.flush()
        proc = subprocess.Popen(step.command, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            step.rc = proc.wait(timeout=max(limit_s, 1.0))
        except subprocess.TimeoutExpired:
            for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
                os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
            step.rc = None
    step.seconds = time.monotonic() - start
    print(f"{step.name}: {'timed out' if step.rc is None else f'rc {step.rc}'} in {step.seconds:.0f} s", flush=True)
    return step


def environment(device: str, root: Path) -> tuple[list[tuple[str, str]], bool]:
    """The table's first rows, and whether the device asked for is there."""
    import torch

    cuda = torch.cuda.is_available()
    if device == "cpu":
        shown = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    elif cuda:
        shown = f"{device}: {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} devices)"
    else:
        shown = f"{device} requested: torch.cuda.is_available() is false"
    rows = [
        ("device", shown),
        ("date", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("CUDA", f"{torch.version.cuda} (available: {'yes' if cuda else 'no'})" if torch.version.cuda else "none"),
        ("transformers", metadata.version("transformers")),
        ("dependencies", dependencies(root)),
        ("ray", _version("ray") or "not installed: the Ray GPU test is skipped (docs/devices.md)"),
    ]
    return rows, device == "cpu" or cuda


def dependencies(root: Path) -> str:
    """Whether every runtime dependency in pyproject.toml is installed within its range."""
    from packaging.requirements import Requirement  # transformers' own dependency

    wanted = [Requirement(d) for d in tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]]
    found = {r.name: _version(r.name) for r in wanted}
    off = [
        f"{r.name} {found[r.name] or 'missing'} (wants {r.specifier})"
        for r in wanted
        if not r.specifier.contains(found[r.name] or "0.dev0", prereleases=True) or not found[r.name]
    ]
    return "outside pyproject.toml's ranges: " + ", ".join(off) if off else f"all {len(wanted)} within pyproject.toml"


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def with_device(source: Path, device: str, dest: Path, **model: str) -> Path:
    """`source` with `model: {device: ...}` (and `model`'s other keys) set, the defaults of every tier
    that names none."""
    raw = yaml.safe_load(source.read_text())
    raw.setdefault("model", {}).update(device=device, **model)
    dest.write_text(yaml.safe_dump(raw, sort_keys=False))
    return dest


def bench_rows(
    results: dict, command: str, names: Sequence[str] = METHODS, label: str = ""
) -> list[tuple[str, str, str]]:
    methods, rows = results["methods"], list[tuple[str, str, str]]()
    for name in names:
        m = methods[name]
        figure = f"{m['tokens_per_s']:.1f} tok/s"
        if name != "hf-ar":
            figure += f", {m['speedup_vs_hf_ar']:.2f}x hf-ar"
        if name not in ("hf-ar", "ar"):
            figure += f", {m['speedup_vs_ar']:.2f}x ar, {m['mean_accepted_length']:.2f} tokens per target call"
        if "best_k" in m:
            figure += f", best k {m['best_k']}"
        if m["orchestration_per_round_ms"]:
            figure += f", orchestration {m['orchestration_per_round_ms']:.2f} ms a round"
        figure += {True: ", identical to hf-ar", False: ", DIFFERS from hf-ar", None: ""}[m["identical_to_hf_ar"]]
        rows.append((f"bench {name}{label}", figure, command if not rows else "same run"))
    for tier, cost in results["tier_costs"].items():
        step = cost["step_ms"]
        shown = (
            f"{step['1']:.3f} ms at 1 row, {step['16']:.3f} ms at 16 ({cost['backend']}, {cost['params'] / 1e6:.2f}M)"
        )
        rows.append((f"step {tier}{label}", shown, "same run"))
    return rows


def eager_rows(results: dict, command: str) -> list[tuple[str, str, str]]:
    return bench_rows(results, command, EAGER_METHODS, " (graphs off)")


def load_rows(results: dict, command: str) -> list[tuple[str, str, str]]:
    from .load import RATIOS

    ratios = results["summary"][RATIOS[LOAD_MODE]]
    speed = {(r["mode"], r["concurrency"]): r for r in results["runs"]}
    rows = [
        (
            f"served {LOAD_MODE} / plain, {n} stream{'s' * (n > 1)}",
            f"{ratios[str(n)]:.2f}x",
            command if i == 0 else "same run",
        )
        for i, n in enumerate(STREAMS)
    ]
    for mode in (LOAD_MODE, "plain"):
        per = [speed[(mode, n)] for n in STREAMS]
        scaling = results["summary"]["over_single_stream"][mode][str(STREAMS[-1])]
        shown = " / ".join(f"{r['tokens_per_s']:.1f}" for r in per) + f" tok/s ({scaling:.2f}x from 1 to {STREAMS[-1]})"
        errors = sum(r["errors"] for r in per)
        rows.append(
            (f"served {mode}, {' / '.join(map(str, STREAMS))} streams", shown + f", {errors} errors", "same run")
        )
    return rows


def pytest_rows(log: str, step: Step, command: str) -> list[tuple[str, str, str]]:
    """The suite's counts from pytest's summary (or its progress dots, when it was stopped)."""
    summary = next((line for line in reversed(log.splitlines()) if re.search(r"\d+ \w+.* in [\d.]+s", line)), "")
    counts = {
        word.rstrip("s"): int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", summary)
    }
    if not summary:  # stopped before its summary: count the progress characters so far
        dots = "".join(m.group(1) for m in re.finditer(r"^([.FEsxX]+)(?:\s+\[\s*\d+%\])?$", log, re.MULTILINE))
        counts = {
            "passed": dots.count("."),
            "failed": dots.count("F"),
            "skipped": dots.count("s"),
            "error": dots.count("E"),
        }
    shown = ", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "failed", "skipped", "error"))
    shown += f" in {step.seconds:.0f} s" + (f" ({step.failure()})" if step.rc not in (0, 1) else "")
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", log, re.MULTILINE)
    skipped = re.findall(r"^SKIPPED \[(\d+)\] \S+: (.*)$", log, re.MULTILINE)
    reasons: dict[str, int] = {}
    for n, reason in skipped:
        reasons[reason] = reasons.get(reason, 0) + int(n)
    return [
        ("pytest -m gpu", shown, command),
        ("pytest failed", ", ".join(failed) or "none", "same run"),
        ("pytest skipped", "; ".join(f"{n}: {r}" for r, n in reasons.items()) or "none", "same run"),
    ]


def table(rows: Sequence[tuple[str, str, str]]) -> str:
    lines = ["| what | figure | command |", "|---|---|---|"]
    lines += [
        f"| {what} | {figure} | {f'`{cmd}`' if cmd.startswith('python') else cmd} |" for what, figure, cmd in rows
    ]
    return "\n".join(lines) + "\n"


def steps(device: str, s: Settings, root: Path, work: Path, out: Path) -> tuple[Step, Step, Step, Step]:
    """The methods bench, the same with graphs off (hf-ar and ar), the load bench and the suite, each
    on `device`, their outputs under `work`."""
    cli = [sys.executable, "-m", "cascade_service.cli", "bench"]
    prompts = work / "prompts.jsonl"
    held_out = (families() / "quality" / "prompts.jsonl").read_text().splitlines()
    prompts.write_text("\n".join(held_out[: s.prompts]) + "\n")
    bench_config = with_device(root / "configs" / "bench-quality.yaml", device, work / "bench-quality.yaml")
    eager_config = with_device(root / "configs" / "bench-quality.yaml", device, work / "eager.yaml", graphs="off")
    load_config = with_device(root / "configs" / "demo.yaml", device, work / "demo.yaml")
    methods = [*cli, "methods", "--prompts", str(prompts), "--max-new-tokens", str(s.max_new_tokens)]
    methods += ["--repeats", str(s.repeats)]
    bench = Step(
        "bench",
        [*methods, "--config", str(bench_config), "--tuned", "configs/demo.yaml", "--methods", ",".join(METHODS)]
        + ["--sd-k-sweep", s.sd_ks, "--out", str(work / "bench")],
        out / "bench.log",
    )
    eager = Step(
        "bench-eager",
        [*methods, "--config", str(eager_config), "--methods", ",".join(EAGER_METHODS), "--out", str(work / "eager")],
        out / "eager.log",
    )
    load = Step(
        "load",
        [*cli, "load", "--config", str(load_config), "--modes", f"{LOAD_MODE},plain"]
        + ["--concurrency", ",".join(map(str, STREAMS)), "--duration", str(s.load_s)]
        + ["--max-new-tokens", str(s.max_new_tokens), "--out", str(work / "load")],
        out / "load.log",
    )
    suite = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider"]
    return bench, eager, load, Step("pytest", suite, out / "pytest.log")


KEPT = {
    "bench/results.json": "bench-results.json",
    "bench/results.md": "bench-results.md",
    "load/load.json": "load.json",
}


def check(device: str, out: Path, settings: Settings, root: Path) -> int:
    """Run the check, write gpu-check.md and the raw logs to `out`; 0 when every step ran clean."""
    deadline = time.monotonic() + settings.budget_s
    out.mkdir(parents=True, exist_ok=True)
    env_rows, present = environment(device, root)
    rows: list[tuple[str, str, str]] = [(what, figure, "") for what, figure in env_rows]
    failures = [] if present else [f"no {device} here"]
    if present:
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
            failures += measure(device, settings, root, Path(work), out, deadline, rows)
    text = table(rows)
    (out / "gpu-check.md").write_text(text)
    print(text, end="")
    for failure in failures:
        print(f"not clean: {failure}", file=sys.stderr)
    return 1 if failures else 0


def measure(
    device: str,
    settings: Settings,
    root: Path,
    work: Path,
    out: Path,
    deadline: float,
    rows: list[tuple[str, str, str]],
) -> list[str]:
    """The three steps, their rows appended to `rows`; returns what did not run clean."""
    bench, eager, load, suite = steps(device, settings, root, work, out)
    rows.append(("configs", f"WORK/bench-quality.yaml, WORK/demo.yaml: configs/ with model.device {device}", ""))
    rows.append(("configs, graphs off", "WORK/eager.yaml: WORK/bench-quality.yaml with model.graphs off", ""))
    failures = []
    # The benches first: they are short and their figures are what the check is for; the suite, the
    # longest step (200 s on an H200), gets what they leave of the budget.
    for step, cap, produced, produce in (
        (bench, settings.bench_s, work / "bench" / "results.json", bench_rows),
        (eager, settings.eager_s, work / "eager" / "results.json", eager_rows),
        (load, settings.load_cap_s, work / "load" / "load.json", load_rows),
    ):
        run_step(step, min(cap, deadline - time.monotonic()), root)
        try:
            rows += produce(json.loads(produced.read_text()), step.shown(work))
        except (OSError, KeyError, ValueError) as exc:
            rows.append((step.name, f"missing: {step.failure() or repr(exc)}", step.shown(work)))
        if step.rc != 0 or rows[-1][0] == step.name:  # a failed step, or one that left no figures
            failures.append(f"{step.name}: {step.failure() or 'no figures'}")
    for kept, name in KEPT.items():  # the raw results beside the table (a device call brings back 8 files)
        if (work / kept).exists():
            (out / name).write_bytes((work / kept).read_bytes())
    run_step(suite, deadline - time.monotonic(), root)
    rows += pytest_rows(suite.log.read_text(), suite, suite.shown(work))
    if suite.rc != 0:  # 1: some tests failed; anything else: pytest itself did not finish
        failures.append(suite.failure() or "")
    return failures


@dataclass(frozen=True)
class WheelList:
    """.ci/gpu-wheels.txt: what the GPU machine's image provides, and the wheels to carry by group."""

    provided: frozenset[str]
    groups: dict[str, dict[str, str]]  # group -> {name: version}


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    from packaging.utils import canonicalize_name  # transformers' own dependency

    return str(canonicalize_name(name))


def read_wheel_list(text: str) -> WheelList:
    provided: set[str] = set()
    groups: dict[str, dict[str, str]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if words[0] == "provided" and len(words) == 2:
            provided.add(canonical(words[1]))
        elif len(words) == 2 and re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+", words[1]):
            name, version = words[1].split("==")
            groups.setdefault(words[0], {})[canonical(name)] = version
        else:
            raise ValueError(f"{WHEEL_LIST} line {n}: expected `provided NAME` or `GROUP NAME==VERSION`, got {line!r}")
    return WheelList(frozenset(provided), groups)


def unlisted(dependencies: Sequence[str], wheels: WheelList) -> list[str]:
    """Dependencies (pyproject.toml strings) the machine neither provides nor gets a `base` wheel of."""
    from packaging.requirements import Requirement

    carried = wheels.groups.get("base", {})
    names = [canonical(Requirement(d).name) for d in dependencies]
    return [name for name in names if name not in wheels.provided and name not in carried]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cascade_service.bench.gpu_check", description=__doc__)
    parser.add_argument("--device", default="cuda", help="every tier's device: cuda, cuda:N or cpu")
    parser.add_argument("--out", default="out/gpu-check", help="where gpu-check.md and the raw logs go")
    parser.add_argument("--quick", action="store_true", help="tiny settings: 2 prompts, 8 tokens, 1 s load levels")
    args = parser.parse_args(argv)
    root = Path.cwd()
    if not (root / "configs" / "bench-quality.yaml").exists() or not (root / "tests" / "gpu").is_dir():
        parser.error(f"run from the repository's root (configs/ and tests/gpu/), not {root}")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        parser.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    return check(args.device, Path(args.out), QUICK if args.quick else FULL, root)


if __name__ == "__main__":
    sys.exit(main())
