"""`serve`'s loopback rule: beyond loopback only with API keys and TLS, from flags or the config."""

from __future__ import annotations

import argparse

import pytest

from cascade_service.cli import UsageError, main
from cascade_service.cli.serve import serve_access
from cascade_service.config import load_config
from cascade_service.rpc.auth import ApiKeys, TlsFiles

from ..helpers.access import KEY_A


def _serve_args(config_file, *argv):
    args = argparse.Namespace(
        config=str(config_file), host="127.0.0.1", api_keys=None, tls_cert=None, tls_key=None, frontend="edge"
    )
    for flag, value in zip(argv[::2], argv[1::2]):
        setattr(args, flag.lstrip("-").replace("-", "_"), value)
    return args


@pytest.mark.parametrize(
    "extra, missing",
    [
        ([], "--api-keys and --tls-cert/--tls-key"),
        (["--api-keys", "KEYS"], "--tls-cert/--tls-key"),
        (["--tls-cert", "CERT", "--tls-key", "KEY"], "--api-keys"),
    ],
)
def test_serve_refuses_a_non_loopback_host_without_keys_and_tls(config_file, keys_file, cert, capsys, extra, missing):
    files = {"KEYS": str(keys_file), "CERT": cert[0], "KEY": cert[1]}
    argv = ["serve", "--config", str(config_file), "--host", "0.0.0.0", *[files.get(a, a) for a in extra]]
    assert main(argv) == 2  # refused before anything starts or binds
    err = capsys.readouterr().err
    assert "--host 0.0.0.0" in err and f"missing {missing}" in err
    assert KEY_A not in err


def test_serve_accepts_a_non_loopback_host_with_keys_and_tls_from_flags_or_config(
    config_file, keys_file, cert, tmp_path
):
    # serve_access only: binding beyond loopback is never done in tests.
    keys, tls = serve_access(
        _serve_args(
            config_file, "--host", "0.0.0.0", "--api-keys", str(keys_file), "--tls-cert", cert[0], "--tls-key", cert[1]
        ),
        load_config(config_file),
    )
    assert isinstance(keys, ApiKeys) and len(keys) == 2 and tls == TlsFiles(cert[0], cert[1])
    configured = tmp_path / "with_access.yaml"
    configured.write_text(
        config_file.read_text() + f"serving:\n  api_keys_file: {keys_file}\n"
        f"  tls_cert_file: {cert[0]}\n  tls_key_file: {cert[1]}\n"
    )
    keys, tls = serve_access(_serve_args(configured, "--host", "0.0.0.0"), load_config(configured))
    assert len(keys) == 2 and tls is not None
    assert serve_access(_serve_args(config_file), load_config(config_file)) == (None, None)  # loopback: open


def test_serve_access_refuses_half_a_tls_pair_the_ray_frontend_and_an_unreadable_keys_file(config_file, cert, tmp_path):
    config = load_config(config_file)
    with pytest.raises(UsageError, match="go together"):
        serve_access(_serve_args(config_file, "--tls-cert", cert[0]), config)
    with pytest.raises(UsageError, match="--frontend edge"):
        serve_access(_serve_args(config_file, "--tls-cert", cert[0], "--tls-key", cert[1], "--frontend", "ray"), config)
    with pytest.raises(UsageError, match="cannot read"):
        serve_access(_serve_args(config_file, "--api-keys", str(tmp_path / "missing")), config)


def test_config_access_fields_are_paths_relative_to_the_config(config_file, tmp_path):
    from cascade_service.config import ConfigError

    rel = tmp_path / "rel.yaml"
    rel.write_text(config_file.read_text() + "serving:\n  api_keys_file: keys.txt\n")
    assert load_config(rel).serving.api_keys_file == str(tmp_path / "keys.txt")
    for bad in ("serving:\n  api_keys_file: 3\n", "serving:\n  tls_cert_file: c.pem\n"):
        rel.write_text(config_file.read_text() + bad)
        with pytest.raises(ConfigError, match="serving"):
            load_config(rel)


@pytest.mark.parametrize("flag", ["--plain", "--adapt-to-load", "--fixed-schedule"])
def test_the_standalone_schedule_flags_are_refused_with_ray(config_file, capsys, flag):
    assert main(["serve", "--config", str(config_file), "--frontend", "ray", flag]) == 2
    assert "go with --frontend standalone" in capsys.readouterr().err


def test_adapting_and_fixing_the_schedule_are_exclusive(config_file, capsys):
    assert main(["serve", "--config", str(config_file), "--adapt-to-load", "--fixed-schedule"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
