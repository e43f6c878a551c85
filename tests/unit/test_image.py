"""The Dockerfile builds the image the deploy files name, with a real CLI command as its entry point.

Static checks (no Docker here): the Dockerfile through dockerfile-parse, its shell steps run against
stub commands, its command line through the CLI's own parser.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
IMAGE = "cascade-service:latest"  # what every deploy file runs and the docs build
REDIS_IMAGE_REPOSITORY = "redis"  # deploy/kuberay/redis.yaml: the only other image


def _dockerfile() -> DockerfileParser:
    return DockerfileParser(str(ROOT / "Dockerfile"))


def _final_stage() -> list[dict]:
    """Instructions after the last FROM: what the image is made of."""
    structure = [i for i in _dockerfile().structure if i["instruction"] != "COMMENT"]
    last_from = max(n for n, i in enumerate(structure) if i["instruction"] == "FROM")
    return structure[last_from + 1 :]


def _only(instruction: str) -> str:
    (value,) = [i["value"] for i in _final_stage() if i["instruction"] == instruction]
    return value


def _runs(needle: str) -> list[str]:
    return [i["value"] for i in _final_stage() if i["instruction"] == "RUN" and needle in i["value"]]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirement(name: str) -> Requirement:
    project = _pyproject()["project"]
    # The image installs the dependencies and the [serve] extra (Ray, Redis): what the cluster runs.
    (found,) = [
        r
        for r in map(Requirement, project["dependencies"] + project["optional-dependencies"]["serve"])
        if r.name == name
    ]
    return found


def test_the_entry_point_is_the_console_script_the_package_installs():
    assert json.loads(_only("ENTRYPOINT")) == ["cascade-service"]
    module, _, function = _pyproject()["project"]["scripts"]["cascade-service"].partition(":")
    from importlib import import_module

    assert callable(getattr(import_module(module), function))


def test_the_default_command_is_a_serve_command_the_cli_accepts(monkeypatch):
    from cascade_service.cli import build_parser
    from cascade_service.config import load_config

    command = json.loads(_only("CMD"))
    args = build_parser().parse_args(command)  # a UsageError for an unknown command, flag or choice
    assert args.command == "serve" and args.frontend == "standalone"
    # Outside the container the server is reachable only on a non-loopback host, which `serve` allows
    # only with API keys and TLS both on.
    assert args.host == "0.0.0.0" and args.api_keys and args.tls_cert and args.tls_key
    # The config it names is the repository's, copied to where it says.
    assert "configs /app/configs" in [i["value"] for i in _final_stage() if i["instruction"] == "COPY"]
    monkeypatch.setenv("CASCADE_SERVICE_HOME", "/models")
    monkeypatch.setenv("CASCADE_REDIS_URL", "redis://cascade-redis:6379/0")
    load_config(ROOT / "configs" / Path(args.config).relative_to("/app/configs"))


def test_the_image_runs_as_a_fixed_non_root_user_it_creates():
    uid, _, gid = _only("USER").partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric, so Kubernetes' runAsNonRoot can check it"
    assert not gid or (gid.isdigit() and int(gid) != 0)
    (create,) = _runs("useradd")
    assert f"--uid {uid}" in create
    # The zoo directory belongs to that user.
    assert re.search(rf"chown {uid}(:\d+)? /models", create)
    assert _dockerfile().envs["CASCADE_SERVICE_HOME"] == "/models"


def _run_with_stub_pip(script: str, tmp_path: Path, **env: str) -> tuple[int, list[str], str]:
    """Run one RUN step under sh with `pip` recording its arguments: (exit status, pip argv, -r file)."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    (stubs / "pip").write_text(
        '#!/bin/sh\nprintf "%s\\n" "$@" > "$PIP_LOG"\nprev=\n'
        'for a in "$@"; do [ "$prev" = -r ] && cp "$a" "$PIP_LOG.r"; prev=$a; done\n'
    )
    (stubs / "pip").chmod(0o755)
    (stubs / "python").symlink_to(sys.executable)
    log = tmp_path / "pip.log"
    result = subprocess.run(
        ["sh", "-c", script],
        env={**os.environ, **env, "PATH": f"{stubs}:{os.environ['PATH']}", "PIP_LOG": str(log)},
        capture_output=True,
        text=True,
        check=False,
    )
    argv = log.read_text().splitlines() if log.exists() else []
    requirements = (tmp_path / "pip.log.r").read_text() if (tmp_path / "pip.log.r").exists() else ""
    return result.returncode, argv, requirements


@pytest.mark.parametrize(
    "variant, index",
    [
        ("cuda", None),  # PyPI's own Linux wheel is the CUDA build
        ("cpu", "https://download.pytorch.org/whl/cpu"),
        ("cu128", "https://download.pytorch.org/whl/cu128"),
    ],
)
def test_torch_variant_picks_the_wheel_index(variant, index, tmp_path):
    args = _dockerfile().args
    assert args["TORCH_VARIANT"] == "cuda", "the deploy files run the tiers on GPUs"
    (step,) = _runs("TORCH_VARIANT")
    status, argv, _ = _run_with_stub_pip(step, tmp_path, TORCH_VARIANT=variant, TORCH_VERSION=args["TORCH_VERSION"])
    assert status == 0
    assert argv == ["install", *(["--index-url", index] if index else []), f"torch=={args['TORCH_VERSION']}"]


