"""`cascade-service bench load` against a real gRPC server on loopback (tiny models, in this process)."""

from __future__ import annotations

import json
import types

import pytest

from cascade_service.api.server import start_server
from cascade_service.config import GenerationConfig, MaGConfig, ModelTierConfig, make_cascade
from cascade_service.inprocess import InProcess
from cascade_service.sessions import MemoryStore

from ..helpers.bench import run_bench


@pytest.fixture(scope="module")
def address(tiny_family):
    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])),
        [ModelTierConfig("mid", str(tiny_family["mid"])), MaGConfig()],
        [[3, 1], [0, 3]],
        1.5,
    )
    server, port = start_server(InProcess(cascade).coordinator(MemoryStore(), GenerationConfig(max_new_tokens=8)))
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_load_levels_report_latency_throughput_errors_and_server_memory(address, tmp_path, capsys):
    out = tmp_path / "load"
    assert (
        run_bench(
            "load",
            "--target",
            address,
            "--concurrency",
            "1,3",
            "--duration",
            "1.5",
            "--max-new-tokens",
            "6",
            "--out",
            str(out),
        )
        == 0
    )
    results = json.loads((out / "load.json").read_text())
    assert [level["concurrency"] for level in results["levels"]] == [1, 3]
    for level in results["levels"]:
        assert level["requests"] > 0 and level["errors"] == 0
        assert 0 < level["p50_s"] <= level["p99_s"] and level["tokens_per_s"] > 0
        assert level["drained_tokens_per_s"] > 0 and level["tokens"] <= 6 * level["requests"]
    memory = results["memory"]  # the listener is this test process: its RSS is found and positive
    assert memory["rss_after_warmup_mb"] > 0 and memory["rss_after_mb"] > 0
    assert "concurrency   3" in capsys.readouterr().out


def test_load_refuses_non_loopback_targets_and_bad_values(tmp_path):
    with pytest.raises(ValueError, match="loopback"):
        run_bench("load", "--target", "10.0.0.1:9000", "--out", str(tmp_path))
    with pytest.raises(ValueError, match="--duration"):
        run_bench("load", "--target", "127.0.0.1:9000", "--duration", "0", "--out", str(tmp_path))
    with pytest.raises(ValueError, match="--target"):
        run_bench("load", "--out", str(tmp_path))
    with pytest.raises(ValueError, match="--temperature"):
        run_bench("load", "--target", "127.0.0.1:9000", "--temperature", "-1", "--out", str(tmp_path))


def test_load_requests_carry_the_temperature_asked_for(address, tmp_path, monkeypatch):
    from cascade_service.client import CascadeClient

    sent = []
    stream = CascadeClient.stream  # the load's clients stream (each token counted when it arrives)

    def recording(self, prompt, **kwargs):
        sent.append(kwargs.get("temperature"))
        return stream(self, prompt, **kwargs)

    monkeypatch.setattr(CascadeClient, "stream", recording)
    out = tmp_path / "load"
    assert (
        run_bench(
            "load",
            "--target",
            address,
            "--concurrency",
            "2",
            "--duration",
            "0.5",
            "--max-new-tokens",
            "4",
            "--temperature",
            "0.7",
            "--out",
            str(out),
        )
        == 0
    )
    results = json.loads((out / "load.json").read_text())
    assert sent and set(sent) == {0.7} and results["levels"][0]["errors"] == 0
    assert "--temperature 0.7" in results["command"]


