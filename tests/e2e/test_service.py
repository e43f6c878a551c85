"""The real service: the Ray Serve app on local Ray, gRPC over loopback, sessions in a real Redis.

Greedy output through the service equals `transformers` greedy `generate()` (the oracle) and the
in-process engine; streaming yields the same tokens; sessions live in Redis; the whole app (every
tier and the coordinator) is restarted mid-conversation and the session continues with nothing lost;
tier replicas free a request's KV cache when it ends; the replicas' metrics reach Ray's exporter.
"""

from __future__ import annotations

import os
import re

import pytest
import ray
import redis
import yaml
from ray.exceptions import RaySystemError

from cascade_service import procfs
from cascade_service.client import CascadeClient, errors
from cascade_service.config import GenerationConfig, load_config
from cascade_service.core.verify import Verification
from cascade_service.inprocess import InProcess
from cascade_service.serving.app import APP_NAME
from cascade_service.serving.local import LocalService
from cascade_service.serving.tier_deployment import tier_deployment_name
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import oracle

PROMPTS = random_prompts(3, 10, seed=31)
REPORT_INTERVAL = "RAY_metrics_report_interval_ms"
K = [[4, 2, 0], [0, 2, 6], [0, 0, 6]]


@pytest.fixture(scope="module")
def config_path(tiny_family, tmp_path_factory, redis_server):
    raw = {
        "tiers": {
            "target": {"name": "target", "path": str(tiny_family["target"])},
            "drafters": [
                {"name": "close", "path": str(tiny_family["close"])},
                {"name": "mid", "path": str(tiny_family["mid"])},
                {"kind": "mag"},
            ],
        },
        "schedule": {"k_matrix": K, "leniency": 1.5, "lookup": {"min_match": 2, "tokens": 10}},
        "generation": {"max_new_tokens": 16},
        # A tight coordinator queue (one at work, one waiting) for the overload test; the other tests
        # send one request at a time.
        "serving": {
            "redis_url": redis_server.url,
            "session_namespace": "e2e",
            "torch_threads": 1,
            # The K-matrix every round: lossy rules' output depends on what was drafted, and this module
            # compares it with in-process runs of the same schedule.
            "adapt_to_load": False,
            "deployments": {"coordinator": {"max_ongoing_requests": 1, "max_queued_requests": 1}},
        },
    }
    path = tmp_path_factory.mktemp("e2e") / "service.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def service(config_path):
    # Ray's workers report their metrics each second instead of every ten (the exporter test waits less).
    before = os.environ.get(REPORT_INTERVAL)
    os.environ[REPORT_INTERVAL] = "1000"
    svc = LocalService(str(config_path), port=0, num_cpus=4)
    try:
        svc.start()
        yield svc
        started_ray = svc.started_ray  # this module's service started the process's Ray, so stops it
        svc.stop()
        # Once stopped, nothing in this process starts a Ray of its own (a thread of Serve's left behind
        # once did: a second local cluster nothing stopped); an API call says Ray is not running.
        assert started_ray
        with pytest.raises(RaySystemError, match="Ray has not been started"):
            ray.get_actor("anything")
    finally:
        if before is None:
            os.environ.pop(REPORT_INTERVAL, None)
        else:
            os.environ[REPORT_INTERVAL] = before


@pytest.fixture()
def client(service):
    with CascadeClient(service.address, timeout_s=120) as c:
        yield c


def test_greedy_output_through_the_service_equals_the_oracle_and_in_process(tiny_family, config_path, client):
    engine = InProcess(load_config(config_path).cascade)
    for prompt in PROMPTS:
        expected = oracle(tiny_family["target"], prompt, 24)
        result = client.generate(prompt_token_ids=prompt, max_new_tokens=24)  # the default: the floor decides
        assert result.token_ids == expected
        assert result.token_ids == engine.generate(prompt, GenerationConfig(max_new_tokens=24)).token_ids
        drafting = client.generate(prompt_token_ids=prompt, max_new_tokens=24, speculation="fixed")  # every round
        assert drafting.token_ids == expected
        stats = drafting.stats
        assert stats["target_calls"] < 24 and set(stats["tiers"]) >= {"target", "close", "mid"}
        streamed = list(client.stream(prompt_token_ids=prompt, max_new_tokens=24))
        assert [t for c in streamed for t in c.token_ids] == expected
        assert "".join(c.text for c in streamed) == result.text