def test_an_unknown_torch_variant_fails_the_build(tmp_path):
    (step,) = _runs("TORCH_VARIANT")
    status, argv, _ = _run_with_stub_pip(step, tmp_path, TORCH_VARIANT="rocm", TORCH_VERSION="2.13.0")
    assert status != 0 and argv == []


def test_the_dependency_layer_installs_pyprojects_dependencies_and_serve_extra_with_ray_and_torch_pinned(tmp_path):
    (step,) = _runs("tomllib")
    args = _dockerfile().args
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    status, argv, requirements = _run_with_stub_pip(step.replace("/tmp/", f"{tmp_path}/"), tmp_path, **args)
    assert status == 0
    project = _pyproject()["project"]
    assert requirements.splitlines() == project["dependencies"] + project["optional-dependencies"]["serve"]
    assert f"ray[serve]=={args['RAY_VERSION']}" in argv and f"torch=={args['TORCH_VERSION']}" in argv


def test_pinned_versions_are_the_ones_pyproject_ci_and_the_cluster_use():
    args = _dockerfile().args
    assert args["TORCH_VERSION"] in SpecifierSet(str(_requirement("torch").specifier))
    assert f'"torch=={args["TORCH_VERSION"]}"' in (ROOT / ".ci" / "run").read_text()
    assert args["RAY_VERSION"] in SpecifierSet(str(_requirement("ray").specifier))
    rayservice = yaml.safe_load((DEPLOY / "kuberay" / "rayservice.yaml").read_text())
    assert rayservice["spec"]["rayClusterConfig"]["rayVersion"] == args["RAY_VERSION"]


def test_commands_stay_on_the_path_of_login_shells():
    # KubeRay and the cluster launcher run `ray start` through `bash -l`, whose /etc/profile resets PATH:
    # a virtualenv on a PATH set with ENV would not be found there; /usr/local/bin is.
    assert "PATH" not in _dockerfile().envs
    assert not _runs("venv") and not _runs("virtualenv")
    assert _dockerfile().baseimage.startswith("python:") and _dockerfile().baseimage.endswith("-slim")


def test_the_tools_cluster_managers_run_in_the_container_are_installed():
    (install,) = _runs("apt-get install")
    # wget: KubeRay's probes; rsync and ssh: the Ray cluster launcher.
    assert {"wget", "rsync", "openssh-client"} <= set(install.split())


# The build context.


def _ignore_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as a regex (Go's filepath.Match, plus `**` for any number of directories)."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] in "*?":
            out, i = out + ("[^/]*" if pattern[i] == "*" else "[^/]"), i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def _ignored(path: str) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parent directories decides."""
    ignored = False
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exclusion = line.startswith("!")
        regex = _ignore_regex(line.lstrip("!").strip("/"))
        parts = path.split("/")
        if any(regex.fullmatch("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            ignored = not exclusion
    return ignored


def test_everything_the_dockerfile_copies_is_in_the_build_context():
    sources = []
    for instruction in _dockerfile().structure:
        if instruction["instruction"] == "COPY" and "--from" not in instruction["value"]:
            sources += [s for s in instruction["value"].split()[:-1] if not s.startswith("--")]
    assert {"pyproject.toml", "README.md", "cascade_service", "configs"} <= set(sources)
    for source in sources:
        path = ROOT / source
        files = (
            [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        )
        assert files, source
        for file in files:
            assert not _ignored(file.relative_to(ROOT).as_posix()), file


def test_the_build_context_leaves_out_the_checkouts_other_contents():
    for path in (
        ".git/HEAD",
        ".venv/bin/python",
        "tests/unit/test_image.py",
        "deploy/cluster.yaml",
        "cascade_service/__pycache__/cli.cpython-311.pyc",
        "cascade_service.egg-info/PKG-INFO",
    ):
        assert _ignored(path), path


# One image name everywhere.


def _images(node) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "image" and isinstance(v, str)] + [
            i for v in node.values() for i in _images(v)
        ]
    return [i for v in node for i in _images(v)] if isinstance(node, list) else []


def test_every_image_the_deploy_files_name_is_the_one_the_dockerfile_builds():
    found = {}
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for image in _images(doc):
                found.setdefault(image, set()).add(path.relative_to(DEPLOY).as_posix())
    redis = {image for image in found if image.partition(":")[0] == REDIS_IMAGE_REPOSITORY}
    assert set(found) - redis == {IMAGE}, found
    assert found[IMAGE] == {
        "cluster.yaml",
        "kuberay/rayservice.yaml",
        "heterogeneous/rayservice.yaml",
        "heterogeneous/tier-servers.yaml",
    }
    assert all(where == {"kuberay/redis.yaml"} for image, where in found.items() if image in redis)


@pytest.mark.parametrize("doc", ["Dockerfile", "docs/deployment.md", "deploy/README.md"])
def test_the_docs_build_the_image_under_that_name(doc):
    builds = re.findall(r"(docker build [^\n]*-t\s+(\S+)[^\n]*)", (ROOT / doc).read_text())  # (line, tag)
    assert builds, f"{doc} shows how to build the image"
    assert {tag for line, tag in builds if "TORCH_VARIANT=cpu" not in line} == {IMAGE}, builds
