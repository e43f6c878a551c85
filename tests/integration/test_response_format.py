"""Structured output (core.grammar): a response format masks the target's distribution at the final
review. Greedy output equals plain `transformers` greedy `generate()` with a logits processor that
applies the same grammar's mask step by step (an independent decode: one token a step, no drafts), in
every cascade shape and through the wire codec; the output matches its regex, parses as JSON of its
schema, or ends with finish "length" when the budget runs out first; a bad format is refused naming
response_format before any work."""

from __future__ import annotations

import json
import re

import llguidance
import pytest
import torch
from transformers import AutoTokenizer, LogitsProcessorList

from cascade_service.config import GenerationConfig
from cascade_service.core.cascade import Lookup
from cascade_service.core.grammar import ResponseFormat, grammar_tokenizer
from cascade_service.inprocess import InProcess
from cascade_service.zoo.tiny import random_prompts

from ..helpers.oracle import greedy_generate, make_engine
from ..helpers.threads import soon
from ..helpers.tier_servers import addressed, running, serve_group, tiny_cascade

PROMPTS = random_prompts(2, 10, seed=99)
N = 24
SHAPES = {
    "sd": (["close"], [[4]], None),
    "vertical": (["close", "mid"], [[3, 3], [0, 4]], None),
    "horizontal+mag": (["close", "mid", "mag"], [[4, 2, 0], [0, 2, 6], [0, 0, 6]], Lookup(2, 10)),
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}},
    "required": ["color", "size"],
    "additionalProperties": False,
    # llguidance's option: no free whitespace (a tiny random model would spend its budget on newlines)
    "x-guidance": {"whitespace_flexible": False},
}
FORMATS = {"regex": ResponseFormat("regex", REGEX), "json_schema": ResponseFormat("json_schema", json.dumps(SCHEMA))}


class GrammarProcessor:
    """The oracle's mask: a fresh llguidance matcher fed the tokens `generate()` chose, one step at a time."""

    def __init__(self, tokenizer, grammar: str, prompt_length: int):
        self.matcher = llguidance.LLMatcher(grammar_tokenizer(tokenizer), grammar)
        self.start, self.fed = prompt_length, 0

    def __call__(self, input_ids, scores):
        out = input_ids[0, self.start :].tolist()
        for token in out[self.fed :]:
            assert self.matcher.consume_token(token)
        self.fed = len(out)
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32).to(torch.int64)
        allowed = ((words[:, None] >> torch.arange(32)) & 1).flatten().bool()[: scores.shape[-1]]
        allowed = torch.nn.functional.pad(allowed, (0, scores.shape[-1] - allowed.numel()))
        return scores.masked_fill(~allowed, float("-inf"))


def _oracle(target, prompt, response_format: ResponseFormat) -> list[int]:
    processor = GrammarProcessor(AutoTokenizer.from_pretrained(target), response_format.grammar(), len(prompt))
    out = greedy_generate(target, prompt, N, logits_processor=LogitsProcessorList([processor]))
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("loopback", [False, True], ids=["in-process", "wire"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_output_under_a_format_equals_transformers_with_the_grammars_mask(tiny_family, shape, loopback):
    names, k_matrix, lookup = SHAPES[shape]
    engine = make_engine(tiny_family, names, k_matrix, 1.5, lookup=lookup, loopback=loopback)
    tokenizer = AutoTokenizer.from_pretrained(tiny_family["target"])
    for prompt in PROMPTS:
        for kind, response_format in FORMATS.items():
            expected = _oracle(tiny_family["target"], prompt, response_format)
            got = engine.generate(prompt, GenerationConfig(max_new_tokens=N, response_format=response_format))
            assert got.token_ids == expected, (shape, kind)
            text = tokenizer.decode(got.token_ids, skip_special_tokens=True)
            if kind == "regex":
                assert re.fullmatch(REGEX, text), text
            else:
                value = json.loads(text)
                assert value["color"] in ("red", "green", "blue") and value["size"] in (1, 2, 3), value


def test_a_bad_format_is_refused_naming_response_format():
    for bad in (
        ResponseFormat("json_schema", json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})),
        ResponseFormat("regex", "[0-9"),
        ResponseFormat("lark", "start: undefined_rule"),
    ):
        with pytest.raises(ValueError, match="^response_format: "):
            bad.grammar()
    with pytest.raises(ValueError, match="^response_format: at most 65536 bytes"):
        ResponseFormat("json_schema", json.dumps({"description": "x" * 70000}))
    with pytest.raises(ValueError, match="^response_format: the JSON schema is not JSON"):
        ResponseFormat("json_schema", "{not json")
    with pytest.raises(ValueError, match="^response_format must be one of"):
        ResponseFormat("xml")
    with pytest.raises(ValueError, match="^response_format.whitespace must be one of compact, spaced, free"):
        ResponseFormat("json_object", "", "tabs")
    with pytest.raises(ValueError, match="^response_format.whitespace applies to json_schema and json_object"):
        ResponseFormat("regex", "[0-9]", "free")


