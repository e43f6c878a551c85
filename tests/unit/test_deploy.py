"""deploy/: the Serve config, the cluster launcher YAML and the RayService agree with Ray and with each other.

Static checks only: Ray's own schemas and parsers, no Ray cluster, no Serve app.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
import yaml

serve_schema = pytest.importorskip("ray.serve.schema")
from ray.serve.config import AutoscalingConfig  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DEPLOYMENTS = {"coordinator", "tier-large", "tier-base", "tier-small"}
IMPORT_PATH = "cascade_service.serving.app:app_builder"
CASCADE_SERVICER = "cascade_service.api.v1.cascade_pb2_grpc.add_CascadeServiceServicer_to_server"
HEALTH_SERVICER = "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server"
ACCELERATOR_PREFIX = "accelerator_type:"  # the resource Ray turns ray_actor_options.accelerator_type into


def _load(name: str):
    return yaml.safe_load((DEPLOY / name).read_text())


def _validate(model, raw: dict):
    # pydantic v2 in current Ray; v1's parse_obj kept for older installs.
    return model.model_validate(raw) if hasattr(model, "model_validate") else model.parse_obj(raw)


def _field_names(model) -> set[str]:
    fields = getattr(model, "model_fields", None) or model.__fields__
    return set(fields) | {f.alias for f in fields.values() if getattr(f, "alias", None)}


def _serve_configs() -> dict[str, dict]:
    rayservice = _load("kuberay/rayservice.yaml")
    return {
        "serve_config.yaml": _load("serve_config.yaml"),
        "rayservice serveConfigV2": yaml.safe_load(rayservice["spec"]["serveConfigV2"]),
    }


def _app(config: dict) -> dict:
    (app,) = config["applications"]
    return app


def _deployments(config: dict) -> dict[str, dict]:
    return {d["name"]: d for d in _app(config)["deployments"]}


def _requested(deployment: dict) -> dict[str, float]:
    """Ray resources one replica asks for, accelerator_type spelled as Ray schedules it."""
    options = deployment.get("ray_actor_options", {})
    wanted = {"CPU": options.get("num_cpus", 0), "GPU": options.get("num_gpus", 0), **options.get("resources", {})}
    if options.get("accelerator_type"):
        wanted[ACCELERATOR_PREFIX + options["accelerator_type"]] = 0.001
    return {k: v for k, v in wanted.items() if v}


def _cluster_worker_types() -> dict[str, tuple[dict, int]]:
    """cluster.yaml worker node types -> (resources, max_workers)."""
    cluster = _load("cluster.yaml")
    return {name: (spec["resources"], spec.get("max_workers", 0))
            for name, spec in cluster["available_node_types"].items() if name != cluster["head_node_type"]}


def _rayservice_worker_groups() -> dict[str, tuple[dict, int]]:
    """RayService worker groups -> (resources as Ray's KubeRay autoscaler reads them, maxReplicas)."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_ray_resources_from_group_spec

    groups = _load("kuberay/rayservice.yaml")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return {g["groupName"]: (_get_ray_resources_from_group_spec(g, is_head=False), g["maxReplicas"]) for g in groups}


PLACEMENTS = {"cluster.yaml": _cluster_worker_types, "rayservice worker groups": _rayservice_worker_groups}


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_serve_config_parses_with_rays_own_schema(source):
    config = _serve_configs()[source]
    parsed = _validate(serve_schema.ServeDeploySchema, config)
    assert [app.name for app in parsed.applications] == ["cascade"]
    assert parsed.grpc_options.port == 9000


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_serve_config_has_no_keys_ray_would_silently_ignore(source):
    # Ray's schemas ignore unknown keys (forward compatibility), so a typo such as `num_gpu` would pass
    # the schema and then do nothing. Every key must be a field of the model that reads it.
    config = _serve_configs()[source]
    checks = [(config, serve_schema.ServeDeploySchema, "top level"),
              (config["http_options"], serve_schema.HTTPOptionsSchema, "http_options"),
              (config["grpc_options"], serve_schema.gRPCOptionsSchema, "grpc_options"),
              (_app(config), serve_schema.ServeApplicationSchema, "application")]
    for d in _app(config)["deployments"]:
        checks.append((d, serve_schema.DeploymentSchema, d["name"]))
        checks.append((d.get("ray_actor_options", {}), serve_schema.RayActorOptionsSchema, d["name"]))
        checks.append((d.get("autoscaling_config") or {}, AutoscalingConfig, d["name"]))
    for raw, model, where in checks:
        assert set(raw) <= _field_names(model), f"{source} {where}: unknown {set(raw) - _field_names(model)}"


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_both_configs_override_exactly_the_four_deployments_the_app_creates(source):
    assert set(_deployments(_serve_configs()[source])) == DEPLOYMENTS


def test_rayservice_holds_the_same_application_as_serve_config():
    local, kube = _serve_configs().values()
    assert _deployments(kube) == _deployments(local)
    assert kube["grpc_options"] == local["grpc_options"]
    for key in ("name", "import_path", "runtime_env"):
        assert _app(kube)[key] == _app(local)[key]


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_application_uses_the_builder_and_its_args(source):
    app = _app(_serve_configs()[source])
    assert app["import_path"] == IMPORT_PATH
    assert set(app["args"]) <= {"config", "redis_url"} and app["args"]["config"].endswith(".yaml")
    assert app["args"].get("redis_url", "redis://").startswith(("redis://", "rediss://"))
    assert app["runtime_env"]["env_vars"]["CASCADE_SERVICE_HOME"] == "/models"


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_tiers_get_gpus_and_coordinator_gets_none(source):
    deployments = _deployments(_serve_configs()[source])
    assert not deployments["coordinator"]["ray_actor_options"].get("num_gpus")
    for tier in ("large", "base", "small"):
        options = deployments[f"tier-{tier}"]["ray_actor_options"]
        assert options["num_gpus"] > 0 and options["resources"] == {f"tier_{tier}": options["num_gpus"]}


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_every_accelerator_type_is_one_ray_knows(source):
    import ray.util.accelerators as accelerators

    known = {v for k, v in vars(accelerators).items() if k.isupper() and isinstance(v, str)}
    used = {d["ray_actor_options"].get("accelerator_type") for d in _deployments(_serve_configs()[source]).values()}
    assert used - {None} <= known, used - {None} - known
    assert used - {None} == {"H100", "A10G", "L4"}


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_every_replica_fits_a_worker_that_offers_its_custom_resources(source, placement):
    workers = PLACEMENTS[placement]()
    for name, deployment in _deployments(_serve_configs()[source]).items():
        wanted = _requested(deployment)
        fits = [w for w, (offered, _) in workers.items() if all(offered.get(k, 0) >= v for k, v in wanted.items())]
        assert fits, f"{placement}: no worker type offers {wanted} for {name}"


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_tier_workers_can_hold_max_replicas(source, placement):
    # A tier resource exists only on its own workers, so their total at max size bounds the tier's replicas.
    workers = PLACEMENTS[placement]()
    for name, deployment in _deployments(_serve_configs()[source]).items():
        for resource, per_replica in deployment["ray_actor_options"].get("resources", {}).items():
            capacity = sum(offered.get(resource, 0) * most for offered, most in workers.values())
            needed = deployment["autoscaling_config"]["max_replicas"] * per_replica
            assert capacity >= needed, f"{placement}: {name} needs {needed} {resource}, at most {capacity}"


def test_cluster_yaml_passes_the_cluster_launchers_schema():
    import jsonschema
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    cluster = _load("cluster.yaml")
    jsonschema.validate(cluster, schema)
    assert cluster["available_node_types"][cluster["head_node_type"]]["resources"].get("GPU", 0) == 0


def test_kuberay_gpu_groups_select_the_gpu_product_their_tier_asks_for():
    groups = _load("kuberay/rayservice.yaml")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    offered = _rayservice_worker_groups()
    for group in groups:
        resources, _ = offered[group["groupName"]]
        kinds = [k[len(ACCELERATOR_PREFIX):] for k in resources if k.startswith(ACCELERATOR_PREFIX)]
        product = group["template"]["spec"].get("nodeSelector", {}).get("nvidia.com/gpu.product", "")
        gpus = group["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", "0")
        assert [kind in product for kind in kinds] == [True] * len(kinds), (group["groupName"], product)
        assert (int(gpus) > 0) == bool(kinds) == bool(product), group["groupName"]


def test_kuberay_head_exposes_the_grpc_port():
    spec = _load("kuberay/rayservice.yaml")["spec"]
    port = yaml.safe_load(spec["serveConfigV2"])["grpc_options"]["port"]
    head = spec["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert port in {p["containerPort"] for p in head["ports"]}


def _split_import_path(path: str) -> tuple[str, str]:
    # Ray's import_attr accepts both `pkg.module.attr` and `pkg.module:attr`.
    module, _, attr = path.rpartition(":") if ":" in path else path.rpartition(".")
    return module, attr


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_grpc_servicer_functions_are_import_paths(source):
    functions = _serve_configs()[source]["grpc_options"]["grpc_servicer_functions"]
    assert functions == [CASCADE_SERVICER, HEALTH_SERVICER]
    dotted = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
    for path in functions:
        module, attr = _split_import_path(path)
        assert dotted.fullmatch(module) and attr.startswith("add_") and attr.endswith("Servicer_to_server"), path


def test_health_servicer_function_imports():
    module, attr = _split_import_path(HEALTH_SERVICER)
    assert callable(getattr(importlib.import_module(module), attr))


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_the_app_config_named_in_args_loads_and_builds_exactly_these_deployments(source, monkeypatch):
    from cascade_service.config import ModelTierConfig, deployment_name, load_config, tier_groups
    from cascade_service.serving.app import COORDINATOR

    monkeypatch.setenv("CASCADE_SERVICE_HOME", "/models")
    args = _app(_serve_configs()[source])["args"]
    assert args["config"].startswith("/app/configs/")
    config = load_config(Path(__file__).parents[2] / "configs" / args["config"].removeprefix("/app/configs/"))
    models = [t.name for t in config.cascade.tiers if isinstance(t, ModelTierConfig)]
    built = {COORDINATOR} | {deployment_name(g) for g in tier_groups(models, config.serving.colocate, config.serving.groups)}
    assert built == set(_deployments(_serve_configs()[source]))
