"""The GenerateRequest the SDK sends (sync and aio): every argument left as None stays unset."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from cascade_service.api.v1 import cascade_pb2 as pb


def generate_request(
    prompt: str | None,
    *,
    max_new_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    seed: int | None,
    stop: Sequence[str] | str,
    session_id: str | None,
    prompt_token_ids: Sequence[int] | None,
    verification: str | None,
    alpha: float | None,
    beta: float | str | None = None,
    stop_threshold: float | None = None,
    speculation: str | None = None,
    target_row: Sequence[int] | None = None,
    logprobs: int | None = None,
    response_format: Mapping[str, Any] | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    logit_bias: Mapping[int, float] | None = None,
    prediction: str | Sequence[int] | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    n: int | None = None,
    best_of: int | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest where every argument left as None stays unset, so the server applies its default."""
    stop = (stop,) if isinstance(stop, str) else stop  # one stop string, not its characters
    fields: dict[str, Any] = {
        "prompt": prompt or "",
        "prompt_token_ids": list(prompt_token_ids or ()),
        "session_id": session_id or "",
        "stop": list(stop),
        "logit_bias": dict(logit_bias or {}),
    }
    # proto3 `optional`: passing only the given values keeps HasField() false for the rest, which is
    # how the server tells "unset" from 0 (temperature 0 = greedy must still be sent).
    optional = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "seed": seed,
        "stop_threshold": stop_threshold,
        "repetition_penalty": repetition_penalty,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "logprobs": logprobs,
        "n": n,
        "best_of": best_of,
    }
    fields.update({name: value for name, value in optional.items() if value is not None})
    if verification is not None:  # alpha alone means nothing: the rule is what reads it
        rule: dict[str, Any] = {"rule": verification}
        if alpha is not None:
            rule["alpha"] = alpha
        if beta == "tuned":  # lossy's beta tuned per position
            rule["tune_beta"] = True
        elif beta is not None:
            rule["beta"] = beta
        fields["verification"] = pb.Verification(**rule)
    if isinstance(prediction, str):  # the output expected: text, or token ids
        fields["prediction"] = pb.Prediction(content=prediction)
    elif prediction is not None:
        fields["prediction"] = pb.Prediction(token_ids=list(prediction))
    if speculation is not None or target_row is not None:  # the server checks both
        fields["speculation"] = pb.Speculation(mode=speculation or "", target_row=list(target_row or ()))
    if response_format is not None:  # one of json_schema (a dict or JSON text), json_object, regex, lark
        formats: dict[str, Any] = {k: json.dumps(v) if isinstance(v, dict) else v for k, v in response_format.items()}
        fields["response_format"] = pb.ResponseFormat(**formats)
    return pb.GenerateRequest(**fields)
