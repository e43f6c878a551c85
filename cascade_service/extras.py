"""Optional dependencies: a clear error naming the extra to install, instead of a bare ImportError.

A bare `pip install cascade-service` generates in-process and serves one process; the Ray Serve
service and Redis sessions need `[serve]`, benchmark plots `[plots]` (`[all]` has both).
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {"ray": "serve", "redis": "serve", "matplotlib": "plots"}


class MissingExtra(ImportError):
    pass


def require(module: str, what: str) -> ModuleType:
    """Import `module`, or fail saying which extra `what` needs."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = EXTRAS[module.split(".")[0]]
        raise MissingExtra(
            f"{what} needs {module}, which a bare install leaves out: pip install 'cascade-service[{extra}]'"
        ) from exc
