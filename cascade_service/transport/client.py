"""The coordinator's side of a tier server reached by address: replicas, stickiness, failover.

A tier named by `address` in the config (one address, or several: replicas of the same tier server)
is reached over gRPC (cascade.tier.v1.Tier). Each request sticks to one replica, chosen by
rendezvous hashing of its request id, so its calls find the KV cache the last call left there; when
that replica fails (UNAVAILABLE, or no answer within the call timeout), the request moves to the next
live replica in its order, which is told the whole context (`transport.remote`) and rebuilds the
cache from it: the request completes with the same tokens. Only when no replica answers does the call
fail, as `core.tier.Unavailable` (the edge's UNAVAILABLE). A replica that failed is tried last
for a while (`DOWN_S`), then again.

A name that resolves to several addresses (a Kubernetes headless Service: one per pod) stands for
all of them, each a replica, resolved again every `RESOLVE_S`; one long-lived HTTP/2 connection to a
load-balanced virtual IP would instead pin every request of a coordinator to one pod.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc

from ..config import CascadeConfig, ConfigError, MaGConfig, TierClientConfig
from ..core.tier import Overloaded, TierFacts, Unavailable
from ..proto.tier.v1 import tier_pb2 as pb
from ..rpc.auth import ChannelTls
from .remote import Invoke, RemoteTier
from .wire import MAX_MESSAGE_BYTES, SERVICE, facts_from_pb

log = logging.getLogger(__name__)

DOWN_S = 5.0  # a replica that failed is tried after the others for this long
RESOLVE_S = 30.0  # how often a configured name is resolved again (replicas that come and go)
METHODS = {"draft": "Draft", "review": "Review", "release": "Release", "info": "Info"}
# Codes after which the same call may go to another replica: it did not run, or its server went away
# (a tier call is a pure function of what it carries, so running it again changes nothing).
FAILOVER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class TierReplicas:
    """The replicas of one tier server: the configured addresses, a name among them that resolves to
    several IPv4 addresses (a Kubernetes headless Service: one per pod) standing for each of them.
    Names are resolved again every `RESOLVE_S`, so replicas that come and go are followed."""

    def __init__(self, addresses: Sequence[str], channel: TierClientConfig | None = None, name: str = ""):
        channel = channel or TierClientConfig()
        if not addresses:
            raise ValueError("a remote tier needs at least one address")
        self.configured = tuple(addresses)
        self.name = name or ",".join(self.configured)
        self.settings = channel
        tls = ChannelTls(channel.ca_file, channel.cert_file, channel.key_file) if channel.tls else None
        self._credentials = tls.credentials() if tls else None
        self._metadata = (("authorization", f"Bearer {channel.api_key}"),) if channel.api_key else None
        self._lock = threading.Lock()
        self._stubs: dict[str, dict[str, Any]] = {}  # replica address -> method -> callable
        self._channels: dict[str, grpc.Channel] = {}
        self._down_until: dict[str, float] = {}
        self._releasing: set[Any] = set()
        self._resolved_at = -RESOLVE_S
        self.addresses: tuple[str, ...] = ()
        self.failovers = 0
        self._refresh()

    def order(self, key: str) -> list[str]:
        """Replicas in the order of a request's routing key (rendezvous hashing: each key has its own,
        and a replica leaving or joining moves only its own share of keys). The key is the request's
        affinity (core.tier.affinity_key), so a session's turns meet their KV cache."""
        self._refresh()

        def weight(address: str) -> bytes:
            return hashlib.blake2b(f"{key}\0{address}".encode(), digest_size=8).digest()

        return sorted(self.addresses, key=weight, reverse=True)

    def invoker(self, key: str) -> Invoke:
        """`transport.remote.Invoke` for one request (`key`: its routing key, `order`): sticky to its
        replica, failing over in its order."""
        current: list[str] = []  # the replica the request is on, once chosen

        def invoke(method: str, data: bytes) -> bytes:
            if method == "release":
                if current:
                    self._release(current[0], data)
                return b""
            order = self.order(key)
            candidates = current + [a for a in self._live_first(order) if a not in current]
            failures = []
            for address in candidates:
                try:
                    reply = self._call(address, method, data)
                except grpc.RpcError as exc:
                    code = exc.code()  # type: ignore[attr-defined]  # grpc.Call's
                    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise Overloaded(f"tier server {address} is at its queue limit") from exc
                    if code not in FAILOVER:
                        raise RuntimeError(
                            f"tier server {address} refused a call: {code.name} {exc.details()}"  # type: ignore[attr-defined]
                        ) from exc
                    failures.append(f"{address} {code.name}")
                    self._mark_down(address)
                    continue
                if current and current[0] != address:
                    self.failovers += 1
                    log.warning("request (key %s) moved from %s to %s", key, current[0], address)
                current[:] = [address]
                return reply
            raise Unavailable(f"tier server {self.name} unavailable (no replica answered: {'; '.join(failures)})")

        return invoke

    def info(self) -> list[Any]:
        """The tiers the server hosts (`pb.TierInfo`), from the first replica that answers."""
        request = pb.InfoRequest().SerializeToString()
        failures = []
        for address in self._live_first(list(self.addresses)):
            try:
                return list(pb.InfoReply.FromString(self._call(address, "info", request)).tiers)
            except grpc.RpcError as exc:
                failures.append(f"{address}: {exc.code().name} {exc.details()}")  # type: ignore[attr-defined]
        raise Unavailable(f"tier server {self.name} unavailable ({'; '.join(failures)})")

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

    def _refresh(self) -> None:
        """Resolve the configured names again once RESOLVE_S has passed; open channels to new replicas."""
        now = time.monotonic()
        if now - self._resolved_at < RESOLVE_S:
            return
        found = [(replica, host) for address in self.configured for replica, host in _replicas(address)]
        with self._lock:
            self._resolved_at = now
            for replica, host in found:
                if replica not in self._channels:
                    self._channels[replica] = self._open(replica, host)
                    self._stubs[replica] = {
                        m: self._channels[replica].unary_unary(f"/{SERVICE}/{rpc}") for m, rpc in METHODS.items()
                    }
            self.addresses = tuple(dict.fromkeys(replica for replica, _ in found))

    def _open(self, replica: str, host: str) -> grpc.Channel:
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        if self._credentials is None:
            return grpc.insecure_channel(replica, options)
        if replica.rsplit(":", 1)[0] != host:  # a pod's IP: its certificate names the Service
            options.append(("grpc.ssl_target_name_override", host))
        return grpc.secure_channel(replica, self._credentials, options)

    def _call(self, address: str, method: str, data: bytes) -> bytes:
        # Blocks: in an engine loop task, RemoteTier runs it on the loop's executor (engine.loop).
        return self._stubs[address][method](data, timeout=self.settings.timeout_s, metadata=self._metadata)

    def _release(self, address: str, data: bytes) -> None:
        """Fire and forget: nothing waits on a cache being freed (the server's LRU backs it up)."""
        try:
            future = self._stubs[address]["release"].future(
                data, timeout=self.settings.timeout_s, metadata=self._metadata
            )
        except Exception:
            log.warning("could not release a request on %s", address)
            return
        # A gRPC future that is garbage-collected cancels its call: hold it until it is done.
        with self._lock:
            self._releasing.add(future)
        future.add_done_callback(self._released)

    def _released(self, future: Any) -> None:
        with self._lock:
            self._releasing.discard(future)

    def _live_first(self, order: list[str]) -> list[str]:
        now = time.monotonic()
        with self._lock:
            down = {a for a in order if self._down_until.get(a, 0.0) > now}
        return [a for a in order if a not in down] + [a for a in order if a in down]

    def _mark_down(self, address: str) -> None:
        with self._lock:
            self._down_until[address] = time.monotonic() + DOWN_S


