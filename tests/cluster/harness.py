"""The multi-node cluster the tests in tests/cluster share: Ray nodes on loopback shaped like
deploy/cluster.yaml (a head with no CPUs for replicas, a CPU node for the coordinator, a node per GPU
pool), the app deployed from deploy/serve_config.yaml with only resources changed, and the tools the
tests read it with: where replicas run, how many are running, and a load of clients checking every
output against the oracle."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

import yaml

from cascade_service.client import CascadeClient, errors

from ..helpers.deploy_files import app_of, deployments_of, load_yaml

# node -> the resources it offers: pool resources (the shipped file's tier_* names, one unit per GPU it
# would have) and CPUs. Only the "cpu" node has CPUs for replicas, so the coordinator lands there, as on
# the shipped cluster (the head's CPU: 0 keeps replicas off it); the tiers need no CPU here, only their pool.
NODES = {
    "cpu": {"num_cpus": 1, "resources": {}},
    "large": {"num_cpus": 0, "resources": {"tier_large": 4}},
    "drafters": {"num_cpus": 0, "resources": {"tier_base": 1, "tier_small": 1}},
}
# Autoscaling per tier, chosen from what each tier carries: the target holds a request's reviews for most of
# its time, so it is the bottleneck and scales on calls in flight; the drafters and the coordinator would
# need far more load. The target's threshold is half a call per replica, not the shipped 8: on 2 cores the
# tiny target is not the machine's bottleneck (the coordinator's Python is), so its mean calls in flight
# under 8 streams hover near 1; at a threshold of 1 Serve decided after 34 s here and not within 150 s on
# CI's machine. Idle, the mean is 0 and the target goes back to 1 replica, after 30 s below the threshold:
# a shorter delay let it flap back while the load still ran (a request whose replica is stopped between
# its calls reads its context again on another). At most 2 target replicas: each that starts takes a
# core for seconds. Faster than Serve's defaults so that a test sees both ways; Ray 2.60 pushes the
# metrics every `metrics_interval_s` (deprecated there in favour of METRIC_ENV's variables, which it
# does not read yet) and averages them over `look_back_period_s`.
AUTOSCALING = {"upscale_delay_s": 3, "downscale_delay_s": 30, "look_back_period_s": 5, "metrics_interval_s": 1}
TARGETS = {"coordinator": 64, "tier-large": 0.5, "tier-base": 64, "tier-small": 64}
MAX_REPLICAS = {"tier-large": 2}
METRIC_ENV = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
}
K_MATRIX = [[4, 2, 0], [0, 2, 6], [0, 0, 6]]  # the target's row drafts with base and small
N = 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_cascade_config(family, redis_url: str, path, k_matrix=K_MATRIX) -> None:
    raw = {
        "tiers": {
            "target": {"name": "large", "path": str(family["target"])},
            "drafters": [
                {"name": "base", "path": str(family["close"])},
                {"name": "small", "path": str(family["mid"])},
                {"kind": "mag"},
            ],
        },
        "schedule": {"k_matrix": k_matrix, "leniency": 1.5},
        "generation": {"max_new_tokens": N},
        # A replica that Serve stops (a rolling update, a scale-down) finishes its calls in flight within
        # this; a coordinator's calls may wait there for a tier's new replica to load (see
        # test_rolling_update), so it is longer than the default 10 s.
        "serving": {"redis_url": redis_url, "torch_threads": 1, "adapt_to_load": False, "shutdown_grace_s": 60},
    }
    path.write_text(yaml.safe_dump(raw))


def serve_config(config_path, redis_url: str, http_port: int, grpc_port: int) -> dict:
    """deploy/serve_config.yaml with this machine's ports, the tiny family's config, and no GPUs: each
    deployment keeps its pool resource and replica settings; CPUs are cut to fit 2 cores."""
    raw = load_yaml("serve_config.yaml")
    raw["proxy_location"] = "HeadOnly"
    raw["http_options"] = {"host": "127.0.0.1", "port": http_port}
    raw["grpc_options"]["port"] = grpc_port
    app = app_of(raw)
    app["args"] = {"config": str(config_path), "redis_url": redis_url}
    app["runtime_env"] = {"worker_process_setup_hook": "cascade_service.serving.loopback.setup_worker"}
    for name, deployment in deployments_of(raw).items():
        options = deployment["ray_actor_options"]
        options["num_cpus"] = 0.1 if name == "coordinator" else 0
        options.pop("num_gpus", None)
        options.pop("accelerator_type", None)
        deployment["autoscaling_config"] |= AUTOSCALING | {"target_ongoing_requests": TARGETS[name]}
        if name in MAX_REPLICAS:
            deployment["autoscaling_config"]["max_replicas"] = MAX_REPLICAS[name]
    return raw


@dataclass
class RunningCluster:
    nodes: object  # ray.cluster_utils.Cluster
    added: dict[str, object]  # NODES' names -> the node started for it (replaced when a test kills one)
    grpc_port: int
    raw: dict  # the Serve config deployed (tests that redeploy change a copy)
    family: dict = field(default_factory=dict)

    def replace(self, name: str) -> float:
        """Kill the node of `name` and add another like it, as a cluster autoscaler would; returns when
        it was lost (time.monotonic)."""
        self.nodes.remove_node(self.added[name])
        lost = time.monotonic()
        self.added[name] = self.nodes.add_node(**NODES[name])
        return lost


def replica_nodes() -> dict[str, set[str]]:
    """Deployment name -> the ids of the nodes its live replicas run on, as Ray's GCS reports them (the
    state API would need the dashboard, which this cluster does not run)."""
    from ray._private import state

    placed: dict[str, set[str]] = {}
    for actor in state.actors().values():
        name = actor.get("ActorClassName") or ""
        if actor.get("State") == "ALIVE" and name.startswith("ServeReplica:cascade:"):
            placed.setdefault(name.split(":")[-1], set()).add(actor["Address"]["NodeID"])
    return placed


def running() -> dict[str, int]:
    """Deployment name -> RUNNING replicas, and "starting": replicas of any deployment on their way."""
    from ray import serve

    deployments = serve.status().applications["cascade"].deployments
    return {name: int(d.replica_states.get("RUNNING", 0)) for name, d in deployments.items()} | {
        "starting": sum(int(d.replica_states.get("STARTING", 0)) for d in deployments.values())
    }


class Load:
    """Clients sending greedy requests, one thread per prompt, until the block ends: each call's end
    time, outcome ("ok", a failure's status, or "UNAVAILABLE without a retry hint") and stats, and the
    prompts whose tokens were not the oracle's. Kept here, not asserted in the threads, where a failed
    assert would only end its thread."""

    def __init__(self, grpc_port: int, prompts: list[list[int]], expected: list[list[int]], pause_s: float = 0.0):
        self.port, self.prompts, self.expected, self.pause_s = grpc_port, prompts, expected, pause_s
        self.outcomes: list[tuple[float, str]] = []
        self.stats: list[tuple[int, float, float, dict]] = []  # (prompt, sent, ended, stats) of each call served
        self.messages: list[str] = []  # each failure's message, for the assertion that shows them
        self.wrong: list[int] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(len(prompts))]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=150)

    def ok(self) -> int:
        return sum(o == "ok" for _, o in self.outcomes)

    def failures(self) -> list[str]:
        return [o for _, o in self.outcomes if o != "ok"]

    def _run(self, i: int) -> None:
        with CascadeClient(f"127.0.0.1:{self.port}", timeout_s=120) as client:
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    # The K-matrix every round (not the floor's timing-driven choice): each call of a prompt
                    # then feeds the tiers the same tokens, and a schedule's switch shows in the drafters called.
                    got = client.generate(
                        prompt_token_ids=self.prompts[i], max_new_tokens=N, temperature=0, speculation="fixed"
                    )
                except errors.CascadeError as exc:
                    hinted = exc.code.name != "UNAVAILABLE" or exc.retry_delay_s is not None
                    self.outcomes.append(
                        (time.monotonic(), exc.code.name + ("" if hinted else " without a retry hint"))
                    )
                    self.messages.append(f"{exc.code.name}: {exc}")
                    time.sleep(self.pause_s)
                    continue
                self.outcomes.append((time.monotonic(), "ok"))
                self.stats.append((i, sent, time.monotonic(), got.stats))
                if got.token_ids != self.expected[i]:
                    self.wrong.append(i)