def test_drafters_on_tier_servers_mask_with_a_grammar_state_of_their_own(tiny_family):
    # The drafters on tier servers (real gRPC on loopback): each call carries the request's format and the
    # committed length, the server follows the output with its own matcher (transport.grammars) and masks
    # its drafter's steps; the output is still the oracle's, and the states go with the requests.
    cascade = tiny_cascade(tiny_family, k_matrix=[[3, 2, 0], [0, 3, 2], [0, 0, 0]])  # mid drafts alone
    servers = {name: serve_group(cascade, [name]) for name in ("close", "mid")}
    with running(*servers.values()):
        engine = InProcess(addressed(cascade, servers))
        for prompt in PROMPTS:
            for kind, response_format in FORMATS.items():
                expected = _oracle(tiny_family["target"], prompt, response_format)
                got = engine.generate(prompt, GenerationConfig(max_new_tokens=N, response_format=response_format))
                assert got.token_ids == expected, kind
        grammars = servers["mid"].service.group.servers["mid"].grammars
        assert grammars.replays == len(PROMPTS) * len(FORMATS)  # a state per request, kept across its calls
        assert soon(lambda: len(grammars) == 0)  # released with the requests


def test_json_output_is_compact_by_default_so_a_whitespace_loving_model_still_parses(tiny_family):
    # A target that prefers whitespace above all (logit_bias on every whitespace token): where JSON allows
    # free whitespace between keys, it fills the budget with it and never closes the object; compact (the
    # default) and spaced leave it no whitespace to choose outside strings, so the object closes in a few
    # tokens and parses. The control ("free") shows the bias does what this test needs.
    tokenizer = AutoTokenizer.from_pretrained(tiny_family["target"])
    blank = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) and not tokenizer.decode([i]).strip()]
    assert len(blank) > 5, "the tiny tokenizer must have whitespace tokens for this test to mean anything"
    schema = {k: v for k, v in SCHEMA.items() if k != "x-guidance"}  # the request's option decides
    engine = make_engine(tiny_family, ["close", "mid"], [[3, 3], [0, 4]], 1.5)
    budget = 32
    for whitespace, parses in (("", True), ("compact", True), ("spaced", True), ("free", False)):
        fmt = ResponseFormat("json_schema", json.dumps(schema), whitespace)
        config = GenerationConfig(
            max_new_tokens=budget, response_format=fmt, logit_bias=tuple((i, 50.0) for i in blank)
        )
        for prompt in PROMPTS:
            got = engine.generate(prompt, config)
            text = tokenizer.decode(got.token_ids, skip_special_tokens=True)
            if parses:
                value = json.loads(text)
                assert set(value) == {"color", "size"}, text
                assert len(got.token_ids) < budget, (whitespace, text)  # ended by the grammar
                gaps = re.sub(r'"[^"]*"', "", text)  # what lies outside strings
                if whitespace == "spaced":  # exactly one space after each separator, none elsewhere
                    assert gaps.count(", ") == gaps.count(",") and gaps.count(": ") == gaps.count(":"), text
                    gaps = gaps.replace(", ", ",").replace(": ", ":")
                assert not re.search(r"\s", gaps), text
            else:
                assert len(got.token_ids) == budget, text  # the budget ran out first
                with pytest.raises(ValueError):
                    json.loads(text)
