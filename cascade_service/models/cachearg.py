"""The name a transformers forward takes its KV cache under, decided once per model class.

transformers 5.2x renamed the `past_key_values` keyword of every model's forward (and the output
field) to `cache`; the old keyword warns (FutureWarning) until 5.40, where it is removed. The oldest
transformers the pin admits (pyproject.toml) knows only `past_key_values`. So every call site passes
its cache through `cache_kwargs` and reads a returned one through `returned_cache`, and the choice
is made from the forward's own signature (what the installed class accepts), not a version number.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

CURRENT = "cache"
LEGACY = "past_key_values"


_KEYWORDS: dict[type, str] = {}  # model class -> its forward's cache keyword


def cache_keyword(module: Any) -> str:
    """`cache` where `module`'s forward takes it (transformers 5.2x, models.lean), else `past_key_values`."""
    cls = type(module)
    if not hasattr(cls, "forward"):  # a plain callable in a model's place (a test's double)
        return _keyword(module)
    if cls not in _KEYWORDS:
        _KEYWORDS[cls] = _keyword(cls.forward)
    return _KEYWORDS[cls]


def _keyword(forward: Any) -> str:
    # inspect.signature follows transformers' @deprecate_kwarg wrapper (functools.wraps) to the real
    # forward, whose parameters name the cache the way the installed transformers does.
    return CURRENT if CURRENT in inspect.signature(forward).parameters else LEGACY


def cache_kwargs(module: Any, cache: Any) -> dict[str, Any]:
    """{keyword: cache} for a call of `module` (a transformers model or a lean one)."""
    return {cache_keyword(module): cache}


def returned_cache(output: Any) -> Any:
    """The cache a forward returned: the output's `cache` field where it has one, else the older
    `past_key_values` (reading that name on a newer output logs a deprecation)."""
    names = {f.name for f in dataclasses.fields(output)} if dataclasses.is_dataclass(output) else set()
    return getattr(output, CURRENT if CURRENT in names else LEGACY)
