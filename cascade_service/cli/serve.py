"""`cascade-service serve`: the gRPC service on local Ray (edge or Ray's proxy) or standalone, and who
may reach it (API keys, TLS, loopback)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any, NoReturn

from ..config import load_config
from ..extras import require
from .parser import UsageError


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the cascade over gRPC: local Ray, one deployment per tier")
    p.add_argument("--config", required=True)
    p.add_argument("--grpc-port", type=int, default=None, help="default: the config's serving.grpc_port (9000)")
    p.add_argument("--redis-url", default=None, help="keep sessions in Redis (default: in-cluster memory)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="default loopback; any other address needs --api-keys and --tls-cert/--tls-key",
    )
    p.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help="require one of these API keys (one per line, 'KEY [name]', '#' comments); "
        "default: the config's serving.api_keys_file",
    )
    p.add_argument("--tls-cert", default=None, metavar="FILE", help="serve TLS with this PEM certificate chain")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="the PEM private key of --tls-cert")
    p.add_argument(
        "--frontend",
        default="edge",
        choices=["edge", "ray", "standalone"],
        help="edge: our gRPC server forwards to the coordinator (default); ray: Ray Serve's gRPC proxy; "
        "standalone: one process, no Ray, every tier batching concurrent requests",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP API and /metrics on this port (0: a free one), on the same "
        "host, keys and TLS as gRPC; with --frontend ray, Ray Serve's HTTP proxy serves it",
    )
    p.add_argument(
        "--plain", action="store_true", help="with --frontend standalone: the target alone, no speculation (a baseline)"
    )
    schedule = p.add_mutually_exclusive_group()
    schedule.add_argument(
        "--adapt-to-load",
        dest="adapt_to_load",
        action="store_true",
        default=None,
        help="with --frontend standalone: choose each round's drafting from measured acceptance and what "
        "the load makes of each way of drafting (the default unless the config's serving.adapt_to_load "
        "is false, which the Ray app reads)",
    )
    schedule.add_argument(
        "--fixed-schedule",
        dest="adapt_to_load",
        action="store_false",
        help="with --frontend standalone: every round runs the K-matrix as configured, no floor (a baseline)",
    )
    p.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        default=None,
        help="with --frontend standalone: no floor under the speedup (a request drafts even where its drafts "
        "do not pay: a baseline); the Ray app reads serving.floor",
    )
    p.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    api_keys, tls = serve_access(args, config)
    from ..api.admission import limits_from
    from ..engine.heap import freeze_startup_heap

    try:
        limits_from(config.serving.admission)  # out-of-range admission settings fail before anything starts
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    port = args.grpc_port if args.grpc_port is not None else config.serving.grpc_port
    if not 0 <= port <= 65535:
        raise UsageError(f"--grpc-port must be in [0, 65535], got {port}")
    if args.http_port is not None and not 0 <= args.http_port <= 65535:
        raise UsageError(f"--http-port must be in [0, 65535], got {args.http_port}")
    grace = config.serving.shutdown_grace_s
    stop = threading.Event()
    stop_on_signals(stop)
    if args.frontend == "standalone":
        from ..standalone import start_standalone

        standalone = start_standalone(
            config,
            args.host,
            port,
            args.redis_url,
            api_keys,
            tls,
            plain=args.plain,
            adapt_to_load=args.adapt_to_load,
            http_port=args.http_port,
            floor=False if args.adapt_to_load is False else args.floor,
        )
        if config.serving.freeze_heap:
            freeze_startup_heap("serve")
        try:
            print(
                f"serving cascade.v1.CascadeService on {args.host}:{standalone.port} "
                f"(standalone{', plain' if args.plain else ''}; Ctrl-C stops)",
                flush=True,
            )
            if standalone.http_port is not None:
                print(
                    f"serving the OpenAI-compatible HTTP API on http://{args.host}:{standalone.http_port}/v1",
                    flush=True,
                )
            wait_for_stop(stop)
        finally:
            stopping(grace)
            standalone.stop(grace)
        exit_now(0)
    if args.plain or args.adapt_to_load is not None or args.floor is not None:
        raise UsageError(
            "--plain, --adapt-to-load, --fixed-schedule and --no-floor go with --frontend standalone (the Ray "
            "app reads serving.adapt_to_load and serving.floor from the config)"
        )
    require("ray", f"serve --frontend {args.frontend} (the Ray Serve service)")
    from ..serving.local import LocalService

    service = LocalService(
        args.config,
        port,
        args.redis_url,
        args.host,
        frontend=args.frontend,
        api_keys=api_keys,
        tls=tls,
        http_port=args.http_port,
    )
    try:
        address = service.start()
        if config.serving.freeze_heap:  # the driver's and the edge's (each replica freezes its own)
            freeze_startup_heap("serve")
        # ray.init replaced our SIGTERM handler with its own, which exits at once without draining.
        stop_on_signals(stop)
        print(f"serving cascade.v1.CascadeService on {address} (Ctrl-C stops)", flush=True)
        if service.http_port is not None:
            print(f"serving the OpenAI-compatible HTTP API on http://{args.host}:{service.http_port}/v1", flush=True)
        wait_for_stop(stop)
    finally:
        stopping(grace)
        service.stop(grace)
    exit_now(0)


# Beyond the drain's grace period, stopping Serve and Ray may take this long before `serve` gives up
# waiting on them and exits with status 1.
TEARDOWN_S = 60.0


def stop_on_signals(stop: Any) -> None:
    """SIGTERM and SIGINT set `stop` (the caller drains and exits 0); a second one exits at once (1)."""

    def handle(signum: int, frame: Any) -> None:
        if stop.is_set():
            print("stopping now (second signal)", file=sys.stderr, flush=True)
            os._exit(1)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)


def wait_for_stop(stop: threading.Event) -> None:
    """Block until `stop` is set, waking every half second. A bare `stop.wait()` can sleep through the
    signal that sets it: the kernel may deliver SIGTERM to another of the process's threads (gRPC's,
    torch's, the engine loop's), and Python runs the handler only when the main thread next executes
    bytecode, which a thread blocked in an untimed lock acquire may not do. (A `tier` process beside a
    second test worker once did not stop within 60 s of SIGTERM; 14 runs under a CPU hog did not show it
    again. Waking here, and `tier` exiting as `serve` does, without the interpreter's teardown, close
    the two ways found that it could hang.)"""
    while not stop.wait(0.5):
        pass


def stopping(grace_s: float) -> None:
    """Announce the drain and bound it: past grace_s + TEARDOWN_S the process exits with status 1."""
    print(f"stopping: draining calls in flight for up to {grace_s:g} s", file=sys.stderr, flush=True)

    def give_up() -> None:
        print(f"stopping took more than {grace_s + TEARDOWN_S:g} s; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(grace_s + TEARDOWN_S, give_up)
    timer.daemon = True
    timer.start()


def exit_now(code: int) -> NoReturn:
    """Exit once a stop has ended everything the process started: its output flushed, without the
    interpreter's teardown of every module (torch's, transformers', Ray's objects), which took 3 s
    after a drained stop and 13 s on a loaded 2-core machine, past the stop's bound (grace + 5 s)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve_access(args: argparse.Namespace, config: Any) -> tuple[Any, Any]:
    """(API keys, TLS files) for `serve`, from the flags or else the config; UsageError where they are
    unusable, and for a non-loopback --host unless both keys and TLS are on."""
    from ..rpc.auth import TlsFiles, is_loopback, load_api_keys

    serving = config.serving
    keys_file = args.api_keys or serving.api_keys_file
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together")
    cert, key = (args.tls_cert, args.tls_key) if args.tls_cert else (serving.tls_cert_file, serving.tls_key_file)
    tls = TlsFiles(cert, key) if cert else None
    if not is_loopback(args.host) and (keys_file is None or tls is None):
        missing = " and ".join(
            flag for flag, value in (("--api-keys", keys_file), ("--tls-cert/--tls-key", tls)) if value is None
        )
        raise UsageError(
            f"--host {args.host}: a non-loopback address is served only with API keys and TLS "
            f"(missing {missing}, or serving.api_keys_file / serving.tls_cert_file in the config)"
        )
    if (keys_file or tls) and args.frontend == "ray":
        raise UsageError("--api-keys and TLS need --frontend edge or standalone (Ray's proxy serves neither)")
    try:
        api_keys = load_api_keys(keys_file) if keys_file else None
        if tls is not None:
            tls.credentials()  # unreadable files fail here, before Ray starts
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return api_keys, tls