def test_load_from_a_config_compares_the_cascade_with_plain_decoding(tiny_family, tmp_path, capsys):
    import yaml

    config = tmp_path / "tiny.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "tiers": {
                    "target": {"name": "target", "path": str(tiny_family["target"])},
                    "drafters": [{"name": "mid", "path": str(tiny_family["mid"])}, {"kind": "mag"}],
                },
                "schedule": {"k_matrix": [[3, 1], [0, 3]], "leniency": 1.5},
                "serving": {"torch_threads": 1},
            }
        )
    )
    out = tmp_path / "load"
    assert (
        run_bench(
            "load",
            "--config",
            str(config),
            "--concurrency",
            "1,3",
            "--duration",
            "1.5",
            "--max-new-tokens",
            "6",
            "--out",
            str(out),
        )
        == 0
    )
    results = json.loads((out / "load.json").read_text())
    runs = results["runs"]
    # the default modes: what `serve` runs, beside plain decoding at the same load
    assert [(r["mode"], r["concurrency"]) for r in runs] == [("default", 1), ("plain", 1), ("default", 3), ("plain", 3)]
    for run in runs:
        assert set(run) >= {"mode", "concurrency", "tokens_per_s", "p50_s", "p99_s", "errors", "drafted_round_share"}
        assert run["requests"] > 0 and run["errors"] == 0 and run["tokens_per_s"] > 0
        assert 0 < run["p50_s"] <= run["p99_s"]
        assert 0.0 <= run["drafted_round_share"] <= 1.0 and (run["mode"] != "plain" or run["drafted_round_share"] == 0)
        # the servers' own count of target passes (their /metrics) against the tokens of the level: one
        # stream of plain decoding needs a pass a token at least (its prompt's pass makes the first)
        assert run["target_passes_per_token"] >= (1.0 if run["mode"] == "plain" else 1.0 / 6) / run["concurrency"]
        assert run["target_pass_ms"] > 0 and run["target_pass_ms_per_token"] > 0
    ratio = results["summary"]["default_over_plain"]["3"]
    assert ratio == round(runs[2]["tokens_per_s"] / runs[3]["tokens_per_s"], 3)
    drained = results["summary"]["drained"]["default_over_plain"]["3"]
    assert drained == round(runs[2]["drained_tokens_per_s"] / runs[3]["drained_tokens_per_s"], 3)
    printed = capsys.readouterr().out
    assert "default / plain at 3 streams: " in printed and "default / plain at 3 streams, drained figures" in printed
    assert "target passes a token " in printed


def test_the_bench_reads_the_services_metric_names():
    from cascade_service.bench import load
    from cascade_service.metrics import PREFIX

    assert load.METRICS_PREFIX == PREFIX


def test_throughput_counts_the_tokens_that_arrived_within_the_window(monkeypatch):
    # One stream, a 0.75 s window, a request whose first token comes at once and its other two 1.5 s
    # later: within the window one token arrived (4 tok/s over the window); the drained figure counts
    # all three over the window and the drain (~1.5 s), as the closed loop left the request to finish.
    import time

    import cascade_service.client as client_module
    from cascade_service.bench.load import run_level

    class SlowClient:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def stream(self, prompt, **options):
            yield types.SimpleNamespace(token_ids=[1], stats=None)
            time.sleep(1.5)
            yield types.SimpleNamespace(token_ids=[2, 3], stats={"target_calls": 3, "drafted_rounds": 0})

    monkeypatch.setattr(client_module, "CascadeClient", SlowClient)
    level = run_level("127.0.0.1:1", 1, 0.75, ["p"], 3, None, 10.0, ramp=False).summary()
    assert level["requests"] == 1 and level["tokens"] == 3
    assert level["tokens_per_s"] == round(1 / 0.75, 2)
    assert 1.4 < 3 / level["drained_tokens_per_s"] < 3.0  # the window and the drain


def test_the_window_opens_once_every_client_has_finished_a_request(monkeypatch):
    # Two clients whose first requests (the ramp: everyone arrived at once) take 0.3 and 0.9 s, then
    # 0.05 s each. The window opens at ~0.9 s: none of the ramp's requests is in the figures; from the
    # start (ramp=False) the 0.3 s one is.
    import itertools
    import time

    import cascade_service.client as client_module
    from cascade_service.bench.load import run_level

    firsts = itertools.count()

    class RampClient:
        def __init__(self, *args, **kwargs):
            self.first = 0.3 + 0.6 * next(firsts)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def stream(self, prompt, **options):
            time.sleep(self.first or 0.05)
            self.first = 0.0
            yield types.SimpleNamespace(token_ids=[1], stats={"target_calls": 1, "drafted_rounds": 0})

    monkeypatch.setattr(client_module, "CascadeClient", RampClient)
    level = run_level("127.0.0.1:1", 2, 0.5, ["p"], 1, None, 10.0)
    assert 0.85 < level.ramp_s < 1.5
    assert level.latencies and max(level.latencies) < 0.25  # only requests begun in the window
    assert level.summary()["ramp_s"] == round(level.ramp_s, 2)
    firsts = itertools.count()
    from_start = run_level("127.0.0.1:1", 2, 0.5, ["p"], 1, None, 10.0, ramp=False)
    assert from_start.ramp_s == 0.0 and max(from_start.latencies) >= 0.3


def test_load_takes_a_target_or_a_config_not_both(tmp_path):
    with pytest.raises(ValueError, match="either --target"):
        run_bench("load", "--target", "127.0.0.1:9000", "--config", "c.yaml", "--out", str(tmp_path))


