"""Where cascade-service keeps built artefacts: $CASCADE_SERVICE_HOME (default ~/.cache/cascade-service)."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "CASCADE_SERVICE_HOME"


def home() -> Path:
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".cache" / "cascade-service").expanduser()


def zoo_dir(preset: str) -> Path:
    return home() / "zoo" / preset


def expand(path: str) -> str:
    """Expand ~ and environment variables; $CASCADE_SERVICE_HOME falls back to its default."""
    text = os.path.expanduser(path)
    for form in ("${" + HOME_ENV + "}", "$" + HOME_ENV):
        text = text.replace(form, str(home()))
    return os.path.expandvars(text)