def _replicas(address: str) -> list[tuple[str, str]]:
    """(replica address, host) for a configured host:port: one per IPv4 address when a name resolves
    to several (a headless Service), else the address itself (gRPC resolves it)."""
    host, port = address.rsplit(":", 1)
    try:
        infos = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return [(address, host)]  # not resolvable now: gRPC keeps trying, and reports UNAVAILABLE
    ips = sorted({info[4][0] for info in infos})
    if len(ips) <= 1:
        return [(address, host)]
    return [(f"{ip}:{port}", host) for ip in ips]


class RemoteModel:
    """A tier that a tier server hosts, as a coordinator sees it: its facts (from the server's Info)
    and, per request, a `RemoteTier` on its replicas."""

    batcher = None  # its passes batch on its server

    def __init__(self, name: str, replicas: TierReplicas, info: Any, mag: bool = False):
        self.name = name
        self.mag = mag  # MaG on a tier server: drafts, has no parameters to weigh
        self.replicas = replicas
        self._facts = facts = facts_from_pb(info)  # the server's TierInfo, read once
        self.vocab_size, self.num_parameters = facts.vocab_size, facts.num_parameters
        self.eos_token_ids = frozenset(facts.eos_token_ids)
        self.max_positions, self.device, self.decoder_start = facts.max_positions, facts.device, facts.decoder_start
        self.system = bool(info.system)

    def tier(self, request_id: str, affinity: str = "") -> RemoteTier:
        """One request's tier on the replicas, in the order its affinity key gives (its request id's
        without one): a session's turns, and requests with one prompt head, go where their KV is."""
        return RemoteTier(self.name, request_id, self.replicas.invoker(affinity or request_id), system=self.system)

    def facts(self) -> TierFacts:
        return self._facts


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
