"""The coordinator's side of a tier server reached by address: replicas, stickiness, failover.

A tier named by `address` in the config (one address, or several: replicas of the same tier server)
is reached over gRPC (cascade.tier.v1.Tier). Each request sticks to one replica, chosen by
rendezvous hashing of its request id, so its calls find the KV cache the last call left there; when
that replica fails (UNAVAILABLE, or no answer within the call timeout), the request moves to the next
live replica in its order, which is told the whole context (`transport.remote`) and rebuilds the
cache from it: the request completes with the same tokens. Only when no replica answers does the call
fail, as `transport.errors.Unavailable` (the edge's UNAVAILABLE). A replica that failed is tried last
for a while (`DOWN_S`), then again.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc

from ..api.auth import ChannelTls
from ..api.tier.v1 import tier_pb2 as pb
from ..config import CascadeConfig, ConfigError, MaGConfig, TierClientConfig
from ..runtime.assemble import TierFacts
from ..serving.bridge import await_, in_bridge
from .errors import Overloaded, Unavailable
from .remote import Invoke, RemoteTier
from .server import MAX_MESSAGE_BYTES, SERVICE

log = logging.getLogger(__name__)

DOWN_S = 5.0  # a replica that failed is tried after the others for this long
METHODS = {"draft": "Draft", "review": "Review", "release": "Release", "info": "Info"}
# Codes after which the same call may go to another replica: it did not run, or its server went away
# (a tier call is a pure function of what it carries, so running it again changes nothing).
FAILOVER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class TierReplicas:
    """The replicas of one tier server (one or more addresses of the same tiers)."""

    def __init__(self, addresses: Sequence[str], channel: TierClientConfig | None = None, name: str = ""):
        channel = channel or TierClientConfig()
        if not addresses:
            raise ValueError("a remote tier needs at least one address")
        self.addresses = tuple(addresses)
        self.name = name or ",".join(self.addresses)
        self.settings = channel
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        tls = ChannelTls(channel.ca_file, channel.cert_file, channel.key_file) if channel.tls else None
        credentials = tls.credentials() if tls else None
        self.channels = [
            grpc.secure_channel(a, credentials, options) if credentials else grpc.insecure_channel(a, options)
            for a in self.addresses
        ]
        self._stubs = [{m: ch.unary_unary(f"/{SERVICE}/{rpc}") for m, rpc in METHODS.items()} for ch in self.channels]
        self._metadata = (("authorization", f"Bearer {channel.api_key}"),) if channel.api_key else None
        self._down_until = [0.0] * len(self.addresses)
        self._lock = threading.Lock()
        self._releasing: set[Any] = set()
        self.failovers = 0

    def order(self, request_id: str) -> list[int]:
        """Replica indices in this request's order (rendezvous hashing: each request has its own, and
        a replica leaving moves only its own requests)."""

        def weight(i: int) -> bytes:
            return hashlib.blake2b(f"{request_id}\0{self.addresses[i]}".encode(), digest_size=8).digest()

        return sorted(range(len(self.addresses)), key=weight, reverse=True)

    def invoker(self, request_id: str) -> Invoke:
        """`transport.remote.Invoke` for one request: sticky to its replica, failing over in its order."""
        order = self.order(request_id)
        current: list[int] = []  # the replica the request is on, once chosen

        def invoke(method: str, data: bytes) -> bytes:
            if method == "release":
                if current:
                    self._release(current[0], data)
                return b""
            candidates = current + [i for i in self._live_first(order) if i not in current]
            failures = []
            for i in candidates:
                try:
                    reply = self._call(i, method, data)
                except grpc.RpcError as exc:
                    code = exc.code()  # type: ignore[attr-defined]  # grpc.Call's
                    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise Overloaded(f"tier {self.name!r} at {self.addresses[i]} is at its queue limit") from exc
                    if code not in FAILOVER:
                        raise RuntimeError(
                            f"tier {self.name!r} at {self.addresses[i]} refused a call: {code.name} {exc.details()}"  # type: ignore[attr-defined]
                        ) from exc
                    failures.append(f"{self.addresses[i]} {code.name}")
                    self._mark_down(i)
                    continue
                if current and current[0] != i:
                    self.failovers += 1
                    log.warning(
                        "request %s moved from %s to %s", request_id, self.addresses[current[0]], self.addresses[i]
                    )
                current[:] = [i]
                return reply
            raise Unavailable(f"tier server {self.name} unavailable (no replica answered: {'; '.join(failures)})")

        return invoke

    def info(self) -> list[Any]:
        """The tiers the server hosts (`pb.TierInfo`), from the first replica that answers."""
        request = pb.InfoRequest().SerializeToString()
        failures = []
        for i in self._live_first(list(range(len(self.addresses)))):
            try:
                return list(pb.InfoReply.FromString(self._call(i, "info", request, blocking=True)).tiers)
            except grpc.RpcError as exc:
                failures.append(f"{self.addresses[i]}: {exc.code().name} {exc.details()}")  # type: ignore[attr-defined]
        raise Unavailable(f"tier server {self.name} unavailable ({'; '.join(failures)})")

    def close(self) -> None:
        for channel in self.channels:
            channel.close()

    def _call(self, i: int, method: str, data: bytes, blocking: bool = False) -> bytes:
        stub = self._stubs[i][method]
        timeout = self.settings.timeout_s
        if not blocking and in_bridge():  # a decode on the Ray coordinator's event loop awaits the call
            return await_(_AwaitableFuture(stub.future(data, timeout=timeout, metadata=self._metadata)))
        return stub(data, timeout=timeout, metadata=self._metadata)

    def _release(self, i: int, data: bytes) -> None:
        """Fire and forget: nothing waits on a cache being freed (the server's LRU backs it up)."""
        try:
            future = self._stubs[i]["release"].future(data, timeout=self.settings.timeout_s, metadata=self._metadata)
        except Exception:
            log.warning("could not release a request on %s", self.addresses[i])
            return
        # A gRPC future that is garbage-collected cancels its call: hold it until it is done.
        with self._lock:
            self._releasing.add(future)
        future.add_done_callback(self._released)

    def _released(self, future: Any) -> None:
        with self._lock:
            self._releasing.discard(future)

    def _live_first(self, order: list[int]) -> list[int]:
        now = time.monotonic()
        with self._lock:
            down = {i for i in order if self._down_until[i] > now}
        return [i for i in order if i not in down] + [i for i in order if i in down]

    def _mark_down(self, i: int) -> None:
        with self._lock:
            self._down_until[i] = time.monotonic() + DOWN_S


class RemoteModel:
    """A tier that a tier server hosts, as a coordinator sees it: its facts (from the server's Info)
    and, per request, a `RemoteTier` on its replicas."""

    batcher = None  # its passes batch on its server

    def __init__(self, name: str, replicas: TierReplicas, info: Any, mag: bool = False):
        self.name = name
        self.mag = mag  # MaG on a tier server: drafts, has no parameters to weigh
        self.replicas = replicas
        self.vocab_size = int(info.vocab_size)
        self.num_parameters = int(info.num_parameters)
        self.eos_token_ids = frozenset(int(t) for t in info.eos_token_ids)
        self.max_positions = int(info.max_positions) or None
        self.device = info.device
        self.system = bool(info.system)

    def tier(self, request_id: str) -> RemoteTier:
        return RemoteTier(self.name, request_id, self.replicas.invoker(request_id), system=self.system)

    def facts(self) -> TierFacts:
        return TierFacts(
            self.vocab_size, self.num_parameters, tuple(sorted(self.eos_token_ids)), self.max_positions, self.device
        )


def connect(cascade: CascadeConfig, client: TierClientConfig) -> dict[str, RemoteModel]:
    """The config's tiers named by address, by name: one set of channels per tier server (tiers it
    hosts together share them), each checked against what the server says it hosts."""
    servers: dict[tuple[str, ...], tuple[TierReplicas, dict[str, Any]]] = {}
    remote: dict[str, RemoteModel] = {}
    for tier in cascade.tiers:
        if not tier.remote:
            continue
        if tier.address not in servers:
            replicas = TierReplicas(tier.address, client)
            try:
                hosted = {info.name: info for info in replicas.info()}
            except Unavailable as exc:
                raise ConfigError(f"{tier.name}.address: {exc}") from None
            servers[tier.address] = (replicas, hosted)
        replicas, hosted = servers[tier.address]
        if tier.name not in hosted:
            raise ConfigError(
                f"{tier.name}.address: the tier server at {', '.join(tier.address)} hosts "
                f"{', '.join(hosted) or 'nothing'}, not {tier.name!r}"
            )
        info = hosted[tier.name]
        if isinstance(tier, MaGConfig) and not info.vocab_size:
            raise ConfigError(f"{tier.name}.address: the MaG server does not say its vocabulary")
        remote[tier.name] = RemoteModel(tier.name, replicas, info, mag=isinstance(tier, MaGConfig))
    return remote


class _AwaitableFuture:
    """A gRPC future as something `serving.bridge.await_` can await (it takes asyncio awaitables)."""

    def __init__(self, future: Any):
        self.future = future

    def __await__(self) -> Any:
        import asyncio

        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def done(f: Any) -> None:
            loop.call_soon_threadsafe(_settle, waiter, f)

        self.future.add_done_callback(done)
        return waiter.__await__()


def _settle(waiter: Any, future: Any) -> None:
    if waiter.done():
        return
    try:
        waiter.set_result(future.result())
    except BaseException as exc:
        waiter.set_exception(exc)
