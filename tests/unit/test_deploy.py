"""deploy/: the Serve config, the cluster launcher YAML, the RayService and its Redis agree with Ray, with
Kubernetes and with each other.

Static checks only: Ray's own schemas and parsers, kubernetes-validate's schemas, no cluster, no Serve app.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

serve_schema = pytest.importorskip("ray.serve.schema")
from ray.serve.config import AutoscalingConfig  # noqa: E402

from ..helpers.deploy_files import (  # noqa: E402
    ACCELERATOR_PREFIX,
    DEPLOY,
    ROOT,
    app_of,
    cluster_worker_types,
    deployments_of,
    field_names,
    load_yaml,
    ray_pod_templates,
    rayservice_worker_groups,
    redis_objects,
    requested,
    serve_configs,
    validate_model,
)

DEPLOYMENTS = {"coordinator", "tier-large", "tier-base", "tier-small"}
IMPORT_PATH = "cascade_service.serving.app:app_builder"
CASCADE_SERVICER = "cascade_service.serving.proxy.add_cascade_service"
HEALTH_SERVICER = "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server"
REFLECTION_SERVICER = "cascade_service.rpc.reflection.add_reflection_v1"
REDIS_URL_ENV = "CASCADE_REDIS_URL"
REDIS_URL_REFERENCE = "${" + REDIS_URL_ENV + "}"  # how every deploy file names the session store
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


PLACEMENTS = {"cluster.yaml": cluster_worker_types, "rayservice worker groups": rayservice_worker_groups}


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_serve_config_parses_with_rays_own_schema(source):
    config = serve_configs()[source]
    parsed = validate_model(serve_schema.ServeDeploySchema, config)
    assert [app.name for app in parsed.applications] == ["cascade"]
    assert parsed.grpc_options.port == 9000


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_serve_config_has_no_keys_ray_would_silently_ignore(source):
    # Ray's schemas ignore unknown keys (forward compatibility), so a typo such as `num_gpu` would pass
    # the schema and then do nothing. Every key must be a field of the model that reads it.
    config = serve_configs()[source]
    checks = [
        (config, serve_schema.ServeDeploySchema, "top level"),
        (config["http_options"], serve_schema.HTTPOptionsSchema, "http_options"),
        (config["grpc_options"], serve_schema.gRPCOptionsSchema, "grpc_options"),
        (app_of(config), serve_schema.ServeApplicationSchema, "application"),
    ]
    for d in app_of(config)["deployments"]:
        checks.append((d, serve_schema.DeploymentSchema, d["name"]))
        checks.append((d.get("ray_actor_options", {}), serve_schema.RayActorOptionsSchema, d["name"]))
        checks.append((d.get("autoscaling_config") or {}, AutoscalingConfig, d["name"]))
    for raw, model, where in checks:
        assert set(raw) <= field_names(model), f"{source} {where}: unknown {set(raw) - field_names(model)}"


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_both_configs_override_exactly_the_four_deployments_the_app_creates(source):
    assert set(deployments_of(serve_configs()[source])) == DEPLOYMENTS


def test_rayservice_holds_the_same_application_as_serve_config():
    local, kube = serve_configs().values()
    assert deployments_of(kube) == deployments_of(local)
    assert kube["grpc_options"] == local["grpc_options"]
    for key in ("name", "import_path", "runtime_env"):
        assert app_of(kube)[key] == app_of(local)[key]


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_application_uses_the_builder_and_its_args(source):
    app = app_of(serve_configs()[source])
    assert app["import_path"] == IMPORT_PATH
    assert set(app["args"]) <= {"config", "redis_url"} and app["args"]["config"].endswith(".yaml")
    assert app["args"]["redis_url"] == REDIS_URL_REFERENCE
    assert app["runtime_env"]["env_vars"]["CASCADE_SERVICE_HOME"] == "/models"


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_tiers_get_gpus_and_coordinator_gets_none(source):
    deployments = deployments_of(serve_configs()[source])
    assert not deployments["coordinator"]["ray_actor_options"].get("num_gpus")
    for tier in ("large", "base", "small"):
        options = deployments[f"tier-{tier}"]["ray_actor_options"]
        assert options["num_gpus"] > 0 and options["resources"] == {f"tier_{tier}": options["num_gpus"]}


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_every_accelerator_type_is_one_ray_knows(source):
    import ray.util.accelerators as accelerators

    known = {v for k, v in vars(accelerators).items() if k.isupper() and isinstance(v, str)}
    used = {d["ray_actor_options"].get("accelerator_type") for d in deployments_of(serve_configs()[source]).values()}
    assert used - {None} <= known, used - {None} - known
    assert used - {None} == {"H100", "A10G", "L4"}


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_every_replica_fits_a_worker_that_offers_its_custom_resources(source, placement):
    workers = PLACEMENTS[placement]()
    for name, deployment in deployments_of(serve_configs()[source]).items():
        wanted = requested(deployment)
        fits = [w for w, (offered, _) in workers.items() if all(offered.get(k, 0) >= v for k, v in wanted.items())]
        assert fits, f"{placement}: no worker type offers {wanted} for {name}"


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_tier_workers_can_hold_max_replicas(source, placement):
    # A tier resource exists only on its own workers, so their total at max size bounds the tier's replicas.
    workers = PLACEMENTS[placement]()
    for name, deployment in deployments_of(serve_configs()[source]).items():
        for resource, per_replica in deployment["ray_actor_options"].get("resources", {}).items():
            capacity = sum(offered.get(resource, 0) * most for offered, most in workers.values())
            needed = deployment["autoscaling_config"]["max_replicas"] * per_replica
            assert capacity >= needed, f"{placement}: {name} needs {needed} {resource}, at most {capacity}"


def test_cluster_yaml_passes_the_cluster_launchers_schema():
    import jsonschema
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    cluster = load_yaml("cluster.yaml")
    jsonschema.validate(cluster, schema)
    assert cluster["available_node_types"][cluster["head_node_type"]]["resources"].get("GPU", 0) == 0


def test_kuberay_gpu_groups_select_the_gpu_product_their_tier_asks_for():
    groups = load_yaml("kuberay/rayservice.yaml")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    offered = rayservice_worker_groups()
    for group in groups:
        resources, _ = offered[group["groupName"]]
        kinds = [k[len(ACCELERATOR_PREFIX) :] for k in resources if k.startswith(ACCELERATOR_PREFIX)]
        product = group["template"]["spec"].get("nodeSelector", {}).get("nvidia.com/gpu.product", "")
        gpus = group["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", "0")
        assert [kind in product for kind in kinds] == [True] * len(kinds), (group["groupName"], product)
        assert (int(gpus) > 0) == bool(kinds) == bool(product), group["groupName"]


def test_kuberay_head_exposes_the_grpc_port():
    spec = load_yaml("kuberay/rayservice.yaml")["spec"]
    port = yaml.safe_load(spec["serveConfigV2"])["grpc_options"]["port"]
    head = spec["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert port in {p["containerPort"] for p in head["ports"]}


def _split_import_path(path: str) -> tuple[str, str]:
    # Ray's import_attr accepts both `pkg.module.attr` and `pkg.module:attr`.
    module, _, attr = path.rpartition(":") if ":" in path else path.rpartition(".")
    return module, attr


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_grpc_servicer_functions_are_the_apps_and_import(source):
    """The deploy files register exactly what `serve --frontend ray` registers, and each path imports."""
    from cascade_service.serving.app import GRPC_SERVICER_FUNCTIONS

    grpc_options = serve_configs()[source]["grpc_options"]
    functions = grpc_options["grpc_servicer_functions"]
    assert functions == GRPC_SERVICER_FUNCTIONS
    assert functions == [CASCADE_SERVICER, HEALTH_SERVICER, REFLECTION_SERVICER]
    # Ray serves v1alpha itself unless told not to; v1 (ours) advertises it.
    assert grpc_options.get("enable_reflection", True) is True
    dotted = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
    for path in functions:
        module, attr = _split_import_path(path)
        assert dotted.fullmatch(module) and attr.startswith("add_"), path
        assert callable(getattr(importlib.import_module(module), attr)), path


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_the_app_config_named_in_args_loads_and_builds_exactly_these_deployments(source, monkeypatch):
    from cascade_service.config import ModelTierConfig, deployment_name, load_config, tier_groups
    from cascade_service.serving.app import COORDINATOR

    monkeypatch.setenv("CASCADE_SERVICE_HOME", "/models")
    monkeypatch.setenv(REDIS_URL_ENV, "redis://cascade-redis:6379/0")
    args = app_of(serve_configs()[source])["args"]
    assert args["config"].startswith("/app/configs/")
    config = load_config(Path(__file__).parents[2] / "configs" / args["config"].removeprefix("/app/configs/"))
    models = [t.name for t in config.cascade.tiers if isinstance(t, ModelTierConfig)]
    built = {COORDINATOR} | {
        deployment_name(g) for g in tier_groups(models, config.serving.colocate, config.serving.groups)
    }
    assert built == set(deployments_of(serve_configs()[source]))


# Sessions: one Redis URL, read from the environment, that every kind of cluster sets.


def _app_config_raw(source: str) -> dict:
    """The cascade-service config the app's args name, as written in configs/ (no expansion)."""
    path = app_of(serve_configs()[source])["args"]["config"]
    return yaml.safe_load((ROOT / "configs" / path.removeprefix("/app/configs/")).read_text())


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_the_app_and_its_config_read_the_redis_url_from_the_environment(source):
    assert app_of(serve_configs()[source])["args"]["redis_url"] == REDIS_URL_REFERENCE
    assert _app_config_raw(source)["serving"]["redis_url"] == REDIS_URL_REFERENCE


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice serveConfigV2"])
def test_the_app_builder_binds_the_url_the_environment_gives(source, monkeypatch):
    from cascade_service.config import ConfigError
    from cascade_service.serving.app import app_builder

    args = dict(app_of(serve_configs()[source])["args"])
    args["config"] = str(ROOT / "configs" / args["config"].removeprefix("/app/configs/"))
    monkeypatch.setenv("CASCADE_SERVICE_HOME", "/models")
    monkeypatch.setenv(REDIS_URL_ENV, "redis://sessions.example:6380/2")
    app = app_builder(args)
    # CoordinatorDeployment(config_path, tiers, redis_url, max_ongoing): Ray keeps the bound arguments here.
    assert app._bound_deployment.init_args[2] == "redis://sessions.example:6380/2"
    monkeypatch.delenv(REDIS_URL_ENV)
    with pytest.raises(ConfigError, match=re.escape(REDIS_URL_REFERENCE)):
        app_builder(args)


