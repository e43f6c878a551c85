"""A rolling update under load: the app redeployed with a new K-matrix and a new replica count, as
`serve deploy` of an edited config does (the same call into Serve's controller; this cluster runs no
dashboard for the CLI to reach). Serve replaces the replicas one by one while clients keep sending:
no call fails, every output is the oracle's, and calls sent after the switch run the new schedule."""

from __future__ import annotations

import copy
import time

import pytest

from cascade_service.zoo.tiny import random_prompts

from ..helpers.deploy_files import deployments_of, validate_model
from ..helpers.oracle import oracle
from .harness import Load, running, write_cascade_config

pytestmark = pytest.mark.cluster

NEW_K_MATRIX = [[3, 0, 4], [0, 2, 6], [0, 0, 6]]  # the target's row now drafts with base and MaG, not small


def _target_row_drafters(stats: dict) -> set[str]:
    return {name for name, entry in stats["rows"]["large"]["entries"].items() if entry.get("blocks", 0)}


def test_a_rolling_update_under_load_fails_no_call_and_switches_the_schedule(cluster, tmp_path, redis_server):
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    prompts = random_prompts(4, 10, seed=84)
    expected = [oracle(cluster.family["target"], p, 12) for p in prompts]
    path = tmp_path / "cascade-v2.yaml"
    write_cascade_config(cluster.family, redis_server.url, path, k_matrix=NEW_K_MATRIX)
    raw = copy.deepcopy(cluster.raw)
    raw["applications"][0]["args"]["config"] = str(path)
    deployments_of(raw)["tier-small"]["autoscaling_config"]["min_replicas"] = 2
    with Load(cluster.grpc_port, prompts, expected) as load:
        deadline = time.monotonic() + 60
        while load.ok() < 8:
            assert time.monotonic() < deadline, load.messages
            time.sleep(0.1)
        began = time.monotonic()
        _get_global_client().deploy_apps(validate_model(ServeDeploySchema, raw), _blocking=False)
        deadline = began + 240
        while True:
            status = serve.status().applications["cascade"]
            done = status.status == "RUNNING" and running()["tier-small"] == 2 and not running()["starting"]
            if done:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.5)
        switched = time.monotonic()
        while sum(sent > switched for _, sent, _, _ in load.stats) < 8:  # calls that began after the switch
            assert time.monotonic() < switched + 60, load.messages
            time.sleep(0.1)
    print(f"rolling update: {switched - began:.1f} s, {load.ok()} calls served, {len(load.failures())} failed")
    assert not load.failures(), load.messages
    assert not load.wrong, load.wrong
    before = [_target_row_drafters(stats) for _, _, ended, stats in load.stats if ended < began]
    after = [_target_row_drafters(stats) for _, sent, _, stats in load.stats if sent > switched]
    assert before and all("small" in d for d in before), before  # the old row: base and small
    assert after and all("small" not in d for d in after), after  # the new row: base and MaG
    assert any(d & {"mag"} for d in after), after