def test_paired_blocks_give_the_median_of_the_ratios_within_each_block():
    from cascade_service.bench.load import _scaling

    def run(mode, n, block, tps):
        return {"mode": mode, "concurrency": n, "block": block, "tokens_per_s": tps}

    # Block 1 ran on a slow machine: both modes halved. Pairing cancels that; the mean of the
    # throughputs' ratio would not be 1.5 here.
    runs = [
        run("cascade", 4, 0, 150.0),
        run("plain", 4, 0, 100.0),
        run("cascade", 4, 1, 60.0),
        run("plain", 4, 1, 50.0),
    ]
    runs += [run("cascade", 4, 2, 200.0), run("plain", 4, 2, 100.0)]
    runs += [run("cascade", 1, b, 50.0) for b in range(3)] + [run("plain", 1, b, 40.0) for b in range(3)]
    summary = _scaling(runs)
    assert summary["blocks"] == 3
    assert summary["cascade_over_plain"]["4"] == 1.5  # median of 1.5, 1.2, 2.0
    assert summary["over_single_stream"]["cascade"]["4"] == 3.0  # median 150 over median 50
    assert "adaptive_over_plain" not in summary


def test_each_block_turns_the_order_so_every_mode_runs_in_every_place(monkeypatch, tmp_path):
    """A fixed order confounds a mode with its place in the block (bench/load.py `rotated`): over as many
    blocks as modes each mode runs once in each place."""
    from cascade_service.bench import load

    class Server:
        def __init__(self, config_path, mode, extra=()):
            self.mode = mode

        def wait_ready(self):
            return self.mode  # run_level below is handed the mode as its target

        def wait_http(self):
            return 0

        def stop(self):
            pass

    _no_metrics(monkeypatch, load)
    measured = []

    def level(target, n, *args, **kwargs):
        if len(args) == 8:  # a measured level (a warm-up passes no options nor ramp)
            measured.append(target)
        return load.Level(n, window_s=1.0, window_tokens=10, tokens=10, seconds=1.0, latencies=[0.1])

    monkeypatch.setattr(load, "ServerProcess", Server)
    monkeypatch.setattr(load, "run_level", level)
    modes = ["default", "off", "plain"]
    load.run_modes("c.yaml", [4], 1.0, ["p"], 8, tmp_path, "cmd", modes=modes, blocks=3)
    assert len(measured) == 3 * len(modes)
    blocks = [measured[i : i + len(modes)] for i in range(0, len(measured), len(modes))]
    assert blocks[0] == modes  # the first block runs them as asked
    for place in range(len(modes)):
        assert sorted(block[place] for block in blocks) == sorted(modes)


def test_each_block_runs_on_fresh_server_processes(monkeypatch, tmp_path):
    """A server process has a speed of its own (two identical plain servers read 1.09x and 1.18x each
    other, the same one ahead in every block): each block starts its own, and stops them before the next."""
    from cascade_service.bench import load

    started, alive = [], set()

    class Server:
        def __init__(self, config_path, mode, extra=()):
            self.mode = mode
            started.append(self)
            alive.add(self)

        def wait_ready(self):
            return self

        def wait_http(self):
            return 0

        def stop(self):
            alive.discard(self)

    _no_metrics(monkeypatch, load)

    def level(target, n, *args, **kwargs):
        assert target in alive  # measured on a server of this block, still running
        assert len(alive) == 2  # the last block's are gone
        return load.Level(n, window_s=1.0, window_tokens=10, tokens=10, seconds=1.0, latencies=[0.1])

    monkeypatch.setattr(load, "ServerProcess", Server)
    monkeypatch.setattr(load, "run_level", level)
    load.run_modes("c.yaml", [4], 1.0, ["p"], 8, tmp_path, "cmd", modes=["twin", "plain"], blocks=3)
    assert [s.mode for s in started] == ["twin", "plain"] * 3
    assert not alive
    summary = json.loads((tmp_path / "load.json").read_text())["summary"]
    assert summary["twin_over_plain"]["4"] == 1.0  # the control is reported as any mode is


def _no_metrics(monkeypatch, load):
    """For a run_modes over fake servers: no config to read the target's name from, no /metrics."""
    config = types.SimpleNamespace(cascade=types.SimpleNamespace(target=types.SimpleNamespace(name="t")))
    monkeypatch.setattr(load, "load_config", lambda path: config)
    monkeypatch.setattr(load.EngineCounts, "scrape", classmethod(lambda cls, port, tier: cls(0.0, 0.0, 0.0)))