def test_every_ray_pod_gets_the_redis_url_of_the_redis_service():
    redis = redis_objects()
    service, pod = redis["Service"]["spec"], redis["Deployment"]["spec"]["template"]
    (port,) = service["ports"]
    for group, template in ray_pod_templates().items():
        ray_container = template["spec"]["containers"][0]  # the one KubeRay runs `ray start` in
        env = {e["name"]: e.get("value") for e in ray_container.get("env", [])}
        url = urlsplit(env.get(REDIS_URL_ENV) or "")
        assert url.scheme == "redis", (group, env)
        # The Service's short name resolves in the RayService's own namespace, where both are applied.
        assert (url.hostname, url.port or 6379) == (redis["Service"]["metadata"]["name"], port["port"]), group
    assert service["selector"].items() <= pod["metadata"]["labels"].items()
    container_ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]}
    assert container_ports[port["targetPort"]] == 6379  # redis-server's port: no --port in its args
    assert "--port" not in pod["spec"]["containers"][0]["args"]


def test_the_redis_deployment_selects_its_pods_and_the_network_policy_admits_ray_pods():
    redis = redis_objects()
    labels = redis["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert redis["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert redis["Deployment"]["spec"]["replicas"] == 1  # sessions live in one instance
    policy = redis["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    (rule,) = policy["ingress"]
    # KubeRay puts this label on every Pod it creates (utils.RayNodeLabelKey).
    assert rule["from"] == [{"podSelector": {"matchLabels": {"ray.io/is-ray-node": "yes"}}}]
    assert [p["port"] for p in rule["ports"]] == [6379]


def test_cluster_launcher_containers_get_a_redis_url_every_node_can_reach():
    options = load_yaml("cluster.yaml")["docker"]["run_options"]
    urls = [o.split("=", 1)[1] for o in options if re.match(rf"(--env|-e)[ =]{REDIS_URL_ENV}=", o)]
    assert len(urls) == 1, options
    url = urlsplit(urls[0])
    assert url.scheme in ("redis", "rediss") and url.hostname and url.hostname not in LOOPBACK_HOSTS, urls


def test_no_deploy_file_names_a_loopback_redis():
    # A cluster node has no Redis of its own: a loopback URL would reach nothing (or Ray's GCS port).
    files = [p for p in DEPLOY.rglob("*") if p.is_file()] + [ROOT / "configs" / "cluster.yaml"]
    found = {}
    for path in files:
        for url in re.findall(r"rediss?://[^\s\"'`]+", path.read_text()):
            found[url] = path.relative_to(ROOT)
    assert found, "the deploy files name at least the KubeRay Redis"
    loopback = {url: str(where) for url, where in found.items() if urlsplit(url).hostname in LOOPBACK_HOSTS}
    assert not loopback


# Kubernetes objects: what kubectl would send, checked against the API's own schemas (strict: unknown
# fields fail, as `kubectl apply --validate=strict` would). The RayService CRD is not in those schemas,
# so its pod templates are checked on their own, as PodTemplates.

K8S_VERSIONS = ["1.28", "latest"]


def _k8s_objects() -> dict[str, dict]:
    objects = {
        f"rayservice {group}": {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"cascade-{group}"},
            "template": template,
        }
        for group, template in ray_pod_templates().items()
    }
    return objects | {f"redis.yaml {kind}": doc for kind, doc in redis_objects().items()}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", sorted(_k8s_objects()))
def test_kubernetes_objects_validate_against_the_api_schema(name, version):
    import kubernetes_validate

    version = kubernetes_validate.latest_version() if version == "latest" else version
    kubernetes_validate.validate(_k8s_objects()[name], version, strict=True)


def test_kubernetes_validation_catches_a_wrong_pod_template():
    import kubernetes_validate

    template = copy.deepcopy(ray_pod_templates()["head"])
    template["spec"]["containers"][0]["ports"][0]["containerPort"] = "9000"  # a string, not a port
    bad = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "bad"}, "template": template}
    with pytest.raises(kubernetes_validate.ValidationError, match="is not of type 'integer'"):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)
    template = copy.deepcopy(ray_pod_templates()["cpu"])
    template["spec"]["containers"][0]["envv"] = []  # a typo kubectl would drop or refuse
    bad["template"] = template
    with pytest.raises(kubernetes_validate.ValidationError, match="'envv' was unexpected"):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


def test_every_ray_pod_that_hosts_replicas_mounts_the_model_zoo():
    # Coordinators read the target's tokenizer and MaG's bigram table; tiers read their weights.
    for group, template in ray_pod_templates().items():
        if group == "head":
            continue  # num-cpus 0: no replicas
        mounts = {m["mountPath"]: m["name"] for m in template["spec"]["containers"][0].get("volumeMounts", [])}
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        assert "/models" in mounts and "persistentVolumeClaim" in volumes[mounts["/models"]], group
