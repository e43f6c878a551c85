"""The `cascade-service bench` and `zoo` command trees (issue 59 point 16): `bench --help` lists every
subcommand with its one line, each subcommand's --help works, the old mode flags (`bench --load ...`)
still run the subcommand they became and say so, and every `python -m cascade_service.bench.<tool>` or
`zoo.<tool>` entry point still parses and runs as its subcommand does. Nothing here runs a benchmark."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from cascade_service.bench.cli import MODES, OLD_FLAGS, SUBCOMMANDS
from cascade_service.bench.tools import TOOLS
from cascade_service.cli.main import ZOO_TOOLS, build_parser, main
from cascade_service.cli.parser import UsageError

ROOT = Path(__file__).resolve().parents[2]
HELP_LINES = {**MODES, **{tool.name: tool.help for tool in TOOLS}}


@pytest.fixture(autouse=True)
def _wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps help to the terminal's width, at hyphens too


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    out, err = capsys.readouterr()
    assert err == ""
    return " ".join(out.split())


def test_bench_help_lists_every_subcommand_with_its_line(capsys):
    shown = _help(capsys, "bench")
    assert list(HELP_LINES) == list(SUBCOMMANDS)
    for name, line in HELP_LINES.items():
        assert f" {name} {line}" in shown, name
        assert "\n" not in line and len(line) <= 110, name  # one line each
    assert "no subcommand is `bench methods FLAGS`" in shown


def test_every_benchmark_a_user_runs_is_a_subcommand():
    # A module of bench/ or zoo/ with a `python -m` main is a subcommand too, except the two that are
    # not a user's: the GPU check (a CI tool, `.ci/gpu-check`) and the in-process baseline's child.
    mains = {
        f"{package}.{path.stem}"
        for package in ("bench", "zoo")
        for path in (ROOT / "cascade_service" / package).glob("*.py")
        if 'if __name__ == "__main__":' in path.read_text()
    }
    folded = {f"bench.{tool.module}" for tool in TOOLS} | {f"zoo.{module}" for module, _ in ZOO_TOOLS.values()}
    assert mains - folded == {"bench.gpu_check", "bench.inprocess"}, "add it to bench/tools.py or cli/main.py"
    assert folded <= mains


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_bench_subcommand_has_a_help_saying_what_it_is_for(capsys, name):
    shown = _help(capsys, "bench", name)
    assert shown.startswith(f"usage: cascade-service bench {name} ") and HELP_LINES[name] in shown


@pytest.mark.parametrize("name", ZOO_TOOLS)
def test_each_zoo_tool_is_listed_and_has_a_help(capsys, name):
    _, line = ZOO_TOOLS[name]
    assert f" {name} {line}" in _help(capsys, "zoo")
    shown = _help(capsys, "zoo", name)
    assert shown.startswith(f"usage: cascade-service zoo {name} ") and line in shown


def _parsed(*argv: str) -> dict:
    return vars(build_parser().parse_args(list(argv)))


CONFIG = ["--config", "c.yaml", "--prompts", "p.jsonl", "--out", "o"]
TARGET = ["--target", "127.0.0.1:1", "--out", "o"]
OLD_AND_NEW = {  # what a script written before the subcommands passes -> what it means now
    "methods": ([*CONFIG, "--methods", "ar,sd:small"], ["methods", *CONFIG, "--methods", "ar,sd:small"]),
    "lossy": (["--lossy", *CONFIG, "--rules", "lossy"], ["lossy", *CONFIG, "--rules", "lossy"]),
    "adaptive": ([*CONFIG, "--adaptive", "--drafter", "base"], ["adaptive", *CONFIG, "--drafter", "base"]),
    "load": (["--load", *TARGET, "--duration", "5"], ["load", *TARGET, "--duration", "5"]),
    "idle": ([*TARGET, "--levels", "8", "--idle"], ["idle", *TARGET, "--levels", "8"]),
}


@pytest.mark.parametrize("mode", OLD_AND_NEW)
def test_the_old_mode_flags_run_the_subcommand_they_became(capsys, mode):
    old, new = OLD_AND_NEW[mode]
    got = _parsed("bench", *old)
    assert got == _parsed("bench", *new) and got["bench_command"] == mode  # the same namespace: the same run
    err = capsys.readouterr().err
    if mode == "methods":  # `bench` with no subcommand is `bench methods`, with no note
        assert err == ""
    else:  # an old mode flag still runs, and names the subcommand to use from now on
        assert err == f"cascade-service bench: --{mode} is now `cascade-service bench {mode}`; running that\n"


def test_old_mode_flags_together_are_a_usage_error_naming_the_subcommands():
    with pytest.raises(UsageError, match=r"`cascade-service bench lossy` or `cascade-service bench load`") as err:
        _parsed("bench", "--lossy", *CONFIG, "--load")
    assert err.value.prog == "cascade-service bench"
    assert set(OLD_FLAGS) == {"--lossy", "--adaptive", "--load", "--idle"}


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["bench"], "required: SUBCOMMAND"),
        (["bench", "frob"], "invalid choice: 'frob'"),
        (["bench", "lossy", *CONFIG, "--methods", "ar"], "unrecognized arguments: --methods ar"),  # a mode's own flags
        (["bench", "load", "--out", "o", "--repeats", "2"], "unrecognized arguments: --repeats 2"),
        (["bench", "methods", "--config", "c.yaml"], "required: --prompts, --methods, --out"),
    ],
)
def test_bad_bench_invocations_exit_2_with_one_line(capsys, argv, needle):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and needle in err, err


TOOL_MODULES = [(f"cascade_service.bench.{tool.module}", ["bench", tool.name], tool.help) for tool in TOOLS]
TOOL_MODULES += [(f"cascade_service.zoo.{module}", ["zoo", name], line) for name, (module, line) in ZOO_TOOLS.items()]


@pytest.mark.parametrize(("module", "command", "line"), TOOL_MODULES, ids=[m for m, _, _ in TOOL_MODULES])
def test_python_m_entry_points_are_their_subcommands(capsys, module, command, line):
    tool = importlib.import_module(module)
    with pytest.raises(SystemExit) as exit_:
        tool.main(["--help"])
    assert exit_.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"usage: python -m {module} ") and line in shown
    assert getattr(tool, "HELP", line) == line  # a zoo module's own line is the one `zoo --help` lists
    # The same flags, the same help, under either name.
    prog = f"cascade-service {' '.join(command)}"
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    assert capsys.readouterr().out == shown.replace(f"python -m {module}", prog)


def test_the_command_line_imports_no_benchmark_until_one_runs():
    # Building the whole parser (every `cascade-service` call does) leaves the tools' heavy modules alone;
    # and a `python -m` entry point runs as its module's __main__ (its flags, one import).
    modules = [f"cascade_service.bench.{tool.module}" for tool in TOOLS]
    modules += [f"cascade_service.zoo.{module}" for module, _ in ZOO_TOOLS.values()]
    code = (
        "import sys\nfrom cascade_service.cli.main import build_parser\nbuild_parser()\n"
        f"print([m for m in {modules!r} if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "cascade_service.bench.kv", "--repeats", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "python -m cascade_service.bench.kv: error: argument --repeats" in done.stderr
