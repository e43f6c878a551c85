"""Keep a local Ray on loopback: a machine that runs the service for itself exposes no port.

Ray on Linux advertises the machine's address and binds its gRPC servers to every interface, even
when `ray.init` is given 127.0.0.1 (Ray resolves that to the machine's address). Its own switch for a
laptop cluster, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, makes it advertise and bind 127.0.0.1 instead;
we set it for a Ray we start ourselves. Two listeners escape it, Serve's replica and proxy gRPC
servers; a worker setup hook (`setup_worker`) narrows them. A cluster (`ray start --node-ip-address
...`) is left alone: its nodes must reach each other, and its network policy decides who else may.
"""

from __future__ import annotations

import os

LOOPBACK_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def loopback_ray() -> dict:
    """Before a local `ray.init`: make this process and the Ray processes it starts use 127.0.0.1.
    Returns the job's runtime_env, whose setup hook narrows Serve's own listeners in every worker."""
    from ray._private import ray_constants

    os.environ.update(LOOPBACK_RAY_ENV)  # the raylet, GCS and workers inherit it
    ray_constants.ENABLE_RAY_CLUSTER = False  # this process read the variable when it imported ray
    return {"worker_process_setup_hook": f"{__name__}.setup_worker"}


def setup_worker() -> None:
    """Ray's worker_process_setup_hook for a loopback Ray. Serve binds two listeners to "[::]" in
    Python (Ray 2.60): each replica's inter-deployment gRPC server and the gRPC proxy. On a loopback
    node no peer can use another interface, so both bind 127.0.0.1 here."""
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        return
    from ray.serve._private import default_impl, replica

    for module, name in ((replica, "add_port_to_grpc_server"), (default_impl, "add_grpc_address")):
        original = getattr(module, name)
        if getattr(original, "cascade_loopback", False):
            continue

        def narrowed(server, address: str, _original=original):
            if address.startswith("[::]:"):
                address = "127.0.0.1:" + address[len("[::]:") :]
            return _original(server, address)

        setattr(narrowed, "cascade_loopback", True)  # noqa: B010 - a mark on a function object
        setattr(module, name, narrowed)
