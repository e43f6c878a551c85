"""A deprecated API our code calls fails the test that meets it; a library's own internals do not
(tests/helpers/deprecations.py, issue 48 point 3). Negative controls: each rule is shown to fire."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from transformers import DynamicCache

from cascade_service.models import hf
from cascade_service.models.cachearg import CURRENT, LEGACY, cache_keyword
from cascade_service.models.hf import HFModel

from ..helpers.deprecations import DeprecatedCallError, deprecations_fail


def _module_function(module: str, source: str, **names):
    """A function defined as if in `module` (its frames report that __name__), for the stack rule."""
    scope = {"__name__": module, "warnings": warnings, **names}
    exec(source, scope)
    return scope["run"]


LIBRARY = _module_function("somelib.api", "def run():\n    warnings.warn('old', DeprecationWarning, stacklevel=2)\n")


def test_a_library_deprecation_called_from_our_module_raises():
    ours = _module_function("cascade_service.fake", "def run():\n    library()\n", library=LIBRARY)
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # not once per location: every call is shown
        with deprecations_fail(), pytest.raises(DeprecatedCallError, match="cascade_service.fake"):
            ours()


def test_a_deprecation_our_module_raises_itself_raises():
    ours = _module_function("cascade_service.fake", "def run():\n    warnings.warn('ours', FutureWarning)\n")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with deprecations_fail(), pytest.raises(DeprecatedCallError, match="ours"):
            ours()


def test_a_deprecation_inside_another_librarys_internals_stays_a_warning():
    # Our code calls otherlib, which calls somelib's deprecated API: otherlib's business, not ours.
    other = _module_function("otherlib.core", "def run():\n    library()\n", library=LIBRARY)
    ours = _module_function("cascade_service.fake", "def run():\n    other()\n", other=other)
    with pytest.warns(DeprecationWarning, match="old"), deprecations_fail():
        ours()


def test_the_old_cache_keyword_from_our_forward_fails_and_the_current_one_does_not(tiny_family, monkeypatch):
    model = HFModel.load(tiny_family["close"], name="close")
    with torch.inference_mode():
        model.forward_now([5, 6, 7], DynamicCache(), 1)  # models.cachearg's keyword: no deprecation
    takes = inspect.signature(type(model.module).forward).parameters
    assert cache_keyword(model.module) == (CURRENT if CURRENT in takes else LEGACY)
    monkeypatch.setattr(hf, "cache_kwargs", lambda module, cache: {LEGACY: cache})
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        if CURRENT in takes:  # this transformers deprecates the old keyword: the call must fail
            with deprecations_fail(), pytest.raises(DeprecatedCallError, match="past_key_values"):
                with torch.inference_mode():
                    model.forward_now([5, 6, 7], DynamicCache(), 1)
        else:  # the oldest transformers the pin admits: the old keyword is the only one, and is fine
            with deprecations_fail(), torch.inference_mode():
                model.forward_now([5, 6, 7], DynamicCache(), 1)
