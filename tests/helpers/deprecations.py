"""A deprecation our code causes fails the test that meets it (issue 48, point 3).

A warnings filter's module field matches the module a warning is *attributed* to, and a deprecated
keyword of a transformers forward is attributed to torch's `Module._call_impl` (transformers'
`deprecate_kwarg` warns with stacklevel=2, one frame above its wrapper), so `error::FutureWarning:
cascade_service` never sees it. So the test run also looks at the stack when a FutureWarning or
DeprecationWarning is shown: walking out from the code that issued it, past the issuing library's own
frames and torch's module-call plumbing, the first frame it meets is the one that used the deprecated
API. If that frame (or the issuer itself) is in `cascade_service`, the warning raises
`DeprecatedCallError` at the call, as an `error` filter would; a library's deprecation met inside
another library's internals stays a warning in the summary.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

OURS = "cascade_service"
CATEGORIES = (DeprecationWarning, FutureWarning)
# Frames between a caller and the API it calls that are nobody's API: nn.Module.__call__ on the way
# to a forward.
PLUMBING = frozenset({"torch.nn.modules.module"})


class DeprecatedCallError(AssertionError):
    """Our code used a deprecated API (the message is the library's warning)."""


def _module(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__", ""))


def caller_of_deprecated(frame: FrameType | None) -> str:
    """The module that used the deprecated API, given the frame that issued the warning."""
    while frame is not None and _module(frame) == "warnings":  # the pure-Python warnings module
        frame = frame.f_back
    if frame is None:
        return ""
    issuer = _module(frame).split(".")[0]
    if issuer == OURS:
        return _module(frame)
    while frame is not None and (_module(frame).split(".")[0] == issuer or _module(frame) in PLUMBING):
        frame = frame.f_back
    return "" if frame is None else _module(frame)


def is_ours(module: str) -> bool:
    return module == OURS or module.startswith(OURS + ".")


@contextmanager
def deprecations_fail() -> Iterator[None]:
    """Within: a FutureWarning or DeprecationWarning our code causes raises DeprecatedCallError;
    every other warning goes on to whatever showed warnings before (pytest's recorder)."""
    shown: Callable[..., Any] = warnings.showwarning

    def show(message: Any, category: type[Warning], filename: str, lineno: int, *rest: Any) -> None:
        if issubclass(category, CATEGORIES):
            # Frame 0 is this function; 1 is whoever called warnings.warn (the C warn has no frame).
            module = caller_of_deprecated(sys._getframe(1))
            if is_ours(module):
                raise DeprecatedCallError(f"{module} used a deprecated API: {category.__name__}: {message}")
        shown(message, category, filename, lineno, *rest)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown
