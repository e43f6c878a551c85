"""Overload on the standalone gRPC server (issue 6): a bounded number of calls in flight.

gRPC's own executor queue is unbounded; `start_server` caps the calls in flight at workers + max_queued,
so a flood gets RESOURCE_EXHAUSTED for the excess while the admitted calls keep the exact tokens, and the
server answers normally afterwards. The target is slowed (test_cancel.SlowScorer) so the calls overlap.
"""

from __future__ import annotations

import threading

import grpc

from cascade_service.api.server import start_server
from cascade_service.config import GenerationConfig, MaGConfig, ModelTierConfig, make_cascade
from cascade_service.inprocess import InProcess
from cascade_service.proto.v1 import cascade_pb2 as pb
from cascade_service.proto.v1 import cascade_pb2_grpc as pb_grpc
from cascade_service.sessions import MemoryStore
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import oracle
from ..helpers.slow import Requests

PROMPT = random_prompts(1, 10, seed=5)[0]

CALLS = 8


def test_calls_beyond_the_bound_get_resource_exhausted_and_admitted_ones_stay_exact(tiny_family):
    cascade = make_cascade(
        ModelTierConfig("target", str(tiny_family["target"])),
        [ModelTierConfig("mid", str(tiny_family["mid"])), MaGConfig()],
        [[3, 1], [0, 3]],
        1.5,
    )
    coordinator = InProcess(cascade).coordinator(MemoryStore(), GenerationConfig(max_new_tokens=24))
    Requests(coordinator)  # slowed target: each call takes a second or so
    server, port = start_server(coordinator, workers=2, max_queued=1)
    expected = oracle(tiny_family["target"], PROMPT, 24)
    outcomes: list[object] = []
    lock = threading.Lock()
    start = threading.Barrier(CALLS)

    def one() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.CascadeServiceStub(channel)
            start.wait()
            try:
                result: object = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT), timeout=60).token_ids)
            except grpc.RpcError as err:
                result = err.code().name
        with lock:
            outcomes.append(result)

    try:
        threads = [threading.Thread(target=one) for _ in range(CALLS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        served = [o for o in outcomes if isinstance(o, list)]
        exhausted = [o for o in outcomes if o == "RESOURCE_EXHAUSTED"]
        print(f"{len(served)} served, {len(exhausted)} RESOURCE_EXHAUSTED of {CALLS}")
        assert len(served) + len(exhausted) == CALLS, outcomes  # nothing else: no hang, no INTERNAL
        assert 2 <= len(served) <= 3 and exhausted, outcomes  # workers run, one waits, the rest are refused
        assert all(tokens == expected for tokens in served)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # and it answers again afterwards
            reply = pb_grpc.CascadeServiceStub(channel).Generate(
                pb.GenerateRequest(prompt_token_ids=PROMPT), timeout=60
            )
        assert list(reply.token_ids) == expected
    finally:
        server.stop(0)
