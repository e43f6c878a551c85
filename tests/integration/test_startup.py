"""Bad tiers fail at start-up with one clear error naming the tier and its config key, before weights load.

A device this machine does not have (`cuda:7`, or `cuda` with no GPU), a drafter whose vocabulary is
not the target's (config.json's size, or its tokenizer's ids), on every wiring: the in-process engine,
the CLI, a tier server, the Ray app builder. In a Ray replica a tier follows the GPUs Ray gave it.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from cascade_service.cli import main
from cascade_service.config import ConfigError, ModelTierConfig, parse_config
from cascade_service.engine.core import EngineCore
from cascade_service.inprocess import InProcess
from cascade_service.models import hf
from cascade_service.tierhost.modeltier import TierServer, replica_tier

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
no_gpu = pytest.mark.skipif(GPUS > 0, reason="needs a machine without CUDA devices")


def _raw(family, drafter_path=None, **drafter):
    return {
        "tiers": {
            "target": {"name": "large", "path": str(family["target"])},
            "drafters": [
                {"name": "base", "path": str(family["mid"])},
                {"name": "small", "path": str(drafter_path or family["close"]), **drafter},
                {"kind": "mag"},
            ],
        }
    }


@pytest.fixture
def no_weights(monkeypatch):
    """Fails the test if any weights load: the checks must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the start-up checks failed")

    monkeypatch.setattr(hf.AutoModelForCausalLM, "from_pretrained", refuse)


def test_a_device_this_machine_lacks_fails_before_any_weights_load(tiny_family, no_weights):
    config = parse_config(_raw(tiny_family, device=f"cuda:{GPUS + 5}"))
    with pytest.raises(ConfigError) as err:
        InProcess(config.cascade)
    plural = "" if GPUS == 1 else "s"
    assert str(err.value) == (
        f"tiers.drafters[1].device (tier 'small'): cuda:{GPUS + 5} does not exist "
        f"(this machine has {GPUS} CUDA device{plural})"
    )


@no_gpu
def test_cuda_without_a_gpu_fails_naming_the_tier(tiny_family, no_weights):
    raw = _raw(tiny_family)
    raw["tiers"]["target"]["device"] = "cuda"
    with pytest.raises(
        ConfigError,
        match=r"^tiers\.target\.device \(tier 'large'\): cuda does not exist "
        r"\(this machine has 0 CUDA devices\)$",
    ):
        InProcess(parse_config(raw).cascade)


def test_a_tier_built_in_code_is_named_by_its_place_in_the_cascade(tiny_family, no_weights):
    from cascade_service.config import MaGConfig, make_cascade

    cascade = make_cascade(
        ModelTierConfig("t", str(tiny_family["target"])),
        [
            ModelTierConfig("m", str(tiny_family["mid"])),
            ModelTierConfig("c", str(tiny_family["close"]), device="cuda:99"),
            MaGConfig(),
        ],
        None,
        1.0,
    )
    with pytest.raises(ConfigError, match=r"^tiers\.drafters\[1\]\.device \(tier 'c'\): cuda:99 does not exist"):
        InProcess(cascade)


@pytest.mark.parametrize(
    "field, value, needle",
    [
        (
            "dtype",
            "float64",
            r"tiers\.drafters\[1\]\.dtype must be one of float32, float16, bfloat16, auto, got 'float64'",
        ),
        ("device", "gpu", r"tiers\.drafters\[1\]\.device must be cpu, cuda, cuda:N or auto, got 'gpu'"),
        ("device", "cuda:x", r"tiers\.drafters\[1\]\.device must be cpu, cuda, cuda:N or auto, got 'cuda:x'"),
    ],
)
def test_an_unknown_dtype_or_device_is_refused_when_the_config_is_parsed(tiny_family, field, value, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_config(_raw(tiny_family, **{field: value}))


def _copy(family, tmp_path, edit):
    copy = tmp_path / "foreign"
    shutil.copytree(family["close"], copy)
    edit(copy)
    return copy


def _other_vocab_size(path):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))


