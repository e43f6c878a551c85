"""Server-sent events for the OpenAI front end: one `GenerateStream` per choice (`n`), merged into one
event stream.

Each choice is a request of its own (its seed the request's + index, as unary `n` has it), admitted and
decoded like any stream, so the choices meet in the engine's batches and share the prompt's prefix
cache. The response opens only once every choice has its first chunk, so a refusal of any choice is an
HTTP status, not a 200 with an error event; after that, chunks go out as they arrive, each with its
choice's `index`, and an error mid-stream is an error event that ends them all. A client that
disconnects ends every choice's decode at its next round.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from ..proto.v1 import cascade_pb2 as pb
from .admission import CallHooks, Refused
from .backend import Call, payload_message
from .openai_body import (
    FINISH,
    HTTP_STATUS,
    chat_logprobs,
    completion_id,
    completion_logprobs,
    error_body,
    plain,
    status_code,
    usage,
)


@dataclass
class _Choice:
    """One choice's stream: its admission, its replies, and where its completions text offset stands."""

    index: int
    call: CallHooks
    admitted: AbstractAsyncContextManager[None]
    replies: Any = None  # the frontend's async iterator of (code, details, payload)
    offset: int = 0  # the text offset of its next token's logprob (completions)
    last: pb.GenerateStats = field(default_factory=pb.GenerateStats)

    async def next(self) -> pb.GenerateChunk | None:
        try:
            code, details, payload = await anext(self.replies)
        except StopAsyncIteration:
            return None
        if code != "OK":
            raise Refused(status_code(code), details)
        return payload_message(pb.GenerateChunk, payload)

    async def close(self) -> None:
        self.call.end()
        try:
            if self.replies is not None:
                await self.replies.aclose()
        finally:
            await self.admitted.__aexit__(None, None, None)


@dataclass
class EventFormat:
    """How a chunk becomes an event: the completion's id, kind and model, and whether it carries logprobs."""

    chat: bool
    model: str
    logprobs: bool
    prompt_tokens: int
    ident: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.ident, self.created = completion_id(self.chat), int(time.time())

    def event(self, choice: _Choice, chunk: pb.GenerateChunk, first: bool) -> bytes:
        finish = FINISH.get(chunk.finish_reason, chunk.finish_reason) or None
        body: dict[str, Any] = {"index": choice.index, "finish_reason": finish, "logprobs": None}
        if self.chat:
            body["delta"] = {"content": chunk.text} | ({"role": "assistant"} if first else {})
        else:
            body["text"] = chunk.text
        if self.logprobs:
            body["logprobs"] = (
                chat_logprobs(chunk.logprobs) if self.chat else completion_logprobs(chunk.logprobs, choice.offset)
            )
            choice.offset += sum(len(t.text) for t in chunk.logprobs)
        # The chunk's token count rides in `cascade` (with the stats on the last chunk): clients that time
        # tokens (bench load --protocols) need it, and OpenAI clients ignore it.
        stats = plain(chunk.stats) if chunk.HasField("stats") else {}
        if chunk.HasField("stats"):
            choice.last = chunk.stats
        return self._data({"choices": [body], "cascade": {"tokens": len(chunk.token_ids)} | stats})

    def usage(self, generated: int, stats: pb.GenerateStats) -> bytes:
        return self._data({"choices": [], "usage": usage(self.prompt_tokens, generated, stats)})

    def _data(self, data: dict[str, Any]) -> bytes:
        head = {"id": self.ident, "object": "chat.completion.chunk" if self.chat else "text_completion"}
        return b"data: " + json.dumps(head | {"created": self.created, "model": self.model} | data).encode() + b"\n\n"


async def open_events(
    frontend: Any,  # api.frontend.Frontend
    opened: AbstractContextManager[str],  # frontend.open_call(...): the key's slot, held throughout
    messages: list[pb.GenerateRequest],
    form: EventFormat,
    include_usage: bool,
) -> tuple[bytes, AsyncIterator[bytes]]:
    """The opening events (every choice's first chunk) and the rest, for `messages` (one per choice)."""
    owner = opened.__enter__()
    choices: list[_Choice] = []

    async def start(index: int, message: pb.GenerateRequest) -> pb.GenerateChunk | None:
        call = CallHooks()
        choice = _Choice(index, call, frontend.admitted(call))
        await choice.admitted.__aenter__()
        choices.append(choice)
        choice.replies = aiter(frontend.replies(Call("GenerateStream", message, owner, None, call)))
        return await choice.next()

    async def close_all() -> None:
        try:
            for choice in choices:
                await choice.close()
        finally:
            opened.__exit__(None, None, None)

    # Together: a choice waiting for a worker must not hold up the others (their decodes free workers).
    firsts = await asyncio.gather(*(start(i, m) for i, m in enumerate(messages)), return_exceptions=True)
    failed = next((f for f in firsts if isinstance(f, BaseException)), None)
    if failed is not None or any(f is None for f in firsts):
        await close_all()
        if failed is not None:
            raise failed
        raise Refused(status_code("INTERNAL"), "the stream ended without a reply")
    chunks = [first for first in firsts if isinstance(first, pb.GenerateChunk)]
    choices.sort(key=lambda choice: choice.index)
    opening = b"".join(form.event(choice, first, True) for choice, first in zip(choices, chunks, strict=True))
    generated = sum(len(first.token_ids) for first in chunks)
    return opening, _rest(choices, form, include_usage, generated, close_all)


async def _rest(
    choices: list[_Choice],
    form: EventFormat,
    include_usage: bool,
    generated: int,
    close_all: Callable[[], Any],
) -> AsyncIterator[bytes]:
    queue: asyncio.Queue[tuple[_Choice, pb.GenerateChunk | Refused | None]] = asyncio.Queue()

    async def pump(choice: _Choice) -> None:
        while True:
            try:
                chunk = await choice.next()
            except Refused as refused:
                await queue.put((choice, refused))
                return
            await queue.put((choice, chunk))
            if chunk is None:
                return

    pumps = [asyncio.ensure_future(pump(choice)) for choice in choices]
    running = len(choices)
    try:
        while running:
            choice, item = await queue.get()
            if isinstance(item, Refused):  # mid-stream: the status can only go in an event
                error = error_body(HTTP_STATUS.get(item.code.name, 500), item.message)
                yield b"data: " + json.dumps(error).encode() + b"\n\n"
                return
            if item is None:
                running -= 1
                continue
            generated += len(item.token_ids)
            yield form.event(choice, item, False)
        if include_usage:
            yield form.usage(generated, choices[0].last)
        yield b"data: [DONE]\n\n"
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await close_all()  # also when the client disconnects: the decodes stop, their caches go
