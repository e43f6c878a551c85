"""Where cascade-service keeps built artefacts ($CASCADE_SERVICE_HOME, default ~/.cache/cascade-service)
and where the families shipped with the package are ($CASCADE_SERVICE_FAMILIES, default the package's
zoo/families: configs name the shipped family as ${CASCADE_SERVICE_FAMILIES}/quality/large)."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "CASCADE_SERVICE_HOME"
FAMILIES_ENV = "CASCADE_SERVICE_FAMILIES"


def home() -> Path:
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".cache" / "cascade-service").expanduser()


def zoo_dir(preset: str) -> Path:
    return home() / "zoo" / preset


def families() -> Path:
    """The shipped families' folder (zoo/shipped.py)."""
    return Path(os.environ.get(FAMILIES_ENV) or Path(__file__).resolve().parent / "zoo" / "families").expanduser()


def expand(path: str) -> str:
    """Expand ~ and environment variables; $CASCADE_SERVICE_HOME and $CASCADE_SERVICE_FAMILIES fall
    back to their defaults."""
    text = os.path.expanduser(path)
    for env, default in ((HOME_ENV, home), (FAMILIES_ENV, families)):
        for form in ("${" + env + "}", "$" + env):
            text = text.replace(form, str(default()))
    return os.path.expandvars(text)
