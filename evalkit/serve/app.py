"""The HTTP layer: OpenAI's `/v1/completions`, `/v1/chat/completions` (both streaming with server-sent
events), `/v1/models`, and `/health`, `/metrics`. A request is parsed and checked (`Service`) before it takes
a place in the queue; its choices' tokens come back from the engine as they are produced; a client that goes
away (a closed stream, or a closed connection while it waits) cancels its choices, whose rows the engine
releases at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from evalkit.serve import metrics
from evalkit.serve.backend import End, Token
from evalkit.serve.schema import ApiError, ChatBody, CompletionBody, parse
from evalkit.serve.service import Prepared, Service
from evalkit.serve.text import Text, chat_logprobs, completion_logprobs

PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class Shape:
    """How one endpoint's bodies and answers look; the flow is shared (`Generation`)."""

    body: type
    object: str
    chunk_object: str
    prefix: str

    def prepare(self, service: Service, body) -> Prepared:
        raise NotImplementedError

    def choice(self, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        """A choice of the whole answer."""
        raise NotImplementedError

    def chunk(self, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        """A choice's piece in a stream."""
        return self.choice(index, text, logprobs, finish)

    def opening(self, index: int) -> dict | None:
        """What a stream sends for a choice before its first piece, if anything."""
        return None

    def logprobs(self, text: Text, tokens: list[Token], offset: int) -> dict:
        raise NotImplementedError


class Completions(Shape):
    body, object, chunk_object, prefix = CompletionBody, "text_completion", "text_completion", "cmpl"

    def prepare(self, service, body):
        return service.completion(body)

    def choice(self, index, text, logprobs, finish):
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def logprobs(self, text, tokens, offset):
        return completion_logprobs(text, tokens, offset)


class Chat(Shape):
    body, object, chunk_object, prefix = ChatBody, "chat.completion", "chat.completion.chunk", "chatcmpl"

    def prepare(self, service, body):
        return service.chat(body)

    def choice(self, index, text, logprobs, finish):
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def chunk(self, index, text, logprobs, finish):
        delta = {"content": text} if text else {}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def opening(self, index):  # the role first, as OpenAI streams it
        delta = {"role": "assistant", "content": ""}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}

    def logprobs(self, text, tokens, offset):
        return chat_logprobs(text, tokens)


class Generation:
    """One generation request after its checks: its ticket's events gathered into one answer, or streamed."""

    def __init__(self, service: Service, shape: Shape, body, prepared: Prepared, ticket):
        self.service, self.shape, self.body = service, shape, body
        self.prepared, self.ticket = prepared, ticket
        self.texts = [Text(service.tokenizer, prepared.stops) for _ in prepared.works]
        self.id, self.created = f"{shape.prefix}-{uuid.uuid4().hex}", int(time.time())
        self.want_logprobs = prepared.works[0].logprobs is not None

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.service.card.id}

    def usage(self) -> dict:
        tokens = sum(len(t.tokens) for t in self.texts)
        return self.service.usage(self.prepared, [t.end for t in self.texts], tokens)

    @staticmethod
    def _ended_by_server(end: End) -> ApiError | None:
        """A choice the server ended: its engine failed, or it shut down first (a client's own cancel is never
        answered)."""
        if end.reason == "error":
            return ApiError(500, end.message, None, "engine_failed")
        if end.reason == "cancelled":
            return ApiError(503, "the server shut down before this request finished", None, "shutting_down")
        return None

    async def answer(self) -> dict:
        try:
            async for index, event in self.ticket:
                self.texts[index].add(event)
        finally:
            self._release()
        for t in self.texts:
            if (error := self._ended_by_server(t.end)) is not None:
                raise error
        choices = [
            self.shape.choice(
                i,
                t.final(),
                self.shape.logprobs(t, t.tokens, 0) if self.want_logprobs else None,
                t.end.reason,
            )
            for i, t in enumerate(self.texts)
        ]
        return {**self.head(self.shape.object), "choices": choices, "usage": self.usage()}

    async def stream(self) -> AsyncIterator[str]:
        """Server-sent events: a chunk whenever a choice has text to send (and its tokens' logprobs), its
        finish reason last; then the usage (stream_options.include_usage) and `[DONE]`."""
        pending: list[list[Token]] = [[] for _ in self.texts]
        head = self.head(self.shape.chunk_object)
        try:
            for i in range(len(self.texts)):
                if (opening := self.shape.opening(i)) is not None:
                    yield _event({**head, "choices": [opening]})
            async for index, event in self.ticket:
                text = self.texts[index]
                piece = text.add(event)
                if isinstance(event, Token):
                    pending[index].append(event)
                    if not piece:
                        continue  # held back: its logprobs go with the next piece
                elif (error := self._ended_by_server(event)) is not None:
                    yield _event(error.body())
                    break
                lp = None
                if self.want_logprobs:
                    lp = self.shape.logprobs(text, pending[index], text.sent - len(piece))
                pending[index] = []
                finish = event.reason if isinstance(event, End) else None
                yield _event({**head, "choices": [self.shape.chunk(index, piece, lp, finish)]})
                await asyncio.sleep(0)  # let a lost connection be noticed before the next write
            else:
                if (self.body.stream_options or {}).get("include_usage"):
                    yield _event({**head, "choices": [], "usage": self.usage()})
            yield "data: [DONE]\n\n"
        finally:
            self._release()

    def _release(self) -> None:
        """Choices not ended yet (the client went away, the server is stopping): cancelled, rows freed."""
        if any(t.end is None for t in self.texts):
            self.service.backend.cancel(self.ticket)


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _until_gone(request: Request) -> None:
    """Returns when the client disconnects (the request's body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _answer_or_gone(request: Request, generation: Generation) -> dict | None:
    """The answer, or None when the client went away first (its choices are cancelled)."""
    answer = asyncio.ensure_future(generation.answer())
    gone = asyncio.ensure_future(_until_gone(request))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        return answer.result() if answer.done() else None
    finally:
        for task in (answer, gone):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await answer  # its `finally` cancels the ticket


class Counting:
    """ASGI middleware counting the answers by path and status (`evalkit_requests_total`)."""

    def __init__(self, app, counts: Counter):
        self.app, self.counts = app, counts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in PATHS else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.counts[(path, message["status"])] += 1
            await send(message)

        await self.app(scope, receive, counted)


def make_app(service: Service) -> FastAPI:
    """The server's ASGI app. Its lifespan starts the engine loop, and stops it once the HTTP side has
    stopped (uvicorn's graceful shutdown let in-flight requests finish, or cancelled them): whatever is
    still queued then has nobody waiting for it and is cancelled."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.backend.start()
        yield
        service.draining = True
        await asyncio.to_thread(service.backend.close, 0.0)

    app = FastAPI(title="evalkit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    counts: Counter = Counter()
    app.state.counts = counts
    app.add_middleware(Counting, counts=counts)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown path, wrong method: OpenAI's shape
        error = ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}")
        return JSONResponse(error.body(), e.status_code)

    async def generate(shape: Shape, request: Request):
        body = parse(shape.body, await request.body())
        prepared = shape.prepare(service, body)
        generation = Generation(service, shape, body, prepared, service.submit(prepared))
        if body.stream:
            return StreamingResponse(generation.stream(), media_type="text/event-stream")
        answer = await _answer_or_gone(request, generation)
        return JSONResponse(answer) if answer is not None else JSONResponse({}, status_code=499)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(Completions(), request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(Chat(), request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [service.card.entry(service.backend.stats())]}

    @app.get("/health")
    async def health():
        status, body = service.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def prometheus():
        text = metrics.render(service.card, service.backend.stats(), counts)
        return PlainTextResponse(text, media_type=metrics.CONTENT_TYPE)

    return app
