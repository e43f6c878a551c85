"""`cascade-service demo`, the README's main job, runs end to end as a new user runs it: the family shipped
with the package (nothing trained), the service on local Ray, requests through the client SDK, the
speed table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cascade_service.serving.app import APP_NAME

# Every line the demo prints itself starts so (or is blank); anything else on the terminal is someone
# else's: Ray's, Serve's, gRPC's, torch's, transformers'.
OWN_LINES = (
    "loading the ",
    "starting the service (",
    "service up at ",
    "torch threads: in-process ",
    "--- prompt (tail): ",
    "--- continuation: ",
    "method ",
    "ar (large alone) ",
    "csd in-process ",
    "csd via service ",
    "service / in-process throughput ",
    "orchestration per target round",
    "third-party logs: ",
)
THIRD_PARTY_MARKS = ("WARNING", "INFO", "FutureWarning", "(ServeController", "(ProxyActor", "pid=", "Traceback")


def run_demo_command(home: Path, *args: str) -> str:
    """`cascade-service demo` as a new user runs it (the installed command, a process of its own, an empty
    home); stdout and stderr together, as a terminal shows them."""
    command = Path(sys.executable).with_name("cascade-service")
    env = {**os.environ, "CASCADE_SERVICE_HOME": str(home)}
    done = subprocess.run(
        [str(command), "demo", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout
    return done.stdout


def test_demo_decodes_held_out_prompts_and_shows_only_its_own_lines(tmp_path):
    out = run_demo_command(tmp_path, "--prompts", "2", "--max-new-tokens", "12", "--passes", "2")
    assert not (tmp_path / "zoo" / "quality" / "large").exists()  # the shipped family, not a build
    lines = out.splitlines()
    rows = [line for line in lines if line.startswith(("ar (large alone)", "csd in-process", "csd via service"))]
    assert len(rows) == 3
    assert all(row.split()[-1] == "True" for row in rows), out  # in-process and served tokens equal the large's
    assert out.count("--- continuation:") == 2
    accounting = next(line for line in lines if line.startswith("orchestration per target round"))
    assert " ms in-process, " in accounting and " ms in the service " in accounting, accounting
    assert "tier hops per round" in accounting
    threads = next(line for line in lines if line.startswith("torch threads:"))  # both sides', where passes run
    assert threads.count("intra-op ") == 2 and "service replica" in threads, threads
    assert out.count("x, ") == 1 and "per pass:" in out  # one ratio per pass, then the median
    # Quiet: the terminal holds the demo's own lines only (prompts and continuations are quoted code, which
    # may say INFO; the marks are looked for in the other lines).
    strangers = [line for line in lines if line and not line.startswith(OWN_LINES)]
    assert strangers == [], out
    ours = [line for line in lines if not line.startswith(("--- prompt (tail): ", "--- continuation: "))]
    assert [line for line in ours if any(mark in line for mark in THIRD_PARTY_MARKS)] == [], out
    # ... and ends naming the log, under the home, that holds what Ray and Serve said.
    assert lines[-1].startswith("third-party logs: "), out
    log = Path(lines[-1].removeprefix("third-party logs: "))
    assert log.parent == tmp_path / "logs" and log.is_file()
    assert f"Application '{APP_NAME}' is ready" in log.read_text()


# The demo's body swapped for one that prints as the real one's neighbours do (a logger made before, as
# Ray's; a C-level write, as gRPC's), so the command line's wiring of --verbose is checked in seconds: the
# real demo costs 25-45 s a run on a 2-core machine, and the quiet run above already pays one.
FAKE_DEMO = """
import logging, os, sys
import cascade_service.demo
noisy = logging.getLogger("third.party")
noisy.addHandler(logging.StreamHandler())
def decode_three_ways(out, *args):
    print("own line", file=out, flush=True)
    noisy.warning("Serve's WARNING line")
    os.write(2, b"gRPC's C-level line\\n")
