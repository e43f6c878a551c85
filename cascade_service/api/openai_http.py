"""An OpenAI-compatible HTTP API and `/metrics`, beside the gRPC API on the same front end.

`POST /v1/completions`, `POST /v1/chat/completions` (where the tokenizer has a chat template),
`GET /v1/models`, server-sent events when `stream` is true, `GET /metrics` (Prometheus) and `GET /health`.
A request body becomes a `cascade.v1.GenerateRequest` and runs through the same backend, the same
admission (keys, per-key limits, workers, queue) and the same validation as a gRPC call, so a field
is refused with the same message; the gRPC status becomes the HTTP status of an OpenAI-style error
body. Cascade knobs ride as extra body fields: `verification` ({rule, alpha, beta, tune_beta}),
`stop_threshold`, `seed`, `session_id`. Replies carry `usage` and the cascade's stats as `cascade`.
A client that disconnects cancels its request at the next round (its KV caches are freed).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..metrics import CONTENT_TYPE, Metrics
from .admission import CallHooks, Refused
from .v1 import cascade_pb2 as pb

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
NEUTRAL = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "echo": False, "logprobs": None}
NEUTRAL |= {"logit_bias": None, "suffix": None, "top_logprobs": None, "response_format": None}
COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "stream"}
COMMON |= {"stream_options", "user", "verification", "stop_threshold", "session_id", *NEUTRAL}
DISCONNECT_POLL_S = 0.25


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


ChatTemplate = Callable[[list[dict[str, Any]]], str]


def openai_app(
    frontend: Any,  # api.frontend.Frontend, on this loop
    model: str,
    count_tokens: Callable[[str], int],
    metrics: Metrics,
    chat: ChatTemplate | None = None,
) -> Starlette:
    """The HTTP app for `frontend`'s backend; `model` is the name /v1/models lists and requests name."""
    api = _Api(frontend, model, count_tokens, metrics, chat)
    return Starlette(
        routes=[
            Route("/v1/completions", api.completions, methods=["POST"]),
            Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/metrics", api.metrics_text, methods=["GET"]),
            Route("/health", api.health, methods=["GET"]),
        ]
    )


