"""One multi-node cluster for every test in tests/cluster (package scope: it stops before the rest of the
suite starts its own Ray). The modules run in name order, which is the order that matters: placement and
autoscaling on the cluster as deployed, then a rolling update, then lost nodes (test_survival), which
replace nodes."""

from __future__ import annotations

import os

import pytest

from ..helpers.deploy_files import validate_model
from .harness import METRIC_ENV, NODES, RunningCluster, free_port, serve_config, write_cascade_config


@pytest.fixture(scope="package")
def cluster(tiny_family, tmp_path_factory, redis_server):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    from cascade_service.serving.loopback import loopback_ray
    from cascade_service.serving.session_actor import RAY_NAMESPACE

    runtime_env = loopback_ray()
    os.environ.update(METRIC_ENV)  # before the nodes start: their workers inherit it
    # The head runs Serve's controller and proxy and no replica (deploy/cluster.yaml's head has CPU: 0).
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    added = {name: nodes.add_node(**spec) for name, spec in NODES.items()}
    ray.init(address=nodes.address, namespace=RAY_NAMESPACE, runtime_env=runtime_env, log_to_driver=False)
    path = tmp_path_factory.mktemp("cluster") / "cascade.yaml"
    write_cascade_config(tiny_family, redis_server.url, path)
    http_port, grpc_port = free_port(), free_port()
    raw = serve_config(path, redis_server.url, http_port, grpc_port)
    client = serve_start(
        http_options=raw["http_options"], grpc_options=raw["grpc_options"], proxy_location=raw["proxy_location"]
    )
    client.deploy_apps(validate_model(ServeDeploySchema, raw), _blocking=True)
    try:
        yield RunningCluster(nodes, added, grpc_port, raw, tiny_family)
    finally:
        serve.shutdown()
        ray.shutdown()
        nodes.shutdown()
