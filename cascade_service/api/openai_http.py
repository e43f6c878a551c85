"""An OpenAI-compatible HTTP API and `/metrics`, beside the gRPC API on the same front end.

`POST /v1/completions`, `POST /v1/chat/completions` (where the tokenizer has a chat template),
`GET /v1/models`, server-sent events when `stream` is true, `GET /metrics` (Prometheus) and `GET /health`.
A request body becomes a `cascade.v1.GenerateRequest` message, handed to the same backend as it is
(no bytes in between within one process), through the same admission (keys, per-key limits, workers,
queue) and the same validation as a gRPC call, so a field is refused with the same message; the gRPC
status becomes the HTTP status of an OpenAI-style error body. Cascade knobs ride as extra body
fields: `verification` ({rule, alpha, beta, tune_beta}), `stop_threshold`, `seed`, `session_id`.
Replies carry `usage` and the cascade's stats as `cascade`. A client that disconnects cancels its
request at the next round (its KV caches are freed).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..core.limits import is_number
from ..metrics import CONTENT_TYPE, Metrics, default_metrics
from ..proto.v1 import cascade_pb2 as pb
from .admission import CallHooks, Refused
from .backend import Call, payload_message
from .choices import choice_requests
from .frontend_server import HttpOptions
from .openai_body import (
    COMMON,
    DISCONNECT_POLL_S,
    FINISH,
    HTTP_STATUS,
    NEUTRAL,
    HttpError,
    auth_metadata,
    chat_logprobs,
    choices_of,
    completion_id,
    completion_logprobs,
    error_response,
    json_body,
    param_of,
    plain,
    put_logit_bias,
    put_logprobs,
    put_prediction,
    put_prompt,
    put_response_format,
    put_speculation,
    put_verification,
    status_code,
    usage,
)
from .openai_stream import EventFormat, open_events

ChatTemplate = Callable[[list[dict[str, Any]]], str]


def http_options(port: int, model: str, tokenizer: Any, exposition: Callable[[], bytes] | None = None) -> HttpOptions:
    """The HTTP API on `port` (0 picks one) for a `transformers` tokenizer's model named `model`; chat
    where the tokenizer has a chat template. `exposition`: what `/metrics` serves (it may block; default:
    this process's metrics)."""
    chat = None
    if getattr(tokenizer, "chat_template", None):

        def chat(messages: list[dict[str, Any]]) -> str:
            return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    def count(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    return HttpOptions(port, lambda frontend: openai_app(frontend, model, count, default_metrics(), chat, exposition))


def openai_app(
    frontend: Any,  # api.frontend.Frontend, on this loop
    model: str,
    count_tokens: Callable[[str], int],
    metrics: Metrics,
    chat: ChatTemplate | None = None,
    exposition: Callable[[], bytes] | None = None,
) -> Starlette:
    """The HTTP app for `frontend`'s backend; `model` is the name /v1/models lists and requests name."""
    api = _Api(frontend, model, count_tokens, metrics, chat, exposition or metrics.exposition)
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
        self,
        frontend: Any,
        model: str,
        count: Callable[[str], int],
        metrics: Metrics,
        chat: ChatTemplate | None,
        exposition: Callable[[], bytes],
    ):
        self.frontend, self.model, self.count, self.metrics, self.chat = frontend, model, count, metrics, chat
        self.exposition = exposition

    async def models(self, request: Request) -> Response:
        try:
            with self.frontend.open_call(auth_metadata(request)):
                pass
        except Refused as refused:
            return error_response(HTTP_STATUS.get(refused.code.name, 500), refused.message)
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "cascade-service"}
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics_text(self, request: Request) -> Response:
        # Off the loop: the edge's gathers its deployments' over Ray handles.
        return Response(await asyncio.to_thread(self.exposition), media_type=CONTENT_TYPE)

    async def health(self, request: Request) -> Response:
        ok = self.frontend.serving and not self.frontend.stopping
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool) -> Response:
        try:
            body = await json_body(request, self.frontend.limits.max_message_bytes)
            message, prompt = self._request(body, chat)
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise HttpError(400, "stream must be true or false", "stream")
            n, _ = choices_of(body, chat, stream, message)
            with self.frontend.open_call(auth_metadata(request)) as owner:
                if not stream:
                    return await self._unary(request, message, prompt, chat, owner)
            # A stream holds its key's slot, and a worker per choice, while it runs: all taken in open_events.
            messages = [message] if n == 1 else choice_requests(message, n, rank=False)
            prompt_tokens = len(message.prompt_token_ids) or self.count(prompt)
            form = EventFormat(chat, self.model, message.HasField("logprobs"), prompt_tokens)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            opened = self.frontend.open_call(auth_metadata(request))
            first, events = await open_events(self.frontend, opened, messages, form, include_usage)
            return StreamingResponse(_prepend(first, events), media_type="text/event-stream")
        except Refused as refused:
            self.metrics.refused(refused.code.name)
            return error_response(HTTP_STATUS.get(refused.code.name, 500), refused.message, param_of(refused.message))
        except HttpError as error:
            self.metrics.refused(str(error.status))
            return error_response(error.status, error.message, error.param, error.code)

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
            text = put_prompt(body.get("prompt"), message)
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        for field, value, kind in (
            ("max_tokens", limit, int),
            ("temperature", body.get("temperature"), float),
            ("top_p", body.get("top_p"), float),
            ("top_k", body.get("top_k"), int),
            ("min_p", body.get("min_p"), float),
            ("presence_penalty", body.get("presence_penalty"), float),
            ("frequency_penalty", body.get("frequency_penalty"), float),
            ("repetition_penalty", body.get("repetition_penalty"), float),
            ("seed", body.get("seed"), int),
            ("stop_threshold", body.get("stop_threshold"), float),
        ):
            if value is None:
                continue
            if not is_number(value) or (kind is int and value != int(value)):
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
        put_verification(body.get("verification"), message)
        put_speculation(body.get("speculation"), message)
        put_logit_bias(body.get("logit_bias"), message)
        put_prediction(body.get("prediction"), message)
        put_logprobs(body, chat, message)
        put_response_format(body.get("response_format"), message)
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
        # n and best_of ride on the message: the coordinator decodes the candidates together (api.choices)
        reply = await self._one(request, message, owner)
        return JSONResponse(self._completion(list(reply.choices) or [reply], message, prompt, chat))

    async def _one(self, request: Request, message: pb.GenerateRequest, owner: str) -> pb.GenerateResponse:
        call = Call("Generate", message, owner, None, CallHooks())
        async with self.frontend.admitted(call.hooks):
            task = asyncio.ensure_future(self.frontend.run(call))
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    call.hooks.end()  # the decode stops at its next round and frees its KV caches
            code, details, payload = task.result()
        if code != "OK":
            raise Refused(status_code(code), details)
        return payload_message(pb.GenerateResponse, payload)

    def _completion(self, replies: list[Any], message: pb.GenerateRequest, prompt: str, chat: bool):
        """The OpenAI body of a reply's choices (pb.GenerateResponse, or its pb.Choice each)."""
        choices = []
        for index, reply in enumerate(replies):
            finish = FINISH.get(reply.finish_reason, reply.finish_reason)
            choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": None}
            if message.HasField("logprobs"):
                choice["logprobs"] = chat_logprobs(reply.logprobs) if chat else completion_logprobs(reply.logprobs)
            if chat:
                choice["message"] = {"role": "assistant", "content": reply.text}
            else:
                choice["text"] = reply.text
            choices.append(choice)
        prompt_tokens = len(message.prompt_token_ids) or self.count(prompt)
        first = replies[0]
        return {
            "id": completion_id(chat),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": usage(prompt_tokens, sum(len(r.token_ids) for r in replies), first.stats),
            "cascade": plain(first.stats) if len(replies) == 1 else [plain(r.stats) for r in replies],
        }


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for item in rest:
        yield item
