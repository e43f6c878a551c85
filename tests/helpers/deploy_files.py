"""Reading deploy/: the Serve configs, the cluster launcher YAML, the RayService and its Redis objects."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ACCELERATOR_PREFIX = "accelerator_type:"  # the resource Ray turns ray_actor_options.accelerator_type into


def load_yaml(name: str):
    return yaml.safe_load((DEPLOY / name).read_text())


def load_all(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / name).read_text()) if doc]


def redis_objects() -> dict[str, dict]:
    """kuberay/redis.yaml by kind: Deployment, Service, NetworkPolicy."""
    docs = load_all("kuberay/redis.yaml")
    by_kind = {doc["kind"]: doc for doc in docs}
    assert len(by_kind) == len(docs), "one object of each kind"
    return by_kind


def ray_pod_templates() -> dict[str, dict]:
    """RayService pod templates by group: `head` and every worker group."""
    cluster = load_yaml("kuberay/rayservice.yaml")["spec"]["rayClusterConfig"]
    return {
        "head": cluster["headGroupSpec"]["template"],
        **{g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]},
    }


def validate_model(model, raw: dict):
    # pydantic v2 in current Ray; v1's parse_obj kept for older installs.
    return model.model_validate(raw) if hasattr(model, "model_validate") else model.parse_obj(raw)


def field_names(model) -> set[str]:
    fields = getattr(model, "model_fields", None) or model.__fields__
    return set(fields) | {f.alias for f in fields.values() if getattr(f, "alias", None)}


def serve_configs() -> dict[str, dict]:
    rayservice = load_yaml("kuberay/rayservice.yaml")
    return {
        "serve_config.yaml": load_yaml("serve_config.yaml"),
        "rayservice serveConfigV2": yaml.safe_load(rayservice["spec"]["serveConfigV2"]),
    }


def app_of(config: dict) -> dict:
    (app,) = config["applications"]
    return app


def deployments_of(config: dict) -> dict[str, dict]:
    return {d["name"]: d for d in app_of(config)["deployments"]}


def requested(deployment: dict) -> dict[str, float]:
    """Ray resources one replica asks for, accelerator_type spelled as Ray schedules it."""
    options = deployment.get("ray_actor_options", {})
    wanted = {"CPU": options.get("num_cpus", 0), "GPU": options.get("num_gpus", 0), **options.get("resources", {})}
    if options.get("accelerator_type"):
        wanted[ACCELERATOR_PREFIX + options["accelerator_type"]] = 0.001
    return {k: v for k, v in wanted.items() if v}


def cluster_worker_types() -> dict[str, tuple[dict, int]]:
    """cluster.yaml worker node types -> (resources, max_workers)."""
    cluster = load_yaml("cluster.yaml")
    return {
        name: (spec["resources"], spec.get("max_workers", 0))
        for name, spec in cluster["available_node_types"].items()
        if name != cluster["head_node_type"]
    }


def rayservice_worker_groups() -> dict[str, tuple[dict, int]]:
    """RayService worker groups -> (resources as Ray's KubeRay autoscaler reads them, maxReplicas)."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_ray_resources_from_group_spec

    groups = load_yaml("kuberay/rayservice.yaml")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return {g["groupName"]: (_get_ray_resources_from_group_spec(g, is_head=False), g["maxReplicas"]) for g in groups}
