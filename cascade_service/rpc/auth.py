"""Access control for the gRPC endpoint: API keys, the caller's identity, and TLS credentials.

Keys arrive as gRPC metadata `authorization: Bearer <key>` (the client SDK sends it when given
`api_key=`). The front end of the standalone server and the edge (`api.frontend`) checks them on a
call's headers, before its body is read, for every CascadeService call; Ray Serve's proxy has the
coordinator check them (`authenticate_context`). Health checking and reflection stay open for probes.

Identity. The caller's owner id travels with the call to the servicer: in a RecordingContext on our
front ends, in a context proxy on Ray's (`owner_of(context)` reads either). The owner id is a hash of
the key (`owner_id`), never the key, so it can be stored with a session
and travel to the coordinator (the edge passes it along with the request bytes; see
`serving.app.CoordinatorDeployment.rpc`). Without keys configured every caller's owner is ""
(anonymous). Keys are compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ..core.limits import unpaired

OWNER_ATTR = "cascade_owner"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def owner_id(key: str) -> str:
    """The id a key's sessions are stored under: 128 bits of its SHA-256, hex (never the key itself)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class ApiKey:
    key: bytes
    name: str
    owner: str


class ApiKeys:
    """The keys a server accepts. `check(key)` compares against every key in constant time per key."""

    def __init__(self, keys: Iterable[tuple[str, str]]):
        self._keys: list[ApiKey] = []
        for key, name in keys:
            if not key or any(c.isspace() for c in key) or not key.isprintable():
                raise ValueError(f"api key {name or '?'}: a key must be non-empty printable text without spaces")
            self._keys.append(ApiKey(key.encode(), name, owner_id(key)))
        if not self._keys:
            raise ValueError("no API keys given")

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:  # never the keys
        return f"ApiKeys({len(self._keys)} keys)"

    def check(self, key: str | None) -> ApiKey | None:
        """The matching key, or None. Every configured key is compared (hmac.compare_digest), no early exit."""
        if not key:
            return None
        given = key.encode()
        found = None
        for candidate in self._keys:
            if hmac.compare_digest(candidate.key, given) and found is None:
                found = candidate
        return found


def load_api_keys(path: str | Path) -> ApiKeys:
    """Keys from a file: one per line, optionally followed by a name (`KEY name`); `#` starts a comment."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"api keys file {path}: cannot read ({type(exc).__name__})") from None
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        key, _, name = line.partition(" ")
        name = name.strip() or f"line {number}"
        keys.append((key, name))
    if not keys:
        raise ValueError(f"api keys file {path}: no keys in it")
    try:
        return ApiKeys(keys)
    except ValueError as exc:
        raise ValueError(f"api keys file {path}: {exc}") from None


def bearer(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The key of an `authorization: Bearer <key>` metadata entry, or None."""
    for name, value in metadata or ():
        if name.lower() != "authorization":
            continue
        value = value.decode() if isinstance(value, bytes) else str(value)
        scheme, _, key = value.partition(" ")
        if scheme.lower() == "bearer" and key.strip():
            return key.strip()
    return None


def authenticate(keys: ApiKeys, metadata: Iterable[tuple[str, Any]] | None) -> tuple[str | None, str]:
    """(the caller's owner id, "") for a known key in `metadata`; (None, why) otherwise (never the key)."""
    given = bearer(metadata)
    match = keys.check(given)
    if match is not None:
        return match.owner, ""
    if given is None:
        return None, "missing API key: send metadata 'authorization: Bearer <key>'"
    return None, "unknown API key"


def with_owner(context: Any, owner: str) -> Any:
    """`context` carrying the authenticated caller's owner id (read back by `owner_of`)."""
    return _OwnerContext(context, owner)


def authenticate_context(keys: ApiKeys | None, context: Any) -> Any | None:
    """For servers without an interceptor (Ray Serve's gRPC proxy): `context` carrying the caller's owner
    id, or None after setting UNAUTHENTICATED on it. Without keys, `context` as it is (anonymous)."""
    if keys is None:
        return context
    owner, message = authenticate(keys, context.invocation_metadata() if context is not None else ())
    if owner is None:
        if context is not None:
            context.set_code(grpc.StatusCode.UNAUTHENTICATED)
            context.set_details(message)
        return None
    return with_owner(context, owner)


def owner_of(context: Any) -> str:
    """The caller's owner id as a front end set it (`with_owner`, a RecordingContext); "" when anonymous."""
    return getattr(context, OWNER_ATTR, "") or ""


class _OwnerContext:
    """A servicer context that carries the authenticated caller's owner id; all else is delegated."""

    def __init__(self, context: Any, owner: str):
        self._context = context
        setattr(self, OWNER_ATTR, owner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


# --- TLS ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    """A server's certificate and key (PEM); `client_ca_file`: also require every client to present a
    certificate signed by this CA (mutual TLS), as a tier server asks of its coordinators."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        cert, key = _read(self.cert_file), _read(self.key_file)
        if self.client_ca_file is None:
            return grpc.ssl_server_credentials([(key, cert)])
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=_read(self.client_ca_file), require_client_auth=True
        )


@dataclass(frozen=True)
class ChannelTls:
    """A client's TLS: the CA that signed the server's certificate (None: the system's roots), and the
    client's own certificate and key where the server asks for one (mutual TLS)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        if error := unpaired(("TLS cert_file", self.cert_file), ("key_file", self.key_file)):
            raise ValueError(error)
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file) if self.ca_file else None,
            private_key=_read(self.key_file) if self.key_file else None,
            certificate_chain=_read(self.cert_file) if self.cert_file else None,
        )


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"TLS: cannot read {exc.filename} ({type(exc).__name__})") from None


def bind(server: grpc.Server, host: str, port: int, tls: TlsFiles | None) -> int:
    """Add the listening port (TLS when given); returns the bound port. OSError when it cannot bind."""
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not bind {address}")
    return bound


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS
