"""quiet.third_party_output: a command's own lines on the terminal, every other road to it (a logger made
before the block, Python warnings, a C-level write to descriptor 2, a print to stdout, a child process)
into the log; a failure still shows on the terminal with the log's tail and path.

The scripts run in a child process of their own: pytest's capture replaces sys.stdout and sys.stderr,
which would hide the descriptor-level behaviour under test."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from cascade_service.quiet import log_path, tail, third_party_output

PRELUDE = """
import logging, os, subprocess, sys, warnings
from pathlib import Path
from cascade_service.quiet import third_party_output

# Made before the block and bound to the sys.stderr of that moment, as Ray's and Serve's loggers are.
noisy = logging.getLogger("third.party")
noisy.addHandler(logging.StreamHandler())
"""


def run_script(body: str, log: Path) -> subprocess.CompletedProcess[str]:
    script = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script, str(log)], capture_output=True, text=True, timeout=60)


def test_third_party_output_goes_to_the_log_by_every_road_and_own_lines_to_the_terminal(tmp_path):
    log = tmp_path / "logs" / "demo.log"  # the folder does not exist yet: made on entry
    done = run_script(
        """
        with third_party_output(Path(sys.argv[1])) as out:
            print("own line", file=out)
            noisy.warning("a logger's WARNING")
            warnings.warn("a FutureWarning", FutureWarning)
            os.write(2, b"a C-level write to fd 2\\n")
            print("a print to stdout")
            subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('a child process line\\\\n')"])
            print("own line after them", file=out)
        print("after the block")
        """,
        log,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "own line\nown line after them\nafter the block\n"
    assert done.stderr == ""
    text = log.read_text()
    for line in ("a logger's WARNING", "FutureWarning: a FutureWarning", "a C-level write to fd 2"):
        assert line in text
    assert "a print to stdout" in text and "a child process line" in text


def test_a_failure_shows_the_logs_tail_and_path_then_its_traceback_on_the_terminal(tmp_path):
    log = tmp_path / "demo.log"
    done = run_script(
        """
        with third_party_output(Path(sys.argv[1])) as out:
            print("own line", file=out)
            os.write(2, b"the replica's last words\\n")
            raise RuntimeError("the service did not start")
        """,
        log,
    )
    assert done.returncode == 1
    assert done.stdout == "own line\n"
    err = done.stderr.splitlines()
    assert err[0] == f"the run failed; the last lines of its third-party logs ({log}):"
    assert "  | the replica's last words" in err
    assert f"third-party logs: {log}" in err
    # The traceback comes after the report, on the terminal, not in the log.
    assert err[-1] == "RuntimeError: the service did not start"
    assert "Traceback" not in log.read_text()


def test_an_interrupt_names_the_log_without_its_tail(tmp_path):
    log = tmp_path / "demo.log"
    done = run_script(
        """
        try:
            with third_party_output(Path(sys.argv[1])):
                os.write(2, b"noise\\n")
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
        """,
        log,
    )
    assert done.returncode == 0
    assert done.stderr == f"third-party logs: {log}\n"


def test_verbose_redirects_nothing_and_writes_no_log(tmp_path, monkeypatch):
    monkeypatch.setenv("CASCADE_SERVICE_HOME", str(tmp_path))
    with third_party_output(None) as out:
        assert out is sys.stdout
    assert not (tmp_path / "logs").exists()


def test_log_path_is_under_the_home_named_after_the_command_and_process(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("CASCADE_SERVICE_HOME", str(tmp_path))
    path = log_path("demo")
    assert path.parent == tmp_path / "logs"
    assert path.name.startswith("demo-") and path.name.endswith(f"-{os.getpid()}.log")


def test_tail_reads_the_last_lines_of_a_log_longer_than_it_reads(tmp_path):
    log = tmp_path / "long.log"
    log.write_text("".join(f"line {i}\n" for i in range(50_000)))  # ~600 kB, past the bytes tail reads
    assert tail(log, 3) == ["line 49997", "line 49998", "line 49999"]