cascade_service.demo.decode_three_ways = decode_three_ways
from cascade_service.cli.main import main
sys.exit(main(["demo", *sys.argv[1:]]))
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_demo_command_sends_third_party_lines_to_the_log_unless_verbose(tmp_path, verbose):
    env = {**os.environ, "CASCADE_SERVICE_HOME": str(tmp_path)}
    args = ["--verbose"] if verbose else []
    done = subprocess.run(
        [sys.executable, "-c", FAKE_DEMO, *args], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    third_party = ["Serve's WARNING line", "gRPC's C-level line"]
    if verbose:  # everything on the terminal, as before the log existed, and no log
        assert done.stdout == "own line\n"
        assert done.stderr.splitlines() == third_party
        assert not (tmp_path / "logs").exists()
        return
    (log,) = (tmp_path / "logs").iterdir()
    assert done.stdout == f"own line\n\nthird-party logs: {log}\n"
    assert done.stderr == ""
    assert log.read_text().splitlines()[1:] == third_party  # after the log's own header line


def test_in_process_worker_decodes_in_a_child_process_and_reports_errors(tiny_family, tmp_path):
    import os

    import yaml

    from cascade_service.bench.inprocess import InProcessWorker
    from cascade_service.config import GenerationConfig, load_config
    from cascade_service.inprocess import InProcess

    tiny_config = tmp_path / "tiny.yaml"
    tiny_config.write_text(
        yaml.safe_dump(
            {
                "tiers": {
                    "target": {"name": "target", "path": str(tiny_family["target"])},
                    "drafters": [{"name": "mid", "path": str(tiny_family["mid"])}, {"kind": "mag"}],
                }
            }
        )
    )
    engine = InProcess(load_config(tiny_config).cascade)
    ids = [5, 9, 13, 2, 7]
    with InProcessWorker(str(tiny_config), torch_threads=1) as worker:
        assert worker.process.pid != os.getpid()
        with pytest.raises(RuntimeError, match="KeyError"):
            worker.generate("no-such-variant", ids, 8)
        for variant, expected in (("csd", engine), ("ar", engine.variant([]))):
            reply = worker.generate(variant, ids, 8)  # still answering after the error
            assert reply["tokens"] == expected.generate(ids, GenerationConfig(max_new_tokens=8)).token_ids
            assert reply["seconds"] > 0 and reply["target_calls"] >= 1
    assert worker.process.returncode == 0


def test_demo_schedule_is_the_tuned_one_in_configs_demo_yaml():
    from pathlib import Path

    from cascade_service.config import load_config
    from cascade_service.zoo.demo import DEFAULT_LAYOUT, DEMO_K_MATRIX, DEMO_LENIENCY, DEMO_LOOKUP, LAYOUTS

    config = load_config(Path(__file__).parents[2] / "configs" / "demo.yaml")
    cascade = config.cascade
    assert (cascade.schedule.to_lists(), cascade.leniency, cascade.lookup) == (
        DEMO_K_MATRIX,
        DEMO_LENIENCY,
        DEMO_LOOKUP,
    )
    assert config.serving.colocate == tuple(LAYOUTS[DEFAULT_LAYOUT]["colocate"])
    assert config.serving.groups == ()


def test_demo_takes_a_config_of_ones_own_with_its_layout_and_third_party_prompts(tiny_family, tmp_path, monkeypatch):
    import cascade_service.demo
    from cascade_service.cli.main import main

    config = tmp_path / "mine.yaml"
    config.write_text(f"tiers:\n  target:\n    path: {tiny_family['target']}\n  drafters:\n    - kind: mag\n")
    seen: list = []
    monkeypatch.setattr(cascade_service.demo, "decode_three_ways", lambda out, *args: seen.append(args))
    assert main(["demo", "--config", str(config), "--prompts", "1"]) == 0
    assert seen and seen[0][-1] == str(config)
    assert main(["demo", "--config", str(config), "--layout", "separate"]) == 2
    assert main(["demo", "--config", str(tmp_path / "missing.yaml")]) == 2