class _Api:
    def __init__(
        self, frontend: Any, model: str, count: Callable[[str], int], metrics: Metrics, chat: ChatTemplate | None
    ):
        self.frontend, self.model, self.count, self.metrics, self.chat = frontend, model, count, metrics, chat

    async def models(self, request: Request) -> Response:
        try:
            with self.frontend.open_call(_auth(request)):
                pass
        except Refused as refused:
            return _error(HTTP_STATUS.get(refused.code.name, 500), refused.message)
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "cascade-service"}
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

    async def health(self, request: Request) -> Response:
        ok = self.frontend.serving and not self.frontend.stopping
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool) -> Response:
        try:
            body = await _json(request)
            message, prompt = self._request(body, chat)
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise HttpError(400, "stream must be true or false", "stream")
            with self.frontend.open_call(_auth(request)) as owner:
                if not stream:
                    return await self._unary(request, message, prompt, chat, owner)
            # A stream holds its key's slot, a worker and the queue while it runs: all taken in _events.
            first, events = await self._events(request, message, prompt, chat, body)
            return StreamingResponse(_prepend(first, events), media_type="text/event-stream")
        except Refused as refused:
            self.metrics.refused(refused.code.name)
            return _error(HTTP_STATUS.get(refused.code.name, 500), refused.message, _param(refused.message))
        except HttpError as error:
            self.metrics.refused(str(error.status))
            return _error(error.status, error.message, error.param, error.code)

    def _request(self, body: Mapping[str, Any], chat: bool) -> tuple[pb.GenerateRequest, str]:
        allowed = COMMON | ({"messages"} if chat else {"prompt"})
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise HttpError(400, f"{unknown[0]}: not a field this server takes", unknown[0])
        for field, neutral in NEUTRAL.items():
            if body.get(field, neutral) not in (neutral, None) and body.get(field) != neutral:
                raise HttpError(400, f"{field}: only {neutral!r} is supported", field)
        if body.get("model", self.model) != self.model:
            raise HttpError(404, f"model: {body.get('model')!r} is not served here (try {self.model!r})", "model")
        message = pb.GenerateRequest()
        text = ""
        if chat:
            text = self._chat_prompt(body.get("messages"))
            message.prompt = text
        else:
            text = _prompt(body.get("prompt"), message)
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        for field, value, kind in (
            ("max_tokens", limit, int),
            ("temperature", body.get("temperature"), float),
            ("top_p", body.get("top_p"), float),
            ("seed", body.get("seed"), int),
            ("stop_threshold", body.get("stop_threshold"), float),
        ):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
                raise HttpError(400, f"{field} must be a number, got {value!r}", field)
            target = {"max_tokens": "max_new_tokens"}.get(field, field)
            try:
                setattr(message, target, kind(value))
            except (ValueError, TypeError, OverflowError):
                raise HttpError(400, f"{field}: {value!r} is out of range", field) from None
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise HttpError(400, "stop must be a string or a list of strings", "stop")
        message.stop.extend(stops)
        session = body.get("session_id")
        if session is not None:
            if not isinstance(session, str):
                raise HttpError(400, "session_id must be a string", "session_id")
            message.session_id = session
        _verification(body.get("verification"), message)
        return message, text

    def _chat_prompt(self, messages: Any) -> str:
        if self.chat is None:
            raise HttpError(
                400, "messages: this model's tokenizer has no chat template; use /v1/completions", "messages"
            )
        if not isinstance(messages, list) or not messages:
            raise HttpError(400, "messages must be a non-empty list", "messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise HttpError(400, "messages: each is {role: string, content: string}", "messages")
        return self.chat(messages)

    async def _unary(self, request: Request, message: pb.GenerateRequest, prompt: str, chat: bool, owner: str):
        call = CallHooks()
        async with self.frontend.admitted(call):
            work = self.frontend.run(
                call,
                lambda: self.frontend.backend.call("Generate", message.SerializeToString(), None, owner, call.on_end),
            )
            task = asyncio.ensure_future(work)
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    call.end()  # the decode stops at its next round and frees its KV caches
            code, details, payload = task.result()
        if code != "OK":
            raise Refused(_code(code), details)
        reply = pb.GenerateResponse.FromString(payload)
        return JSONResponse(self._completion(reply, message, prompt, chat))

    def _completion(self, reply: pb.GenerateResponse, message: pb.GenerateRequest, prompt: str, chat: bool) -> dict:
        finish = FINISH.get(reply.finish_reason, reply.finish_reason)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": reply.text}
        else:
            choice["text"] = reply.text
        prompt_tokens = len(message.prompt_token_ids) or self.count(prompt)
        return {
            "id": _id(chat),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": _usage(prompt_tokens, len(reply.token_ids)),
            "cascade": _plain(reply.stats),
        }

    async def _events(
        self, request: Request, message: pb.GenerateRequest, prompt: str, chat: bool, body: Mapping[str, Any]
    ) -> tuple[bytes, AsyncIterator[bytes]]:
        """The first event (so that a refusal is an HTTP status, not a 200 with an error event) and the rest."""
        frontend, call = self.frontend, CallHooks()
        ident, created = _id(chat), int(time.time())
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        prompt_tokens = len(message.prompt_token_ids) or self.count(prompt)
        opened = frontend.open_call(_auth(request))
        owner = opened.__enter__()
        admitted = frontend.admitted(call)
        try:
            await admitted.__aenter__()
            replies = frontend.replies(call, "GenerateStream", message.SerializeToString(), None, owner)
            iterator = aiter(replies)
        except BaseException:
            opened.__exit__(None, None, None)
            raise

        def event(chunk: pb.GenerateChunk | None, first: bool, generated: int) -> bytes:
            if chunk is None:  # the usage chunk
                data: dict[str, Any] = {"choices": [], "usage": _usage(prompt_tokens, generated)}
            else:
                finish = FINISH.get(chunk.finish_reason, chunk.finish_reason) or None
                if chat:
                    delta = {"content": chunk.text} | ({"role": "assistant"} if first else {})
                    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
                else:
                    choice = {"index": 0, "text": chunk.text, "finish_reason": finish, "logprobs": None}
                data = {"choices": [choice]}
                if chunk.HasField("stats"):
                    data["cascade"] = _plain(chunk.stats)
            head = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion", "created": created}
            return b"data: " + json.dumps(head | {"model": self.model} | data).encode() + b"\n\n"

        async def next_chunk() -> pb.GenerateChunk | None:
            try:
                code, details, payload = await anext(iterator)
            except StopAsyncIteration:
                return None
            if code != "OK":
                raise Refused(_code(code), details)
            return pb.GenerateChunk.FromString(payload)

        async def close() -> None:
            call.end()
            try:
                await replies.aclose()
            finally:
                await admitted.__aexit__(None, None, None)
                opened.__exit__(None, None, None)

        try:
            first = await next_chunk()
        except BaseException:
            await close()
            raise

        async def rest() -> AsyncIterator[bytes]:
            generated = len(first.token_ids) if first else 0
            try:
                while True:
                    try:
                        chunk = await next_chunk()
                    except Refused as refused:  # mid-stream: the status can only go in an event
                        error = _error_body(HTTP_STATUS.get(refused.code.name, 500), refused.message)
                        yield b"data: " + json.dumps(error).encode() + b"\n\n"
                        break
                    if chunk is None:
                        if include_usage:
                            yield event(None, False, generated)
                        yield b"data: [DONE]\n\n"
                        break
                    generated += len(chunk.token_ids)
                    yield event(chunk, False, generated)
            finally:
                await close()  # also when the client disconnects: the decode stops, its caches go

        if first is None:
            await close()
            raise Refused(_code("INTERNAL"), "the stream ended without a reply")
        return event(first, True, len(first.token_ids)), rest()


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for item in rest:
        yield item


def _prompt(value: Any, message: pb.GenerateRequest) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        message.prompt = value
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if not all(-(2**31) <= t < 2**31 for t in value):
            raise HttpError(400, "prompt: a token id out of range", "prompt")
        message.prompt_token_ids.extend(value)
        return ""
    raise HttpError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")


def _verification(value: Any, message: pb.GenerateRequest) -> None:
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
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                raise HttpError(400, f"verification.{field} must be a number", f"verification.{field}")
            setattr(v, field, float(number))
    if value.get("tune_beta") is not None:
        if not isinstance(value["tune_beta"], bool):
            raise HttpError(400, "verification.tune_beta must be true or false", "verification.tune_beta")
        v.tune_beta = value["tune_beta"]


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"null")
    except ValueError:
        raise HttpError(400, "the body is not JSON") from None
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    return body


