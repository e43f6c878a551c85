"""The `cascade-service generate` contract: flags, JSON shape, config overrides, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from cascade_service.cli import main

PROMPT = "def f(x):\n    return"


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_has_the_documented_shape_and_matches_autoregressive(tiny_family, capsys):
    t = str(tiny_family["target"])
    code, out, _ = _run(
        capsys,
        "generate",
        "--target",
        t,
        "--drafter",
        str(tiny_family["close"]),
        "mag",
        "--k-matrix",
        "[[4, 2], [0, 6]]",
        "--leniency",
        "2",
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "20",
        "--json",
    )
    assert code == 0
    result = json.loads(out)
    stats = result["stats"]
    assert set(result) == {"text", "token_ids", "stats"}
    for key, kind in [
        ("target_calls", int),
        ("calls", dict),
        ("accepted_by_position", list),
        ("mean_accepted_length", float),
        ("swi", dict),
        ("wall_s", float),
    ]:
        assert isinstance(stats[key], kind), key
    assert set(stats["swi"]) == {"params", "measured"}
    assert set(stats["calls"]) == {"target", "close", "mag"}
    assert len(result["token_ids"]) == 20
    code, out, _ = _run(capsys, "generate", "--target", t, "--prompt", PROMPT, "--max-new-tokens", "20", "--json")
    assert json.loads(out)["token_ids"] == result["token_ids"]  # the target alone, greedy: same tokens


def test_config_file_values_are_overridden_by_flags(tiny_family, tmp_path, capsys):
    config = {
        "tiers": {
            "target": {"path": str(tiny_family["target"])},
            "drafters": [{"name": "close", "path": str(tiny_family["close"])}, {"kind": "mag"}],
        },
        "schedule": {"k_matrix": [[3, 1], [0, 4]], "leniency": 1.0},
        "generation": {"max_new_tokens": 7},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    code, out, _ = _run(capsys, "generate", "--config", str(path), "--prompt", PROMPT, "--json")
    assert code == 0 and len(json.loads(out)["token_ids"]) == 7
    code, out, _ = _run(
        capsys,
        "generate",
        "--config",
        str(path),
        "--prompt",
        PROMPT,
        "--json",
        "--max-new-tokens",
        "3",
        "--k-matrix",
        "[[1,0],[0,2]]",
    )
    result = json.loads(out)
    assert code == 0 and len(result["token_ids"]) == 3
    assert len(result["stats"]["drafted_by_position"]) <= 1  # K[0][0] = 1: blocks of one token


def test_sampling_is_reproducible_with_a_seed(tiny_family, capsys):
    args = [
        "generate",
        "--target",
        str(tiny_family["target"]),
        "--drafter",
        str(tiny_family["mid"]),
        "mag",
        "--prompt",
        PROMPT,
        "--temperature",
        "0.8",
        "--max-new-tokens",
        "16",
        "--json",
    ]
    runs = [json.loads(_run(capsys, *args, "--seed", s)[1])["token_ids"] for s in ("1", "1", "2")]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--k-matrix", "[[1, 2]]"], "K-matrix"),
        (["--k-matrix", "not json"], "k_matrix"),
        (["--leniency", "0.5"], "leniency"),
        (["--temperature", "-1"], "temperature"),
        (["--max-new-tokens", "-3"], "max_new_tokens"),
        (["--top-p", "0"], "top_p"),
    ],
)
def test_bad_arguments_exit_nonzero_with_one_line(tiny_family, capsys, argv, needle):
    base = [
        "generate",
        "--target",
        str(tiny_family["target"]),
        "--drafter",
        str(tiny_family["close"]),
        "mag",
        "--prompt",
        PROMPT,
    ]
    code, out, err = _run(capsys, *base, *argv)
    assert code != 0
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err, err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["generate", "--prompt", "x"], "--config"),
        (["generate", "--target", "/nonexistent/model", "--prompt", "x"], "/nonexistent/model"),
        (["generate", "--config", "/nonexistent.yaml", "--prompt", "x"], "/nonexistent.yaml"),
        (["generate", "--target", "x", "--prompt-file", "/nonexistent.txt"], "/nonexistent.txt"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_invocations_exit_nonzero_with_one_line(capsys, argv, needle):
    code, out, err = _run(capsys, *argv)
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_console_script_runs_as_a_real_process(tiny_family):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cascade_service.cli",
            "generate",
            "--target",
            str(tiny_family["target"]),
            "--drafter",
            "mag",
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "5",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) == 5
