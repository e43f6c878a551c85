"""The OpenAI request and reply bodies of `api.openai_http`: fields in, errors and usage out."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from ..core.limits import MAX_LOGIT_BIAS, is_integer, is_number
from ..proto.v1 import cascade_pb2 as pb
from .choices import MAX_CHOICES, choice_counts
from .status import too_large

HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "OUT_OF_RANGE": 400,
    "FAILED_PRECONDITION": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "ABORTED": 409,
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 499,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error"}
ERROR_TYPES |= {404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable_error"}
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
# Fields OpenAI clients send that this server takes only at their neutral value.
NEUTRAL: dict[str, Any] = {"echo": False, "suffix": None}
COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "stream"}
COMMON |= {"stream_options", "user", "verification", "stop_threshold", "session_id", "speculation", *NEUTRAL}
COMMON |= {"top_k", "min_p", "logit_bias", "prediction"}  # top_k and min_p as vLLM and SGLang take them
COMMON |= {"presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs", "n", "best_of"}
COMMON |= {"response_format"}
DISCONNECT_POLL_S = 0.25


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def put_prompt(value: Any, message: pb.GenerateRequest) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        message.prompt = value
        return value
    if isinstance(value, list) and value and all(is_integer(t) for t in value):
        if not all(-(2**31) <= t < 2**31 for t in value):
            raise HttpError(400, "prompt: a token id out of range", "prompt")
        message.prompt_token_ids.extend(value)
        return ""
    raise HttpError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")


def put_verification(value: Any, message: pb.GenerateRequest) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or set(value) - {"rule", "alpha", "beta", "tune_beta"}:
        raise HttpError(400, "verification must be {rule, alpha, beta, tune_beta}", "verification")
    v = message.verification
    if "rule" in value:
        if not isinstance(value["rule"], str):
            raise HttpError(400, "verification.rule must be a string", "verification.rule")
        v.rule = value["rule"]
    for field in ("alpha", "beta"):
        if value.get(field) is not None:
            number = value[field]
            if not is_number(number):
                raise HttpError(400, f"verification.{field} must be a number", f"verification.{field}")
            setattr(v, field, float(number))
    if value.get("tune_beta") is not None:
        if not isinstance(value["tune_beta"], bool):
            raise HttpError(400, "verification.tune_beta must be true or false", "verification.tune_beta")
        v.tune_beta = value["tune_beta"]


def put_logit_bias(value: Any, message: pb.GenerateRequest) -> None:
    """OpenAI's `logit_bias`: {"token id": bias}, ids as JSON object keys (strings); ranges and the
    vocabulary are the coordinator's checks, which name the field the same way."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise HttpError(400, "logit_bias must map token ids to numbers", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise HttpError(400, f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens, got {len(value)}", "logit_bias")
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isdigit() and len(key) <= 10 else None
        if token is None or token >= 2**32:
            raise HttpError(400, f"logit_bias: {key!r} is not a token id", "logit_bias")
        if not is_number(bias):
            raise HttpError(400, f"logit_bias: the bias of token {key} must be a number", "logit_bias")
        message.logit_bias[token] = float(bias)


def put_prediction(value: Any, message: pb.GenerateRequest) -> None:
    """OpenAI's predicted outputs: `{"type": "content", "content": text or [{"type": "text", "text": ...}]}`."""
    if value is None:
        return
    if not isinstance(value, dict) or value.get("type") != "content" or set(value) - {"type", "content"}:
        raise HttpError(400, 'prediction must be {"type": "content", "content": ...}', "prediction")
    content = value.get("content")
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
            raise HttpError(400, "prediction.content: parts must be text parts", "prediction.content")
        content = "".join(str(part.get("text", "")) for part in content)
    if not isinstance(content, str):
        raise HttpError(400, "prediction.content must be a string or text parts", "prediction.content")
    message.prediction.content = content