def _auth(request: Request) -> list[tuple[str, str]]:
    header = request.headers.get("authorization")
    return [("authorization", header)] if header else []


def _code(name: str) -> Any:
    import grpc

    return grpc.StatusCode[name] if name in grpc.StatusCode.__members__ else grpc.StatusCode.INTERNAL


def _param(message: str) -> str | None:
    """The field a refusal names: the servicer's messages start with it ("max_new_tokens must be ...")."""
    head = message.split(":", 1)[0].split(" ", 1)[0]
    return (
        {"max_new_tokens": "max_tokens"}.get(head, head) if head.replace(".", "").replace("_", "").isalnum() else None
    )


def _plain(message: Any) -> Any:
    """A message as plain JSON values, 64-bit integers as numbers (protobuf's JSON mapping makes them
    strings, which OpenAI clients would pass on as such)."""
    if not hasattr(message, "ListFields"):
        return message
    out: dict[str, Any] = {}
    for field, value in message.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            out[field.name] = {k: _plain(v) for k, v in value.items()}
        elif _repeated(field):
            out[field.name] = [_plain(v) for v in value]
        else:
            out[field.name] = _plain(value)
    return out


def _repeated(field: Any) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf 5.29+; `label` before
    return bool(repeated) if repeated is not None else field.label == field.LABEL_REPEATED


def _id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or str(status)}}


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(status, message, param, code), status_code=status)
