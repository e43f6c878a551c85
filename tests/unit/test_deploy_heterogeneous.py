"""deploy/heterogeneous/: the target in a RayService, the drafters as tier servers of their own.

Checked without Kubernetes or Ray running: the config loads and names each drafter by a Service of
tier-servers.yaml; each tier server's Deployment runs `cascade-service tier` for that tier on that
port, with the keys and TLS a non-loopback address needs (the CLI's own parser reads its args); the
RayService's application parses with Ray's schema and names exactly the deployments the app builds
for this config (the coordinator and the target); every object passes the Kubernetes API schema.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cascade_service.cli.main import build_parser
from cascade_service.config import MaGConfig, load_config

from ..helpers.deploy_files import DEPLOY, ROOT, validate_model

CONFIG = ROOT / "configs" / "heterogeneous.yaml"
SERVERS = DEPLOY / "heterogeneous" / "tier-servers.yaml"
RAYSERVICE = DEPLOY / "heterogeneous" / "rayservice.yaml"


@pytest.fixture
def config(monkeypatch):
    monkeypatch.setenv("CASCADE_SERVICE_HOME", "/models")
    monkeypatch.setenv("CASCADE_REDIS_URL", "redis://cascade-redis:6379/0")
    monkeypatch.setenv("CASCADE_TIER_KEY", "a-key")
    return load_config(CONFIG)


def _objects(kind: str) -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(SERVERS.read_text()) if d]
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_each_drafter_is_reached_by_a_service_of_its_own_and_the_target_is_loaded(config):
    services = _objects("Service")
    assert not config.cascade.target.remote
    for drafter in config.cascade.drafters:
        (address,) = drafter.address
        host, port = address.rsplit(":", 1)
        service = services[host]
        assert [p["port"] for p in service["spec"]["ports"]] == [int(port)]
        assert service["spec"]["selector"]["tier"] == drafter.name
        assert service["spec"]["clusterIP"] == "None"  # headless: one replica per pod (transport.client)
    client = config.serving.tier_client
    assert client.tls and client.ca_file and client.cert_file and client.key_file and client.api_key == "a-key"


def test_each_tier_server_serves_its_tier_on_its_port_with_keys_and_tls(config):
    parser = build_parser()
    deployments = _objects("Deployment")
    assert len(deployments) == len(config.cascade.drafters)
    for drafter in config.cascade.drafters:
        deployment = deployments[f"cascade-tier-{drafter.name}"]
        pod = deployment["spec"]["template"]
        assert deployment["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
        (container,) = pod["spec"]["containers"]
        args = parser.parse_args(container["args"])
        assert args.tier == [drafter.name] and args.config == "/app/configs/heterogeneous.yaml"
        assert args.listen == f"0.0.0.0:{drafter.address[0].rsplit(':', 1)[1]}"
        assert args.api_keys and args.tls_cert and args.tls_key and args.tls_client_ca
        mounted = {m["mountPath"] for m in container["volumeMounts"]}
        for path in (args.api_keys, args.tls_cert, args.tls_client_ca, "/models"):
            assert any(path.startswith(m) for m in mounted), path
        gpus = container["resources"]["limits"].get("nvidia.com/gpu")
        assert (gpus is None) == isinstance(drafter, MaGConfig)  # MaG on CPU, models on their GPU kind
        if gpus:
            assert "nvidia.com/gpu.product" in pod["spec"]["nodeSelector"]
        # The config they read names these variables: loading it fails where one is unset.
        assert {"CASCADE_REDIS_URL", "CASCADE_TIER_KEY"} <= {e["name"] for e in container["env"]}


def test_the_rayservice_builds_the_coordinator_and_the_target_only(config):
    from ray.serve import schema as serve_schema

    from cascade_service.config import ModelTierConfig, deployment_name, tier_groups
    from cascade_service.serving.app import COORDINATOR

    service = yaml.safe_load(RAYSERVICE.read_text())
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    validate_model(serve_schema.ServeDeploySchema, serve)
    (app,) = serve["applications"]
    assert app["args"]["config"] == "/app/configs/heterogeneous.yaml"
    local = [t.name for t in config.cascade.tiers if isinstance(t, ModelTierConfig) and not t.remote]
    built = {COORDINATOR} | {deployment_name(g) for g in tier_groups(local, (), ())}
    assert built == {d["name"] for d in app["deployments"]} == {"coordinator", "tier-large"}
    groups = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    coordinators = next(g for g in groups if g["groupName"] == "cpu")["template"]["spec"]
    mounts = {m["mountPath"] for m in coordinators["containers"][0]["volumeMounts"]}
    client = config.serving.tier_client
    for path in (client.ca_file, client.cert_file, client.key_file):
        assert any(path.startswith(m) for m in mounts), path


def _k8s() -> dict[str, dict]:
    docs = {f"{d['kind']} {d['metadata']['name']}": d for d in yaml.safe_load_all(SERVERS.read_text()) if d}
    cluster = yaml.safe_load(RAYSERVICE.read_text())["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]} | {
        g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]
    }
    for group, template in templates.items():
        docs[f"rayservice {group}"] = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"cascade-{group}"},
            "template": template,
        }
    return docs


@pytest.mark.parametrize("name", sorted(_k8s()))
def test_kubernetes_objects_validate_against_the_api_schema(name):
    import kubernetes_validate

    kubernetes_validate.validate(_k8s()[name], "1.28", strict=True)


def test_the_image_holds_the_config():
    assert "COPY configs /app/configs" in Path(ROOT / "Dockerfile").read_text()
