"""One request type checks its own fields (core.request): the config file, the CLI, the servicer and
in-process callers all get the same rule and the same message, naming the field."""

from __future__ import annotations

import math

import pytest

from cascade_service.config import ConfigError, make_generation
from cascade_service.core.request import MAX_NEW_TOKENS, GenerationConfig, check_stop
from cascade_service.core.sampling import SamplingParams

BAD = [
    ("max_new_tokens", 0),
    ("max_new_tokens", MAX_NEW_TOKENS + 1),
    ("max_new_tokens", True),
    ("max_new_tokens", 2.0),
    ("temperature", -1.0),
    ("temperature", 100.5),
    ("temperature", math.nan),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", False),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", "7"),
    ("stop_threshold", 0.0),
    ("stop_threshold", 1.0),
    ("stop_threshold", math.inf),
]


@pytest.mark.parametrize(("field", "value"), BAD)
def test_a_bad_field_is_refused_in_one_message_naming_it_wherever_the_request_comes_from(field, value):
    with pytest.raises(ValueError) as caught:
        GenerationConfig(**{field: value})
    message = str(caught.value)
    assert message.startswith(f"{field} must be in ") and message.endswith(f"got {value!r}")
    with pytest.raises(ConfigError) as from_file:  # the config file's `generation:` section
        make_generation(GenerationConfig(), {field: value})
    assert str(from_file.value) == f"generation.{message}"


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, v in BAD if f in ("temperature", "top_p")])
def test_a_tier_checks_sampling_values_by_the_same_rule(field, value):
    with pytest.raises(ValueError) as request:
        GenerationConfig(**{field: value})
    with pytest.raises(ValueError) as tier:
        SamplingParams(**{field: value})
    assert str(tier.value) == str(request.value)


def test_the_limits_are_inclusive_where_they_say_so_and_numbers_are_stored_as_floats():
    edge = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=100, top_p=1, seed=2**63 - 1, stop_threshold=0.5)
    assert (edge.max_new_tokens, edge.temperature, edge.top_p, edge.seed) == (MAX_NEW_TOKENS, 100.0, 1.0, 2**63 - 1)
    assert type(edge.temperature) is float and type(edge.top_p) is float
    assert GenerationConfig(temperature=1) == GenerationConfig(temperature=1.0)  # YAML's 1 and the wire's 1.0
    assert GenerationConfig().verification.rule == "exact"


def test_stop_strings_are_bounded_and_one_string_is_not_split():
    assert check_stop("\n\n") == ("\n\n",)
    assert check_stop(["a", "b"]) == ("a", "b")
    for bad in (["a"] * 17, [""], ["x" * 257], [3]):
        with pytest.raises(ValueError, match=r"^stop: at most 16 non-empty strings of at most 256 characters$"):
            check_stop(bad)


def test_a_request_for_a_drafter_below_keeps_every_other_field():
    # DraftRequest.asking builds the request field by field (dataclasses.replace is slow on a round's
    # path): it must equal replace's result with every field set away from its default, and a field
    # added to DraftRequest must be added there too.
    from dataclasses import fields, replace

    from cascade_service.core.adaptive import AdaptiveLength
    from cascade_service.core.tier import DraftRequest
    from cascade_service.core.types import Context

    names = {f.name for f in fields(DraftRequest)}
    assert names == {
        *("request_id", "context", "want", "limit", "sampling", "seed", "eos_ids", "adaptive"),
        *("min_match", "cache_salt", "grammar", "keyed"),
    }, "a new DraftRequest field: carry it in DraftRequest.asking"
    request = DraftRequest(
        "r",
        Context([1, 2, 3], 2),
        4,
        9,
        SamplingParams(temperature=0.5),
        11,
        frozenset({7}),
        {"small": AdaptiveLength("confidence", 0.4)},
        2,
        "salt",
        None,
        True,
    )
    grammar = object()  # the coordinator's GrammarMask, passed as is (it is not compared)
    asked = request.asking(Context([1, 2, 3, 4], 3), 5, 6, 12, 3, grammar, False)  # type: ignore[arg-type]
    expected = replace(request, context=Context([1, 2, 3, 4], 3), want=5, limit=6, seed=12, min_match=3, keyed=False)
    assert asked == expected and asked.grammar is grammar
