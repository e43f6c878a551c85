"""The GenerateRequest the SDK sends (sync and aio): every argument left as None stays unset.

The fields a call may set are declared once, here (`StreamOptions`, and `GenerateOptions` with the
choices only `generate()` takes); the clients' methods take them as keyword arguments
(`**options: Unpack[...]`), so a type checker and an editor see each one, and pass them on whole."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from cascade_service.proto.v1 import cascade_pb2 as pb


class StreamOptions(TypedDict, total=False):
    """The request fields `stream()` (and `generate()`) take; one left out, or None, stays unset."""

    max_new_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    logit_bias: Mapping[int, float] | None
    prediction: str | Sequence[int] | None
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    seed: int | None
    stop: Sequence[str] | str
    session_id: str | None
    prompt_token_ids: Sequence[int] | None
    verification: str | None
    alpha: float | None
    beta: float | str | None
    stop_threshold: float | None
    speculation: str | None
    target_row: Sequence[int] | None
    logprobs: int | None
    response_format: Mapping[str, Any] | None


class GenerateOptions(StreamOptions, total=False):
    """`generate()`'s fields: the stream's, and several choices (a stream carries one)."""

    n: int | None
    best_of: int | None


# proto3 `optional` fields, set only when given (see generate_request).
OPTIONAL = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_threshold",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "n",
    "best_of",
)


def generate_request(
    prompt: str | None, options: Mapping[str, Any], takes: type = GenerateOptions, method: str = "generate"
) -> pb.GenerateRequest:
    """A GenerateRequest from `options` (the keyword arguments of `method`, fields of the TypedDict `takes`),
    where every one left as None stays unset, so the server applies its default."""
    unknown = sorted(set(options) - takes.__optional_keys__)  # type: ignore[attr-defined]  # a TypedDict's
    if unknown:  # as Python says it of a function without such a parameter
        raise TypeError(f"{method}() got an unexpected keyword argument {unknown[0]!r}")
    get = options.get
    stop = get("stop", ())
    stop = (stop,) if isinstance(stop, str) else stop  # one stop string, not its characters
    fields: dict[str, Any] = {
        "prompt": prompt or "",
        "prompt_token_ids": list(get("prompt_token_ids") or ()),
        "session_id": get("session_id") or "",
        "stop": list(stop),
        "logit_bias": dict(get("logit_bias") or {}),
    }
    # proto3 `optional`: passing only the given values keeps HasField() false for the rest, which is
    # how the server tells "unset" from 0 (temperature 0 = greedy must still be sent).
    fields.update({name: options[name] for name in OPTIONAL if get(name) is not None})
    verification, alpha, beta = get("verification"), get("alpha"), get("beta")
    if verification is not None:  # alpha alone means nothing: the rule is what reads it
        rule: dict[str, Any] = {"rule": verification}
        if alpha is not None:
            rule["alpha"] = alpha
        if beta == "tuned":  # lossy's beta tuned per position
            rule["tune_beta"] = True
        elif beta is not None:
            rule["beta"] = beta
        fields["verification"] = pb.Verification(**rule)
    prediction, speculation, target_row = get("prediction"), get("speculation"), get("target_row")
    if isinstance(prediction, str):  # the output expected: text, or token ids
        fields["prediction"] = pb.Prediction(content=prediction)
    elif prediction is not None:
        fields["prediction"] = pb.Prediction(token_ids=list(prediction))
    if speculation is not None or target_row is not None:  # the server checks both
        fields["speculation"] = pb.Speculation(mode=speculation or "", target_row=list(target_row or ()))
    response_format = get("response_format")
    # One of json_schema (a dict or JSON text), json_object, regex, lark; with a JSON one, optionally
    # whitespace ("compact", the server's default, "spaced" or "free").
    if response_format is not None:
        formats: dict[str, Any] = {k: json.dumps(v) if isinstance(v, dict) else v for k, v in response_format.items()}
        fields["response_format"] = pb.ResponseFormat(**formats)
    return pb.GenerateRequest(**fields)
