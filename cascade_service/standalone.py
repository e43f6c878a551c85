"""One process, no Ray: the engine's models with continuous batching, the coordinator and a gRPC server.

`cascade-service serve --frontend standalone` runs this: one machine (one GPU, or the CPU) serving many
concurrent requests, every tier's forward passes batched in the process's engine core (engine.core). The Ray Serve app
(serving/) is the wiring for tiers on separate GPUs and independent scaling.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .api.admission import limits_from
from .api.openai_http import http_options
from .api.server import MAX_QUEUED_RPCS, start_server
from .config import Config, ServingConfig, make_cascade
from .coordinator import Coordinator
from .engine.core import EngineCore
from .inprocess import InProcess
from .rpc.auth import ApiKeys, TlsFiles
from .runtime.assemble import session_store
from .sessions import MemoryStore

DEFAULT_MAX_STREAMS = 64  # requests decoding at once; more wait (up to MAX_QUEUED_RPCS), then RESOURCE_EXHAUSTED


@dataclass
class Standalone:
    server: Any  # grpc.Server
    port: int
    engine: InProcess
    coordinator: Coordinator

    @property
    def http_port(self) -> int | None:
        """The HTTP API's bound port, where one is served."""
        return self.server.http_port

    def stop(self, grace_s: float | None = None) -> None:
        self.server.stop(grace_s).wait()
        self.engine.core.close()


def start_standalone(
    config: Config,
    host: str = "127.0.0.1",
    port: int = 0,
    redis_url: str | None = None,
    api_keys: ApiKeys | None = None,
    tls: TlsFiles | None = None,
    plain: bool = False,
    max_streams: int = DEFAULT_MAX_STREAMS,
    max_batch: int = 64,
    adapt_to_load: bool | None = None,
    http_port: int | None = None,
    floor: bool | None = None,
) -> Standalone:
    """Load the config's tiers, turn on batching, serve gRPC on host:port (0 picks a free port).

    plain: serve the target alone, no speculation (the baseline a load test compares against).
    http_port: also serve the OpenAI-compatible HTTP API and /metrics there (0 picks a free port).
    adapt_to_load: each round's drafting follows measured acceptance and what the load makes of each way
    of drafting (engine.policies.load) instead of the fixed K-matrix; None: as the config's
    serving.adapt_to_load says (on by default). floor: a request falls back to plain decoding where its
    drafts do not pay (engine.policies.floor); None: as serving.floor says (on by default).
    """
    cascade = config.cascade
    if plain:
        cascade = make_cascade(cascade.target, [], None, 1.0)
    threads = standalone_threads(config.serving)
    if threads:
        import torch

        torch.set_num_threads(threads)
    engine = InProcess(cascade, tier_client=config.serving.tier_client, core=EngineCore(max_batch))
    store = session_store(
        config.serving,
        lambda: MemoryStore(
            ttl_s=config.serving.session_ttl_s, max_sessions_per_owner=config.serving.max_sessions_per_key
        ),
        redis_url,
    )
    coordinator = engine.coordinator(
        store,
        config.generation,
        # Load adaptation prices the target's batched passes: an in-process target's (a remote one's
        # passes are its tier server's business, so the K-matrix runs as configured there).
        adapt_to_load=(config.serving.adapt_to_load if adapt_to_load is None else adapt_to_load)
        and not plain
        and getattr(engine.target, "batcher", None) is not None,
        arms=config.serving.load_arms,
        floor=(config.serving.floor if floor is None else floor) and not plain,
    )
    limits = limits_from(config.serving.admission, workers=max_streams, max_queued=MAX_QUEUED_RPCS)
    name, tokenizer = engine.cascade.target.name, engine.tokenizer
    http = http_options(http_port, name, tokenizer) if http_port is not None else None
    server, bound = start_server(coordinator, host, port, api_keys=api_keys, tls=tls, limits=limits, http=http)
    return Standalone(server, bound, engine, coordinator)


def standalone_threads(serving: ServingConfig) -> int | None:
    """The torch threads the standalone server's passes run on: serving.standalone_torch_threads, every
    core the process may run on where that is 0, torch_threads where it is unset (None: torch's default)."""
    threads = serving.standalone_torch_threads
    if threads is None:
        return serving.torch_threads
    return threads or len(os.sched_getaffinity(0))
