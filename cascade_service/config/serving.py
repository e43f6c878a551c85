"""The `serving` section: how `cascade-service serve` places, scales and protects the tiers."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.limits import is_number, unpaired
from ..core.policy import ARMS
from .base import ConfigError, ModelTierConfig, check_int, mapping_at, only_keys, resolve_path

if TYPE_CHECKING:
    from . import CascadeConfig


DEPLOYMENT_OPTIONS = {
    "num_replicas",
    "ray_actor_options",
    "autoscaling_config",
    "max_ongoing_requests",
    "max_queued_requests",
    "graceful_shutdown_timeout_s",
    "grpc_port",  # ours, not Ray's: a tier deployment's tier API port (TierServerConfig)
}


MAX_SHUTDOWN_GRACE_S = 3600
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass(frozen=True)
class TierClientConfig:
    """How the coordinator reaches the tiers a config names by `address` (transport.client).

    TLS is on when `tls` is true or any file is given: `ca_file` the CA of the tier servers'
    certificates (none: the system's roots), `cert_file`/`key_file` the coordinator's own certificate
    for servers that ask for one (mutual TLS). `api_key` is sent as `authorization: Bearer`; `${NAME}`
    in it is read from the environment. `timeout_s` bounds one tier call; a replica that does not
    answer within it is failed over.
    """

    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    api_key: str | None = field(default=None, repr=False)
    timeout_s: float = 30.0


@dataclass(frozen=True)
class TierServerConfig:
    """Who may call the tier API where the Ray app serves it (a tier deployment given
    `serving.deployments.tier-<name>.grpc_port`): its replicas listen on host:grpc_port (several replicas
    on one node share the port, SO_REUSEPORT). Off loopback it needs API keys and TLS, as the edge;
    `client_ca_file` also requires each coordinator's certificate (mutual TLS)."""

    host: str = "127.0.0.1"
    api_keys_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    client_ca_file: str | None = None


@dataclass(frozen=True)
class ServingConfig:
    """How `cascade-service serve` places and scales the tiers (Ray Serve); ignored in-process."""

    grpc_port: int = 9000
    # None: sessions in an in-cluster actor (survives app restarts, not Ray's). `${NAME}` in it is read
    # from the environment when the config loads: deploy files give each pod or node CASCADE_REDIS_URL.
    redis_url: str | None = None
    session_namespace: str = "cascade"
    session_ttl_s: int = 7 * 24 * 3600
    # Live sessions one API key (or all anonymous callers together) may hold; None: no limit. With each
    # session within the model's context, this also bounds the tokens a key stores.
    max_sessions_per_key: int | None = 1000
    # Model tiers hosted inside the coordinator's replica instead of their own deployment: their calls
    # cost no hop, but they scale with the coordinator. MaG always runs in the coordinator (it is a
    # dict lookup), so colocating the smallest tier puts MaG beside it.
    colocate: tuple[str, ...] = ()
    # Model tiers that share one deployment (`tier-<a>-<b>`). A member whose whole sub-cascade (the
    # tiers below it in the K-matrix, MaG included) lies in its group runs it there in one call.
    groups: tuple[tuple[str, ...], ...] = ()
    torch_threads: int | None = None  # per tier replica; None: torch's default
    # `serve --frontend standalone`'s: one process, nothing of Ray beside its passes, which may use every
    # core (docs/service.md "Threads"). None: as torch_threads; 0: every core the process may run on.
    standalone_torch_threads: int | None = None
    # deployment name ("coordinator", "tier-<name>") -> Ray Serve options: num_replicas,
    # ray_actor_options (num_cpus, num_gpus, accelerator_type, resources), autoscaling_config, ...
    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Access control of the gRPC edge (rpc/auth.py); relative paths are relative to the config file.
    api_keys_file: str | None = None  # one key per line (`KEY [name]`, `#` comments); None: no keys
    tls_cert_file: str | None = None  # PEM certificate chain; with tls_key_file: serve TLS
    tls_key_file: str | None = None  # PEM private key
    # Speculation that adapts to load (engine.policies.load): each round's drafting is chosen from measured
    # acceptance and what the load makes of each way of drafting, greedy and sampled requests apart;
    # on by default (the fixed K-matrix loses to plain decoding under load on a small host, and sampled
    # at every load: docs/benchmarks.md "Under load: the default against plain decoding"). false: every
    # round runs the K-matrix as configured (as `serve --fixed-schedule` does).
    adapt_to_load: bool = True
    # The floor under the speedup (engine.policies.floor): a request whose measured rounds say drafting does
    # not pay falls back to plain decoding, within a bounded loss (docs/algorithm.md "The floor"); on by
    # default. false: speculation "auto" runs the K-matrix or load adaptation as it is (a baseline).
    floor: bool = True
    # The ways of drafting its trial chooses between, wherever speculation adapts to load (core.policy.ARMS);
    # None: every one the frontend can run. E.g. [full, budget] on a pool where drafting always pays, to
    # spare the trial its exploring; one arm alone: that arm, no trial.
    load_arms: tuple[str, ...] | None = None
    # Once a server is ready (`serve`, `tier`, the Ray app's replicas), freeze its start-up heap out of the
    # cyclic collector's walks (engine.heap). false: every full collection walks the models' objects.
    freeze_heap: bool = True
    # On SIGTERM or Ctrl-C, `serve` stops taking calls and gives the calls in flight this long to finish
    # before it cancels them (each ends with a status, never silently); Ray Serve replicas get the same
    # graceful_shutdown_timeout_s unless serving.deployments sets one. Then Serve and Ray stop.
    shutdown_grace_s: float = 10.0
    # What the standalone server and the edge admit (api.admission.Limits, docs/service.md "Admission"):
    # any of ADMISSION_KEYS; unset ones keep their defaults (workers: the frontend's own).
    admission: dict[str, float] = field(default_factory=dict)
    # How the coordinator reaches tiers named by address (TierClientConfig).
    tier_client: TierClientConfig = field(default_factory=TierClientConfig)
    # Who may call the tier API of the Ray app's tier deployments (TierServerConfig).
    tier_server: TierServerConfig = field(default_factory=TierServerConfig)


# The settings of serving.admission (api.admission.Limits' fields).
ADMISSION_KEYS = (
    "workers",
    "max_queued",
    "max_pending",
    "max_calls_per_key",
    "max_streams_per_connection",
    "body_timeout_s",
    "max_probes",
    "max_message_bytes",
)


def _load_arms(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    # membership first: then every item is a string, and the set of them can be built
    if (
        not isinstance(value, list)
        or not value
        or any(arm not in ARMS for arm in value)
        or len(set(value)) != len(value)
    ):
        raise ConfigError(
            f"serving.load_arms must be a non-empty list of distinct arms among {list(ARMS)}, got {value!r}"
        )
    return tuple(value)


def _admission(value: Any) -> dict[str, float]:
    """serving.admission: known keys, each a number (the ranges are Limits' own, checked when `serve` starts)."""
    if value is None:
        return {}
    raw = mapping_at(value, "serving.admission")
    only_keys(raw, "serving.admission.", set(ADMISSION_KEYS))
    for key, number in raw.items():
        if not is_number(number):
            raise ConfigError(f"serving.admission.{key} must be a number, got {number!r}")
        if key != "body_timeout_s" and number != int(number):
            raise ConfigError(f"serving.admission.{key} must be a whole number, got {number!r}")
    return {k: (float(v) if k == "body_timeout_s" else int(v)) for k, v in raw.items()}


def _tier_client(value: Any, cascade: CascadeConfig, base_dir: Path) -> TierClientConfig:
    raw = mapping_at(value if value is not None else {}, "serving.tier_client")
    where = "serving.tier_client."
    only_keys(raw, where, {"tls", "ca_file", "cert_file", "key_file", "api_key", "timeout_s"})
    files = _paths(raw, ("ca_file", "cert_file", "key_file"), where, base_dir)
    if error := unpaired((f"{where}cert_file", files["cert_file"]), (f"{where}key_file", files["key_file"])):
        raise ConfigError(error)
    tls = raw.get("tls", False)
    if not isinstance(tls, bool):
        raise ConfigError(f"{where}tls must be true or false, got {tls!r}")
    timeout = raw.get("timeout_s", 30.0)
    if not is_number(timeout) or not 0 < timeout <= 3600:
        raise ConfigError(f"{where}timeout_s must be a number of seconds in (0, 3600], got {timeout!r}")
    key = raw.get("api_key")
    if key is not None:
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{where}api_key must be a non-empty string")
        key = _env(key, where + "api_key")
    client = TierClientConfig(
        tls or any(files.values()), files["ca_file"], files["cert_file"], files["key_file"], key, float(timeout)
    )
    for tier in cascade.tiers:
        exposed = [a for a in tier.address if a.rsplit(":", 1)[0] not in LOOPBACK]
        if exposed and not client.tls:
            raise ConfigError(
                f"{tier.name}.address: {exposed[0]} is not a loopback address; reach it over TLS "
                f"(serving.tier_client.tls, ca_file) with an api_key"
            )
    return client


def _tier_server(value: Any, base_dir: Path) -> TierServerConfig:
    raw = mapping_at(value if value is not None else {}, "serving.tier_server")
    where = "serving.tier_server."
    only_keys(raw, where, {"host", "api_keys_file", "tls_cert_file", "tls_key_file", "client_ca_file"})
    host = raw.get("host", "127.0.0.1")
    if not isinstance(host, str) or not host:
        raise ConfigError(f"{where}host must be a host name or address, got {host!r}")
    files = _paths(raw, ("api_keys_file", "tls_cert_file", "tls_key_file", "client_ca_file"), where, base_dir)
    if error := unpaired(
        (f"{where}tls_cert_file", files["tls_cert_file"]), (f"{where}tls_key_file", files["tls_key_file"])
    ):
        raise ConfigError(error)
    if files["client_ca_file"] and not files["tls_cert_file"]:
        raise ConfigError(f"{where}client_ca_file needs tls_cert_file and tls_key_file")
    if host not in LOOPBACK and (files["api_keys_file"] is None or files["tls_cert_file"] is None):
        raise ConfigError(
            f"{where}host: {host} is not loopback; the tier API is served there only with api_keys_file and TLS"
        )
    return TierServerConfig(host, **files)


def _paths(raw: dict[str, Any], names: Sequence[str], where: str, base_dir: Path) -> dict[str, str | None]:
    """The file paths `names` of `raw` (each absent, or a string), relative to the config's folder."""
    files: dict[str, str | None] = {}
    for name in names:
        path = raw.get(name)
        if path is not None and not (isinstance(path, str) and path):
            raise ConfigError(f"{where}{name} must be a file path (a string), got {path!r}")
        files[name] = None if path is None else resolve_path(path, base_dir)
    return files


def _env(value: str, where: str) -> str:
    def lookup(match: re.Match) -> str:
        found = os.environ.get(match.group(1))
        if not found:
            raise ConfigError(f"{where} reads {match.group(0)}, which is not set in this process's environment")
        return found

    return ENV_REFERENCE.sub(lookup, value)


def parse_serving(raw: dict[str, Any], cascade: CascadeConfig, base_dir: Path = Path(".")) -> ServingConfig:
    only_keys(
        raw,
        "serving.",
        {
            "grpc_port",
            "redis_url",
            "session_namespace",
            "session_ttl_s",
            "colocate",
            "groups",
            "torch_threads",
            "standalone_torch_threads",
            "deployments",
            "api_keys_file",
            "tls_cert_file",
            "tls_key_file",
            "adapt_to_load",
            "floor",
            "freeze_heap",
            "load_arms",
            "shutdown_grace_s",
            "admission",
            "max_sessions_per_key",
            "tier_client",
            "tier_server",
        },
    )
    structured = ("deployments", "colocate", "groups", "load_arms", "admission", "tier_client", "tier_server")
    serving = ServingConfig(
        **{k: v for k, v in raw.items() if k not in structured},
        load_arms=_load_arms(raw.get("load_arms")),
        admission=_admission(raw.get("admission")),
        tier_client=_tier_client(raw.get("tier_client"), cascade, base_dir),
        tier_server=_tier_server(raw.get("tier_server"), base_dir),
    )
    check_int(serving.grpc_port, "serving.grpc_port", 1, 65535)
    check_int(serving.session_ttl_s, "serving.session_ttl_s", 1, 10 * 365 * 24 * 3600)
    if serving.max_sessions_per_key is not None:
        check_int(serving.max_sessions_per_key, "serving.max_sessions_per_key", 1, 10**9)
    if serving.torch_threads is not None:
        check_int(serving.torch_threads, "serving.torch_threads", 1, 1024)
    if serving.standalone_torch_threads is not None:
        check_int(serving.standalone_torch_threads, "serving.standalone_torch_threads", 0, 1024)
    grace = serving.shutdown_grace_s
    if not is_number(grace) or not 0 <= grace <= MAX_SHUTDOWN_GRACE_S:
        raise ConfigError(
            f"serving.shutdown_grace_s must be a number of seconds in [0, {MAX_SHUTDOWN_GRACE_S}], got {grace!r}"
        )
    for flag in ("adapt_to_load", "floor", "freeze_heap"):
        if not isinstance(getattr(serving, flag), bool):
            raise ConfigError(f"serving.{flag} must be true or false, got {getattr(serving, flag)!r}")
    serving = replace(serving, redis_url=resolve_redis_url(serving.redis_url, "serving.redis_url"))
    if (
        not isinstance(serving.session_namespace, str)
        or not serving.session_namespace
        or ":" in serving.session_namespace
    ):
        raise ConfigError(
            f"serving.session_namespace must be a non-empty string without ':', got {serving.session_namespace!r}"
        )
    files = _paths(
        {n: getattr(serving, n) for n in ("api_keys_file", "tls_cert_file", "tls_key_file")},
        ("api_keys_file", "tls_cert_file", "tls_key_file"),
        "serving.",
        base_dir,
    )
    if error := unpaired(
        ("serving.tls_cert_file", files["tls_cert_file"]), ("serving.tls_key_file", files["tls_key_file"])
    ):
        raise ConfigError(error)
    # Tiers named by address are served elsewhere: no deployment, no colocation, no group here.
    model_tiers = [t.name for t in cascade.tiers if isinstance(t, ModelTierConfig) and not t.remote]
    colocate = raw.get("colocate", [])
    if not isinstance(colocate, list) or any(name not in model_tiers for name in colocate):
        raise ConfigError(f"serving.colocate must list model tiers ({', '.join(model_tiers)}), got {colocate!r}")
    groups = raw.get("groups", [])
    grouped = (
        [name for group in groups for name in group]
        if isinstance(groups, list) and all(isinstance(g, list) and g for g in groups)
        else None
    )
    if (
        grouped is None
        or len(set(grouped)) != len(grouped)
        or any(n not in model_tiers or n in colocate for n in grouped)
    ):
        raise ConfigError(
            f"serving.groups must be disjoint non-empty lists of model tiers not in serving.colocate, got {groups!r}"
        )
    names = {"coordinator"} | {deployment_name(group) for group in tier_groups(model_tiers, colocate, groups)}
    deployments = mapping_at(raw.get("deployments", {}), "serving.deployments")
    for name, options in deployments.items():
        if name not in names:
            raise ConfigError(f"serving.deployments.{name}: no such deployment (have: {', '.join(sorted(names))})")
        only_keys(
            mapping_at(options, f"serving.deployments.{name}"), f"serving.deployments.{name}.", DEPLOYMENT_OPTIONS
        )
        if "grpc_port" in options:
            if name == "coordinator":
                raise ConfigError(
                    "serving.deployments.coordinator.grpc_port: only a tier deployment serves the tier API"
                )
            check_int(options["grpc_port"], f"serving.deployments.{name}.grpc_port", 1, 65535)
    return replace(
        serving,
        colocate=tuple(colocate),
        groups=tuple(tuple(g) for g in groups),
        deployments={k: dict(v) for k, v in deployments.items()},
        api_keys_file=files["api_keys_file"],
        tls_cert_file=files["tls_cert_file"],
        tls_key_file=files["tls_key_file"],
    )


ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def resolve_redis_url(value: Any, where: str) -> str | None:
    """A session store URL with each `${NAME}` replaced by that environment variable; None stays None.

    Only the braced form is read, so a `$` in a password stays as written. A reference to a variable
    that is unset or empty is an error rather than an empty URL: a cluster whose sessions silently fell
    back to one replica's memory would lose them whenever that replica went away.
    """
    if value is None:
        return None

    def lookup(match: re.Match) -> str:
        found = os.environ.get(match.group(1))
        if not found:
            raise ConfigError(
                f"{where} reads {match.group(0)}, which is not set in this process's environment "
                f"(set it on every node, as the deploy files do, or write the URL out)"
            )
        return found

    url = ENV_REFERENCE.sub(lookup, value) if isinstance(value, str) else value
    if not (isinstance(url, str) and url.startswith(("redis://", "rediss://", "unix://"))):
        # An expanded value is not echoed: it may hold a password.
        shown = f"{value!r} (its value is not such a URL)" if url != value else repr(value)
        raise ConfigError(f"{where} must be a redis://, rediss:// or unix:// URL, got {shown}")
    return url


def tier_groups(
    model_tiers: Sequence[str], colocate: Sequence[str], groups: Sequence[Sequence[str]]
) -> list[tuple[str, ...]]:
    """The tier deployments: each configured group, then every other non-colocated model tier alone."""
    grouped = {name for group in groups for name in group}
    return [tuple(g) for g in groups] + [(n,) for n in model_tiers if n not in grouped and n not in colocate]


def deployment_name(group: Sequence[str]) -> str:
    return "tier-" + "-".join(group)