def test_lossy_rules_through_the_service_equal_in_process(config_path, client):
    # The target is a deployment of its own here: its review applies the request's rule remotely, and
    # fuzzy rules make greedy drafts carry their rows across deployments.
    engine = InProcess(load_config(config_path).cascade)
    # A lossy rule's output depends on what was drafted: every round as scheduled on both sides.
    for rule, alpha in (("token-v3", 0.5), ("fuzzy-tv", 0.6), ("lossy", 0.3)):
        gen = GenerationConfig(max_new_tokens=24, verification=Verification(rule, alpha), speculation="fixed")
        mine = engine.generate(PROMPTS[0], gen)
        served = client.generate(
            prompt_token_ids=PROMPTS[0], max_new_tokens=24, verification=rule, alpha=alpha, speculation="fixed"
        )
        assert served.token_ids == mine.token_ids, rule
        assert served.stats["verification"] == mine.stats.verification
        assert int(served.stats.get("off_target_tokens", 0)) == mine.stats.off_target_tokens
    with pytest.raises(errors.InvalidArgument, match="verification.alpha"):
        client.generate(prompt_token_ids=PROMPTS[0], max_new_tokens=4, verification="token-v3", alpha=3.0)
    with pytest.raises(errors.InvalidArgument, match="verification.rule"):
        client.generate(prompt_token_ids=PROMPTS[0], max_new_tokens=4, verification="nope")


def test_overload_gets_resource_exhausted_and_admitted_requests_stay_exact(tiny_family, service):
    import threading

    prompt = PROMPTS[1]
    expected = oracle(tiny_family["target"], prompt, 24)
    outcomes: list[object] = []
    lock = threading.Lock()

    def one() -> None:
        with CascadeClient(service.address, timeout_s=120) as c:
            try:
                result = c.generate(prompt_token_ids=prompt, max_new_tokens=24).token_ids
            except errors.CascadeError as exc:
                result = exc.code.name
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    exhausted = [o for o in outcomes if o == "RESOURCE_EXHAUSTED"]
    served = [o for o in outcomes if isinstance(o, list)]
    assert len(exhausted) + len(served) == 8, outcomes  # nothing else: no UNAVAILABLE, no hang
    assert exhausted and served, outcomes
    assert all(tokens == expected for tokens in served)
    with CascadeClient(service.address, timeout_s=120) as c:  # and afterwards it answers again
        assert c.generate(prompt_token_ids=prompt, max_new_tokens=24).token_ids == expected


def test_sessions_live_in_redis_and_survive_an_app_restart(tiny_family, service, client, redis_server):
    prompt = PROMPTS[0]
    session = client.create_session(prompt_token_ids=prompt[:4])
    first = client.generate(prompt_token_ids=prompt[4:], session_id=session.session_id, max_new_tokens=6)
    assert first.token_ids == oracle(tiny_family["target"], prompt, 6)
    keys = redis.Redis.from_url(redis_server.url).keys("e2e:session:*")
    assert f"e2e:session:{session.session_id}".encode() in keys

    service.restart_app()  # every tier replica and the coordinator are new processes now

    more = [5, 6, 7]
    second = client.generate(prompt_token_ids=more, session_id=session.session_id, max_new_tokens=6)
    history = prompt + first.token_ids + more
    assert second.token_ids == oracle(tiny_family["target"], history, 6)
    stored = client.get_session(session.session_id)
    assert list(stored.token_ids) == history + second.token_ids and stored.version == 2


def test_bad_input_is_invalid_argument_and_the_service_keeps_answering(tiny_family, client):
    with pytest.raises(errors.InvalidArgument, match="max_new_tokens"):
        client.generate(prompt_token_ids=PROMPTS[1], max_new_tokens=0)
    with pytest.raises(errors.InvalidArgument, match="top_p"):
        list(client.stream(prompt_token_ids=PROMPTS[1], top_p=2.0))
    with pytest.raises(errors.NotFound, match="session_id"):
        client.generate(prompt_token_ids=PROMPTS[1], session_id="missing")
    assert client.generate(prompt_token_ids=PROMPTS[1], max_new_tokens=5).token_ids == oracle(
        tiny_family["target"], PROMPTS[1], 5
    )