def put_logprobs(body: Mapping[str, Any], chat: bool, message: pb.GenerateRequest) -> None:
    """Completions: `logprobs` = how many alternatives (0..20). Chat: `logprobs: true`, with
    `top_logprobs` alternatives (0..20). The range is the coordinator's check, named `logprobs`."""
    if chat:
        want, top = body.get("logprobs"), body.get("top_logprobs")
        if want is not None and not isinstance(want, bool):
            raise HttpError(400, "logprobs must be true or false", "logprobs")
        if top is not None and not want:
            raise HttpError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        count = (top or 0) if want else None
    else:
        count = body.get("logprobs")
    if count is None:
        return
    if not is_integer(count) or not 0 <= count < 2**31:
        field = "top_logprobs" if chat else "logprobs"
        raise HttpError(400, f"{field} must be an integer in [0, 20], got {count!r}", field)
    message.logprobs = count


def completion_logprobs(items: Sequence[pb.TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """The legacy completions' logprobs object for `items`, text offsets counted from `offset`."""
    tokens, offsets = [t.text for t in items], []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [t.logprob for t in items],
        "top_logprobs": [{a.text: a.logprob for a in t.top} for t in items],
        "text_offset": offsets,
    }


def chat_logprobs(items: Sequence[pb.TokenLogprob]) -> dict[str, Any]:
    """Chat's logprobs object: per token its text, logprob, UTF-8 bytes and top alternatives."""

    def one(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [one(t.text, t.logprob) | {"top_logprobs": [one(a.text, a.logprob) for a in t.top]} for t in items]
    }


def choices_of(body: Mapping[str, Any], chat: bool, stream: bool, message: pb.GenerateRequest) -> tuple[int, int]:
    """(n, best_of): the choices returned and the candidates decoded (completions' best_of; chat: n), put
    on `message` and checked by the servicer's own rule (api.choices.choice_counts: ranges, best_of >= n,
    one choice for a session request)."""
    given = {"n": body.get("n"), "best_of": body.get("n") if chat else body.get("best_of")}
    for field, value in given.items():
        if value is None:
            continue
        if not is_integer(value) or not 0 <= value < 2**32:
            raise HttpError(400, f"{field} must be an integer in [1, {MAX_CHOICES}], got {value!r}", field)
        setattr(message, field, value)
    try:
        n, best = choice_counts(message)
    except ValueError as exc:
        raise HttpError(400, str(exc), param_of(str(exc))) from None
    if stream and best > n:  # as OpenAI's: the best candidates are known only at the end
        raise HttpError(400, "best_of above n cannot be streamed", "best_of")
    return n, best


def put_response_format(value: Any, message: pb.GenerateRequest) -> None:
    """OpenAI's `response_format`: {"type": "text"}, {"type": "json_object"}, {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}; and, as vLLM takes them, {"type": "regex", "regex": ...}
    and {"type": "grammar", "grammar": ...} (Lark); for the JSON types, an optional "whitespace" (see the
    gRPC API's ResponseFormat). Compiling it is the coordinator's check."""
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        message.response_format.json_object = True
    elif kind == "json_schema" and isinstance(value.get("json_schema"), dict):
        schema = value["json_schema"].get("schema", {})
        if not isinstance(schema, dict):
            raise HttpError(400, "response_format.json_schema.schema must be an object", "response_format")
        try:
            message.response_format.json_schema = json.dumps(schema)
        except RecursionError:  # a body nested just short of the parser's limit; the encoder's is the same
            raise HttpError(400, "response_format: the JSON schema is nested too deeply", "response_format") from None
    elif kind in ("regex", "grammar") and isinstance(value.get(kind), str):
        setattr(message.response_format, "regex" if kind == "regex" else "lark", value[kind])
    else:
        raise HttpError(
            400,
            "response_format must be text, json_object, json_schema (with json_schema.schema), regex or grammar",
            "response_format",
        )
    whitespace = value.get("whitespace")  # our extension: "compact" (default), "spaced" or "free"
    if whitespace is not None:
        if not isinstance(whitespace, str):
            raise HttpError(400, "response_format.whitespace must be a string", "response_format.whitespace")
        message.response_format.whitespace = whitespace  # its range is the coordinator's check


def put_speculation(value: Any, message: pb.GenerateRequest) -> None:
    """`speculation: {"mode": "auto" | "off" | "fixed"}` (the mode's range is the coordinator's check)."""
    if value is None:
        return
    if not isinstance(value, dict) or set(value) - {"mode", "target_row"}:
        raise HttpError(400, "speculation must be {mode, target_row}", "speculation")
    mode = value.get("mode")
    if mode is not None:
        if not isinstance(mode, str):
            raise HttpError(400, "speculation.mode must be a string", "speculation.mode")
        message.speculation.mode = mode
    row = value.get("target_row")
    if row is not None:
        if not isinstance(row, list) or not all(is_integer(k) for k in row):
            raise HttpError(400, "speculation.target_row must be a list of integers", "speculation.target_row")
        if len(row) > 64 or not all(0 <= k < 2**32 for k in row):
            raise HttpError(400, "speculation.target_row: entries out of range", "speculation.target_row")
        message.speculation.target_row.extend(row)


async def json_body(request: Request, limit: int) -> dict[str, Any]:
    """The request's body as a JSON object. At most `limit` bytes (serving.admission.max_message_bytes,
    the gRPC API's message limit) are read: a larger body is a 413 naming the limit, refused as it
    arrives, so an oversized or endless body never sits in memory whole."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HttpError(413, too_large(None, limit))
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks) or b"null")
    except ValueError:
        raise HttpError(400, "the body is not JSON") from None
    except RecursionError:  # Python's parser recurses per level: a hostile body nests thousands deep
        raise HttpError(400, "the body's JSON is nested too deeply") from None
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    return body


def auth_metadata(request: Request) -> list[tuple[str, str]]:
    header = request.headers.get("authorization")
    return [("authorization", header)] if header else []


def status_code(name: str) -> Any:
    import grpc

    return grpc.StatusCode[name] if name in grpc.StatusCode.__members__ else grpc.StatusCode.INTERNAL


def param_of(message: str) -> str | None:
    """The field a refusal names: the servicer's messages start with it ("max_new_tokens must be ...")."""
    head = message.split(":", 1)[0].split(" ", 1)[0]
    return (
        {"max_new_tokens": "max_tokens"}.get(head, head) if head.replace(".", "").replace("_", "").isalnum() else None
    )


def plain(message: Any) -> Any:
    """A message as plain JSON values, 64-bit integers as numbers (protobuf's JSON mapping makes them
    strings, which OpenAI clients would pass on as such)."""
    if not hasattr(message, "ListFields"):
        return message
    out: dict[str, Any] = {}
    for field, value in message.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            out[field.name] = {k: plain(v) for k, v in value.items()}
        elif _repeated(field):
            out[field.name] = [plain(v) for v in value]
        else:
            out[field.name] = plain(value)
    return out


def _repeated(field: Any) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf 5.29+; `label` before
    return bool(repeated) if repeated is not None else field.label == field.LABEL_REPEATED


def completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt: int, completion: int, stats: pb.GenerateStats | None = None) -> dict[str, Any]:
    """OpenAI's usage object, from the request's stats: prompt tokens the target's prefix cache held
    (models.kvpool) and, with a prediction, its tokens kept and drafted in vain (core.proposers.prediction)."""
    stats = stats or pb.GenerateStats()
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": min(stats.cached_prompt_tokens, prompt)},
        "completion_tokens_details": {
            "accepted_prediction_tokens": stats.accepted_prediction_tokens,
            "rejected_prediction_tokens": stats.rejected_prediction_tokens,
        },
    }


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or str(status)}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)