def _other_token_ids(path):
    # Same size, but two tokens trade ids: drafts would name other tokens than the target reads.
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))


@pytest.mark.parametrize(
    "edit, needle",
    [
        (
            _other_vocab_size,
            r"a vocabulary of 384 tokens, the target's \(tiers\.target\.path \(tier 'large'\)\) has 320",
        ),
        (_other_token_ids, r"its tokenizer maps tokens to other ids than the target's"),
    ],
    ids=["config_vocab_size", "tokenizer_ids"],
)
def test_a_drafter_with_another_vocabulary_fails_before_any_weights_load(
    tiny_family, tmp_path, no_weights, edit, needle
):
    config = parse_config(_raw(tiny_family, _copy(tiny_family, tmp_path, edit)))
    with pytest.raises(ConfigError, match=r"^tiers\.drafters\[1\]\.path \(tier 'small'\): " + needle):
        InProcess(config.cascade)


def test_the_ray_app_refuses_another_vocabulary_before_deploying(tiny_family, tmp_path):
    import yaml

    from cascade_service.serving.app import app_builder

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_raw(tiny_family, _copy(tiny_family, tmp_path, _other_vocab_size))))
    with pytest.raises(ConfigError, match=r"^tiers\.drafters\[1\]\.path \(tier 'small'\): a vocabulary of 384"):
        app_builder({"config": str(path)})


def test_a_tier_server_refuses_a_device_this_machine_lacks(tiny_family, no_weights):
    core = EngineCore()
    try:
        with pytest.raises(ConfigError, match=rf"^tier 'close' device: cuda:{GPUS + 1} does not exist"):
            TierServer(ModelTierConfig("close", str(tiny_family["close"]), device=f"cuda:{GPUS + 1}"), core)
    finally:
        core.close()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--device", "cuda:7"], "--target.device (tier 'target'): cuda:7 does not exist"),
        (["--dtype", "float64"], "--target.dtype must be one of"),
        (["--device", "tpu"], "--target.device must be cpu, cuda, cuda:N or auto"),
    ],
)
def test_the_cli_reports_a_bad_device_or_dtype_in_one_line(tiny_family, capsys, argv, needle):
    if GPUS > 7 and "cuda:7" in argv:
        pytest.skip("this machine has a cuda:7")
    code = main(["generate", "--target", str(tiny_family["target"]), "--prompt", "x", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def _tier(device: str) -> ModelTierConfig:
    return parse_config({"tiers": {"target": {"name": "large", "path": "/m/large", "device": device}}}).cascade.target


@pytest.mark.parametrize("device", ["cpu", "auto", "cuda", "cuda:0"])
def test_a_ray_replica_given_a_gpu_runs_its_tier_there(device):
    assert replica_tier(_tier(device), [0], "tier-large").device == "cuda:0"


def test_a_ray_replica_spreads_its_tiers_over_the_gpus_it_was_given():
    assert replica_tier(_tier("cuda:1"), [0, 1], "tier-large-base").device == "cuda:1"
    # With RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES every GPU stays visible: Ray's ids are torch's.
    assert replica_tier(_tier("cuda:1"), [2, 5], "tier-large-base").device == "cuda:5"
    with pytest.raises(
        ConfigError,
        match=r"^tiers\.target\.device \(tier 'large'\): cuda:1, but its deployment "
        r"tier-large was given 1 GPU$",
    ):
        replica_tier(_tier("cuda:1"), [0], "tier-large")


def test_a_ray_replica_given_no_gpu_keeps_the_configured_device():
    assert replica_tier(_tier("cpu"), [], "tier-large").device == "cpu"
    assert replica_tier(_tier("auto"), [], "tier-large").device == "auto"


@no_gpu
def test_a_ray_replica_given_no_gpu_says_which_option_gives_it_one():
    with pytest.raises(
        ConfigError,
        match=r"cuda does not exist \(this machine has 0 CUDA devices\); its deployment "
        r"tier-large was given no GPU "
        r"\(serving\.deployments\.tier-large\.ray_actor_options\.num_gpus\)",
    ):
        replica_tier(_tier("cuda"), [], "tier-large")