def test_tiers_free_each_requests_kv_cache_when_it_ends(client):
    from ray import serve

    client.generate(prompt_token_ids=PROMPTS[2], max_new_tokens=8)
    list(client.stream(prompt_token_ids=PROMPTS[2], max_new_tokens=8))
    for tier in ("target", "close", "mid"):
        handle = serve.get_deployment_handle(tier_deployment_name(tier), app_name=APP_NAME)
        assert handle.cached_requests.remote().result() == 0


def test_a_plain_grpc_call_without_a_deadline_is_served(tiny_family, service):
    # Our client always sets a deadline; a bare gRPC client need not (the edge once turned "no deadline",
    # which gRPC reports as ~1e308 s left, into a timer that overflowed: UNAVAILABLE).
    import grpc

    from cascade_service.proto.v1 import cascade_pb2 as pb
    from cascade_service.proto.v1 import cascade_pb2_grpc as pb_grpc

    with grpc.insecure_channel(service.address) as channel:
        stub = pb_grpc.CascadeServiceStub(channel)
        reply = stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPTS[1], max_new_tokens=6))
        streamed = [
            t
            for c in stub.GenerateStream(pb.GenerateRequest(prompt_token_ids=PROMPTS[1], max_new_tokens=6))
            for t in c.token_ids
        ]
    assert list(reply.token_ids) == streamed == oracle(tiny_family["target"], PROMPTS[1], 6)


def _tier_counters() -> dict[str, dict[str, int]]:
    from ray import serve

    return {
        tier: serve.get_deployment_handle(tier_deployment_name(tier), app_name=APP_NAME).counters.remote().result()
        for tier in ("target", "close", "mid")
    }


def _calls() -> int:
    return sum(c["calls"] for c in _tier_counters().values())


def _wait_until_no_tier_holds_a_cache(timeout_s: float = 30.0) -> float:
    import time

    start = time.monotonic()
    while any(c["cached_requests"] for c in _tier_counters().values()):
        assert time.monotonic() - start < timeout_s, _tier_counters()
        time.sleep(0.05)
    return time.monotonic() - start


# A full decode of this many tokens takes over a thousand tier calls (at most 13 tokens a target round,
# each round at least two calls); a cancel that reaches the tiers stops it after the round under way.
LONG = 4000  # within the 4,096 positions of the tiny models
AFTER_CANCEL_CALLS = 12  # the round under way: target review + close + mid drafts, with slack
# The cancel reaches the coordinator some time after the client gave up (the client's deadline and the
# server's fire apart; a loaded 2-core machine adds its delays): the calls made in that time are not
# work after the cancel. It is bounded as a share of the request's rate before the cancel: the tiers
# stop within the round under way plus a tenth of the time the request had run (once 14 calls against
# 12 flaked CI with an absolute bound).
PROPAGATION_SHARE = 0.1


@pytest.mark.parametrize("how", ["deadline", "unary-cancel", "stream-cancel"])
def test_a_client_deadline_or_cancel_stops_the_tiers_work_and_frees_their_caches(service, client, how):
    import time

    import grpc

    from cascade_service.proto.v1 import cascade_pb2 as pb
    from cascade_service.proto.v1 import cascade_pb2_grpc as pb_grpc

    before = _calls()
    if how == "unary-cancel":  # a client that hangs up on a unary call (no deadline)
        with grpc.insecure_channel(service.address) as channel:
            call = pb_grpc.CascadeServiceStub(channel).Generate.future(
                pb.GenerateRequest(prompt_token_ids=PROMPTS[0], max_new_tokens=LONG)
            )
            time.sleep(1.5)
            assert call.cancel(), call.exception() or len(call.result().token_ids)
    elif how == "deadline":
        with pytest.raises(errors.DeadlineExceeded):
            client.generate(prompt_token_ids=PROMPTS[0], max_new_tokens=LONG, timeout_s=1.5)
    else:
        chunks = client.stream(prompt_token_ids=PROMPTS[0], max_new_tokens=LONG)
        next(chunks)
        time.sleep(1.0)  # the decode is well under way
        chunks.close()
    at_cancel = _calls()
    assert at_cancel - before >= 3, "the request never reached the tiers"
    _wait_until_no_tier_holds_a_cache()
    time.sleep(1.0)  # work that went on would show up here
    after = _calls()
    print(f"{how}: {at_cancel - before} tier calls before the cancel, {after - at_cancel} after")
    assert after - at_cancel <= AFTER_CANCEL_CALLS + PROPAGATION_SHARE * (at_cancel - before)
    assert (
        client.generate(prompt_token_ids=PROMPTS[0], max_new_tokens=8).token_ids
        == client.generate(prompt_token_ids=PROMPTS[0], max_new_tokens=16).token_ids[:8]
    )


def test_health_is_serving(client):
    assert client.health() == "SERVING"


# Last in this module: it replaces the module's app with its own.
def test_the_replicas_metrics_reach_rays_exporter_under_ray_names(service, client):
    import time
    import urllib.request

    import ray

    from cascade_service.metrics import Metrics

    result = client.generate(prompt_token_ids=PROMPTS[2], max_new_tokens=16)
    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    # From the coordinator (requests, acceptance) and from the tier replicas (their forward passes).
    wanted = {
        "ray_cascade_spec_decode_num_accepted_tokens_per_pos_total",
        "ray_cascade_generation_tokens_total",
        "ray_cascade_time_to_first_token_seconds_bucket",
        "ray_cascade_tier_pass_seconds_bucket",
        "ray_cascade_tier_batch_size_count",
    }
    deadline = time.monotonic() + 60
    while True:
        with urllib.request.urlopen(url, timeout=10) as page:
            samples = [line for line in page.read().decode().splitlines() if line.startswith("ray_cascade_")]
        names = {line.split("{")[0].split(" ")[0] for line in samples}
        if wanted <= names:
            break
        assert time.monotonic() < deadline, f"missing from Ray's exporter: {sorted(wanted - names)}"
        time.sleep(1)
    assert names <= Metrics().ray_names()  # the names docs/operations.md gives
    generated = sum(float(line.rsplit(" ", 1)[1]) for line in samples if line.startswith("ray_cascade_generation_"))
    assert generated >= result.stats["generated_tokens"] > 0
    passes = [line for line in samples if line.startswith("ray_cascade_tier_pass_seconds_count")]
    assert {"target", "close"} <= {m.group(1) for line in passes if (m := re.search(r'tier="([^"]+)"', line))}


def test_every_listener_of_the_local_service_binds_loopback(service, client):
    """Ray, Serve replicas and our edge: no socket of this process tree listens beyond 127.0.0.1."""
    assert client.health() == "SERVING"
    listeners = procfs.listeners(procfs.descendants(os.getpid()))
    assert any(port == service.port for _, port, _ in listeners)  # the edge is seen, so the probe works
    assert len({pid for _, _, pid in listeners}) >= 4  # GCS, raylet, replicas: Ray's processes are seen too
    exposed = procfs.beyond_loopback(listeners)
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_embedded_session_store_survives_an_app_restart_and_colocated_target_is_exact(tiny_family, tmp_path):
    # No Redis: sessions live in a detached Ray actor, which outlives the app; the target runs inside
    # the coordinator's replica (serving.colocate), the drafters in their own deployments.
    raw = {
        "tiers": {
            "target": {"name": "target", "path": str(tiny_family["target"])},
            "drafters": [{"name": "close", "path": str(tiny_family["close"])}, {"kind": "mag"}],
        },
        "schedule": {"k_matrix": [[4, 0], [0, 6]], "lookup": {"min_match": 2, "tokens": 10}},
        "serving": {"colocate": ["target"]},
    }
    path = tmp_path / "embedded.yaml"
    path.write_text(yaml.safe_dump(raw))
    from ray import serve

    serve.delete(APP_NAME)  # the module's app shares this Ray; replace it
    svc = LocalService(str(path), port=0)
    svc.start()
    try:
        with CascadeClient(svc.address, timeout_s=120) as client:
            prompt = PROMPTS[1]
            session = client.create_session(prompt_token_ids=prompt)
            first = client.generate(session_id=session.session_id, max_new_tokens=6)
            assert first.token_ids == oracle(tiny_family["target"], prompt, 6)
            assert first.stats["tiers"]["target"].get("hops", 0) == 0 and first.stats["tiers"]["close"]["hops"] > 0
            svc.restart_app()
            second = client.generate(session_id=session.session_id, max_new_tokens=6)
            assert second.token_ids == oracle(tiny_family["target"], prompt + first.token_ids, 6)
            assert client.get_session(session.session_id).version == 2
    finally:
        svc.server.stop(0)
        serve.delete(APP_NAME)
