"""`trt-lookahead serve`: an OpenAI-compatible HTTP server over one LookaheadRuntime (FastAPI + uvicorn).

    POST /v1/completions, /v1/chat/completions   JSON, or server-sent events ending with `data: [DONE]`
    GET  /v1/models, /v1/models/{id}             the one served model
    GET  /health                                 200 once the model is loaded
    GET  /metrics                                Prometheus text (serving/metrics.py)

A request's body is read up to --max-body-bytes (413 beyond, 408 if it does not arrive within BODY_TIMEOUT_SECONDS;
such an answer is a LingeringAnswer, which drops the rest of the body before it closes), parsed
(openai_protocol.py), its model name and lookahead checked and its prompt tokenized here, off the event loop (a
thread: the loop never does work that grows with a request's size), then handed to the runtime's `astream`, which
checks every value and queues it on the scheduler (a full queue: 429 at once); the scheduler decodes up to
--max-batch requests in every step. The response starts only with the prefill's token, so every error up to then is
an HTTP error with OpenAI's error object; the server keeps serving. A client that disconnects (streaming or not)
closes its stream, which cancels the request at the next step and frees its slot. On SIGTERM / SIGINT new requests
get 503; running ones may finish within --shutdown-grace, and shortly before it ends every one still waiting is
answered 503 (a stream: an error event, then `data: [DONE]`) and cancelled. A connection whose request head has not
arrived whole HEAD_TIMEOUT_SECONDS after it opened (or after its last answer) is closed (HeadTimedH11), so idle or
trickling sockets cannot use up the process's file descriptors. docs/design.md section 7.6.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import secrets
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar, cast

import anyio
import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from trt_lookahead.errors import UserError
from trt_lookahead.lookahead.config import AUTO, Lookahead
from trt_lookahead.lookahead.decoder import length_error
from trt_lookahead.runtime import ChatTemplateError, GenerationOutput, LookaheadRuntime, PromptTooLong, StreamChunk
from trt_lookahead.runtime.scheduler import QueueFull
from trt_lookahead.serving import DEFAULT_MAX_BODY_BYTES, GRACEFUL_SHUTDOWN_SECONDS
from trt_lookahead.serving.metrics import RequestTrace, ServerMetrics
from trt_lookahead.serving.openai_protocol import (
    DONE,
    ApiError,
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    LookaheadOption,
    envelope,
    lookahead_report,
    parse_request,
    sse,
    usage,
)

HEAD_TIMEOUT_SECONDS = 10  # a request's head must arrive whole within this (the connection is closed otherwise)
BODY_TIMEOUT_SECONDS = 30  # a request body must arrive whole within this (408 otherwise): no upload is held forever
SHUTDOWN_MARGIN_SECONDS = 2  # waiting requests are answered this long before the grace ends (half a grace under 4 s)
SHUTTING_DOWN = "the server is shutting down; retry the request"
UNREAD_BODY = (408, 413)  # statuses answered before the body was read whole: a LingeringAnswer
ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's message when accept() fails for want of files
ACCEPT_WARNING_SECONDS = 60  # the server says it cannot accept connections at most this often
LINGER_SECONDS = 2  # how long the rest of such a body is read and dropped before the connection closes
LOOKAHEAD_NAMES = ("lookahead.window", "lookahead.ngram", "lookahead.verification")
CLIENT_CLOSED = 499  # the access log's status of a request whose client went away (nginx's convention)
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for a prompt + max_tokens past the context
log = logging.getLogger("uvicorn.error")
T = TypeVar("T")


@dataclass
class ApiCall:
    """One parsed request: the runtime's arguments, and what its response reports."""

    body: GenerationRequest
    prompt_ids: list[int]
    arguments: dict[str, Any]  # LookaheadRuntime.astream's keyword arguments
    seed: int


class OpenAIServer:
    """The routes over one runtime; `app()` is the ASGI application."""

    def __init__(self, runtime: LookaheadRuntime, *, model_name: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 shutdown_grace: int = GRACEFUL_SHUTDOWN_SECONDS, body_timeout: float = BODY_TIMEOUT_SECONDS) -> None:
        self.runtime = runtime
        self.name = model_name
        self.max_body_bytes = max_body_bytes
        self.shutdown_grace = shutdown_grace
        self.body_timeout = body_timeout
        self.closing = False  # shutdown began: new requests are answered 503
        self.aborted = asyncio.Event()  # the grace is nearly over: every waiting request ends with a 503
        self.served = runtime.lookahead.ceiling  # a request's ceiling: the default config (auto: its largest)
        self.chat_template = bool(getattr(runtime.tokenizer, "chat_template", None))
        self.created = int(time.time())
        scheduler = runtime.scheduler
        self.metrics = ServerMetrics(
            lambda: scheduler.waiting, lambda: runtime.max_batch - scheduler.free_slots,
            {"model": model_name, "backend": runtime.backend, "dtype": runtime.dtype,
             "weights": runtime.weights, "lookahead": self.label,
             "max_seq_len": str(runtime.max_seq_len), "max_batch": str(runtime.max_batch),
             "max_queue": str(scheduler.max_queue), "prefill": str(scheduler.prefill)},
        )

    def begin_shutdown(self) -> None:
        """(On the event loop, at SIGTERM / SIGINT.) New requests get 503 from now on; running ones may finish
        until shortly before uvicorn's grace ends, then every one still waiting ends with a 503 (a stream: an
        error event and [DONE]), its request cancelled, so that none is cut mid-response."""
        if self.closing:
            return
        self.closing = True
        margin = min(SHUTDOWN_MARGIN_SECONDS, self.shutdown_grace / 2)
        asyncio.get_running_loop().call_later(self.shutdown_grace - margin, self.aborted.set)

    @property
    def label(self) -> str:
        """The served lookahead: W/N/G, greedy, or auto up to W/N/G."""
        return f"{AUTO} (up to {self.served.label})" if self.runtime.lookahead.auto else self.served.label

    def app(self) -> FastAPI:
        app = FastAPI(title="trt-lookahead", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_api_route("/v1/completions", self.completions, methods=["POST"], response_model=None)
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"], response_model=None)
        app.add_api_route("/v1/models", self.models, methods=["GET"], response_model=None)
        app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"], response_model=None)
        app.add_api_route("/health", self.health, methods=["GET"], response_model=None)
        app.add_api_route("/metrics", self.prometheus, methods=["GET"], response_model=None)
        app.add_exception_handler(HTTPException, self._http_error)
        app.add_exception_handler(Exception, self._internal_error)
        return app

    # -- routes ---------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, ChatRequest)

    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, model_id: str) -> JSONResponse:
        if model_id != self.name:
            return _error_response(self._unknown_model(model_id))
        return JSONResponse(self._card())

    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def prometheus(self) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def _http_error(self, request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        paths = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, /health, /metrics"
        message = f"{request.method} {request.url.path}: {exc.detail}; this server has {paths}"
        return _error_response(ApiError(exc.status_code, message))

    async def _internal_error(self, request: Request, exc: Exception) -> JSONResponse:
        return _error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    # -- generation -----------------------------------------------------------------------------

    async def _generate(self, request: Request, kind: type[GenerationRequest]) -> Response:
        """Every request is counted once in requests_total, whatever its end: an answer, an error status, 499."""
        trace = self.metrics.trace(kind.ENDPOINT)
        try:
            return await self._respond(request, kind, trace)
        except ApiError as exc:
            trace.finish(exc.outcome)
            return _error_response(exc)
        except Disconnected:
            trace.finish("cancelled")
            return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:
            trace.finish("error")
            log.exception("request failed")
            return _error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    async def _respond(self, request: Request, kind: type[GenerationRequest], trace: RequestTrace) -> Response:
        if self.closing:
            raise ApiError(503, SHUTTING_DOWN, code="shutting_down")
        raw = await self._guard(self._read_body(request))
        job = await anyio.to_thread.run_sync(self._job, raw, kind)  # parsing and tokenizing: off the event loop
        chunks = self._run(job, trace)
        try:
            first = await self._guard(anext(chunks), request.receive)
        except BaseException:
            await chunks.aclose()  # a generator cancelled before it started: nothing was queued
            raise
        rid, created = f"{job.body.ID_PREFIX}{uuid.uuid4().hex}", int(time.time())
        if job.body.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(self._events(job, chunks, first, rid, created), media_type="text/event-stream",
                                     headers=headers)
        try:
            output = await self._guard(_final_output(chunks, first), request.receive)
        except (ApiError, Disconnected):
            raise
        except Exception as exc:
            log.exception("request %s failed", rid)
            raise ApiError(500, f"generation failed: {type(exc).__name__}: {exc}") from None
        body = job.body
        return JSONResponse(envelope(body, rid, created, False, [body.choice(output.text, output.finish_reason)],
                                     usage=usage(output), lookahead=lookahead_report(output, job.seed)))

    async def _read_body(self, request: Request) -> bytes:
        """The request body: refused by its Content-Length, or while reading once it passes max_body_bytes (413);
        408 if it is not whole within `body_timeout` seconds; Disconnected if the client leaves mid-upload."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and (len(declared) > 18 or int(declared) > self.max_body_bytes):
            raise self._too_large(f"{declared} bytes")
        parts: list[bytes] = []
        size = 0
        try:
            with anyio.fail_after(self.body_timeout):
                async for part in request.stream():
                    size += len(part)
                    if size > self.max_body_bytes:
                        raise self._too_large(f"over {self.max_body_bytes} bytes")
                    parts.append(part)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.body_timeout:g} s; send it whole",
                           code="request_timeout") from None
        except ClientDisconnect:
            raise Disconnected from None
        return b"".join(parts)

    def _too_large(self, size: str) -> ApiError:
        return ApiError(413, f"the request body is {size}; this server takes at most {self.max_body_bytes} bytes "
                        "(serve --max-body-bytes)", code="body_too_large")

    async def _guard(self, work: Awaitable[T], receive: Receive | None = None) -> T:
        """`work`'s result; Disconnected if the client leaves first (given `receive`), ApiError(503) if the
        shutdown grace is nearly over first; `work` is then cancelled (a request's stream: its request too)."""
        result = await first_of(work, receive, self.aborted)
        if result is DISCONNECTED:
            raise Disconnected
        if result is ABORTED:
            raise ApiError(503, SHUTTING_DOWN, code="shutting_down")
        return cast(T, result)

    def _job(self, raw: bytes, kind: type[GenerationRequest]) -> ApiCall:
        """The body parsed, the model name and the lookahead extension checked here, the prompt tokenized;
        every value by the runtime (in astream). Runs in a thread: its work grows with the body."""
        body = parse_request(raw, kind)
        if body.model != self.name:
            raise self._unknown_model(body.model)
        if isinstance(body, ChatRequest) and not self.chat_template:
            raise ApiError(400, f"the model {self.name!r} has no chat template; send a text prompt to /v1/completions",
                           param="messages")
        lookahead = self._lookahead(body.lookahead)
        seed = secrets.randbits(32) if body.seed is None else body.seed  # reported, so any answer can be replayed
        try:
            prompt_ids = self.runtime.encode(body.runtime_prompt())
        except ChatTemplateError as exc:  # its message names the model's path: a client sees the model's name
            raise ApiError(400, f"the chat template of the model {self.name!r} cannot render these messages "
                           f"({exc.reason})", param="messages") from None
        except PromptTooLong as exc:  # by its size, before tokenizing
            raise ApiError(400, str(exc), param=body.PROMPT_PARAM, code=CONTEXT_LENGTH_EXCEEDED) from None
        except ValueError as exc:  # UserError: a prompt the tokenizer cannot take
            raise ApiError(400, str(exc), param=body.PROMPT_PARAM) from None
        context = self.runtime.max_seq_len
        asked = body.requested_tokens(context - len(prompt_ids))
        problem = length_error(len(prompt_ids), asked, context, tokens=body.tokens_param, context="max_model_len",
                               grow="")
        if problem is not None:
            raise ApiError(400, problem.message, param=body.param(problem.culprit),
                           code=None if asked < 1 else CONTEXT_LENGTH_EXCEEDED)
        arguments = dict(max_new_tokens=asked, lookahead=lookahead, seed=seed,
                         stop=list(body.stop), pool_scope=body.pool_scope, **body.sampling())
        return ApiCall(body, prompt_ids, arguments, seed)

    def _lookahead(self, option: LookaheadOption | bool | None) -> Lookahead:
        """The body's `lookahead` extension as a choice: false greedy, absent or true the served default, an object
        a fixed config, its omitted values the served config's."""
        if option is False:
            return Lookahead.greedy()
        if option is None or option is True:
            return self.runtime.lookahead
        try:
            return Lookahead.from_parts((option.window, option.ngram, option.verification), self.served,
                                        LOOKAHEAD_NAMES)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="lookahead") from None

    async def _run(self, job: ApiCall, trace: RequestTrace) -> AsyncGenerator[StreamChunk, None]:
        """The runtime's chunks for `job`; errors before the first chunk are ApiErrors (the handler counts them).

        Closing this generator (a client that went away) closes the runtime's stream: the request is
        cancelled at the next step and its slot freed."""
        started, outcome = False, "cancelled"
        try:
            stream = cast(AsyncGenerator[StreamChunk, None], self.runtime.astream(job.prompt_ids, **job.arguments))
            async with contextlib.aclosing(stream) as chunks:  # an async generator: aclose() cancels the request
                async for chunk in chunks:
                    if not started:
                        started = True
                        trace.started(len(job.prompt_ids))
                    trace.chunk(chunk)
                    if chunk.output is not None:
                        outcome = chunk.output.finish_reason
                    yield chunk
        except QueueFull as exc:
            raise ApiError(429, str(exc), code="queue_full") from None
        except Exception as exc:
            if started:
                outcome = "error"
                raise
            if isinstance(exc, ValueError):  # UserError: the runtime's checks of the request
                raise ApiError(400, str(exc), param=job.body.param(getattr(exc, "field", None))) from None
            log.exception("request failed before its first token")
            raise ApiError(500, f"generation failed: {type(exc).__name__}: {exc}") from None
        finally:
            if started:
                trace.finish(outcome)

    async def _events(self, job: ApiCall, chunks: AsyncGenerator[StreamChunk, None], first: StreamChunk, rid: str,
                      created: int) -> AsyncIterator[str]:
        """The SSE body: a chunk per block with text, the last with finish_reason (and usage if asked), [DONE]."""
        body = job.body
        usage_field: dict[str, Any] = {"usage": None} if body.include_usage else {}

        def event(choices: list[dict[str, Any]], **extra: Any) -> str:
            return sse(envelope(body, rid, created, True, choices, **{**usage_field, **extra}))

        async with contextlib.aclosing(chunks):
            for choice in body.opening():
                yield event([choice])
            chunk = first
            try:
                while not chunk.done:
                    if chunk.text:
                        yield event([body.delta(chunk.text, None)])
                    # racing the abort costs two tasks a chunk: only once shutdown began (a running stream's
                    # next chunk comes a step later, so its wait then races it)
                    chunk = await (self._guard(anext(chunks)) if self.closing else anext(chunks))
            except ApiError as exc:  # shutdown: the request is cancelled, the client told to retry
                yield sse(exc.body())
                yield DONE
                return
            except Exception as exc:  # the response has started: an error event ends it
                log.exception("request %s failed while streaming", rid)
                yield sse(ApiError(500, f"generation failed: {type(exc).__name__}: {exc}").body())
                yield DONE
                return
            output = chunk.output
            assert output is not None  # the last chunk carries the output
            yield event([body.delta(chunk.text, output.finish_reason)], lookahead=lookahead_report(output, job.seed))
            if body.include_usage:
                yield event([], usage=usage(output))
            yield DONE

    def _card(self) -> dict[str, Any]:
        s = self.served
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "trt-lookahead",
                "max_model_len": self.runtime.max_seq_len,
                "lookahead": {"window": s.W, "ngram": s.N, "verification": s.G, "auto": self.runtime.lookahead.auto}}

    def _unknown_model(self, name: str) -> ApiError:
        return ApiError(404, f"the model {name!r} does not exist on this server; it serves {self.name!r} "
                        "(GET /v1/models)", param="model", code="model_not_found")


async def _final_output(chunks: AsyncGenerator[StreamChunk, None], chunk: StreamChunk) -> GenerationOutput:
    async with contextlib.aclosing(chunks):
        while not chunk.done:
            chunk = await anext(chunks)
    assert chunk.output is not None  # the last chunk carries the output
    return chunk.output


class Disconnected(Exception):
    """The client went away (mid-upload, or while its request waited): answered 499 in the access log."""


DISCONNECTED, ABORTED = object(), object()  # what `first_of` returns when `work` lost


async def first_of(work: Awaitable[T], receive: Receive | None, abort: asyncio.Event) -> T | object:
    """The result of `work`, or DISCONNECTED if the client disconnects first (`receive` given), or ABORTED if
    `abort` is set first; `work` is then cancelled."""
    if abort.is_set():
        getattr(work, "close", lambda: None)()  # never started
        return ABORTED
    results: list[T | object] = []
    failures: list[Exception] = []
    async with anyio.create_task_group() as group:

        async def run() -> None:
            try:
                results.append(await work)
            except Exception as exc:  # re-raised below, not as an ExceptionGroup
                failures.append(exc)
            group.cancel_scope.cancel()

        async def watch() -> None:
            while receive is not None and (await receive())["type"] != "http.disconnect":
                pass
            if receive is not None:
                results.append(DISCONNECTED)
                group.cancel_scope.cancel()

        async def stop() -> None:
            await abort.wait()
            results.append(ABORTED)
            group.cancel_scope.cancel()

        group.start_soon(run)
        group.start_soon(watch)
        group.start_soon(stop)
    if failures:
        raise failures[0]
    return results[0]


def _error_response(error: ApiError) -> JSONResponse:
    if error.status in UNREAD_BODY:
        return LingeringAnswer(error.body(), status_code=error.status, headers={"Connection": "close"})
    headers = {"Retry-After": "1"} if error.status == 429 else {}
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


class LingeringAnswer(JSONResponse):
    """An answer given before the request body was read whole (UNREAD_BODY); the connection ends with it.

    Closing a socket whose input is unread makes the kernel reset the connection, and a reset can discard the
    answer before the client reads it: the client, still uploading, sees only "connection reset". So the answer
    is sent whole (its Content-Length tells the client where it ends), the rest of the upload is read and dropped
    until it ends, the client leaves, or LINGER_SECONDS pass (nginx's lingering close), and only then does the
    response end, which closes the connection (Connection: close)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": True})
        with anyio.move_on_after(LINGER_SECONDS):
            while (message := await receive())["type"] == "http.request" and message.get("more_body", False):
                pass
        await send({"type": "http.response.body", "body": b""})


# -- running it -------------------------------------------------------------------------------------


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on (host, port), opened before the model loads so that a taken port fails at once."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port} is not a TCP port; give 0 (any free port) to 65535")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another --port or --host") \
            from None
    return sock


class HeadTimedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose next request head is not whole HEAD_TIMEOUT_SECONDS
    after the connection opened or its last answer ended. uvicorn alone keeps a connection that sends nothing, or
    its head a byte at a time, open forever (its keep-alive timer restarts on every byte); a few hundred of them use
    up the process's file descriptors, and then no one can connect (slowloris). A client is not answered here: it
    has not sent a request."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is whole (a body may follow: BODY_TIMEOUT_SECONDS)
            self._stop_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # a pipelined request already received is parsed here
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._stop_head_timer()

    def _awaiting_head(self) -> bool:
        return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

    def _await_head(self) -> None:
        self._stop_head_timer()
        if self._awaiting_head():
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_SECONDS, self._head_late)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self._awaiting_head():
            self.transport.close()


def allow_many_connections() -> None:
    """Raise this process's soft limit on open files to its hard limit: every connection holds one, and many
    systems start processes at 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):  # macOS refuses an unlimited hard limit: keep the soft one
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class _Server(uvicorn.Server):
    """uvicorn's server, telling the API the moment shutdown begins (its signal handler runs in the main thread,
    between the event loop's steps: the API is called on the loop), and saying once a minute, not thousands of
    times a second, that it cannot accept connections (asyncio reports a failed accept once per backlog slot, with
    a traceback, every second it retries)."""

    def __init__(self, config: uvicorn.Config, api: OpenAIServer) -> None:
        super().__init__(config)
        self.api = api
        self.loop: asyncio.AbstractEventLoop | None = None
        self.accept_warned = -float(ACCEPT_WARNING_SECONDS)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop.set_exception_handler(self.loop_error)
        await super().startup(sockets)

    def loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_FAILED:
            loop.default_exception_handler(context)
        elif (now := time.monotonic()) - self.accept_warned >= ACCEPT_WARNING_SECONDS:
            self.accept_warned = now
            limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            log.warning("cannot accept new connections (%s; this process may open %d files); they wait until "
                        "others close. Raise the limit (ulimit -n) or put a proxy in front", context.get("exception"),
                        limit)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.api.begin_shutdown)


def serve(runtime: LookaheadRuntime, sock: socket.socket, *, model_name: str, log_level: str = "info",
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, shutdown_grace: int = GRACEFUL_SHUTDOWN_SECONDS) -> None:
    """Serve until SIGINT or SIGTERM, then let running requests finish for `shutdown_grace` seconds at most."""
    api = OpenAIServer(runtime, model_name=model_name, max_body_bytes=max_body_bytes, shutdown_grace=shutdown_grace)
    server = _Server(uvicorn.Config(api.app(), log_level=log_level, timeout_graceful_shutdown=shutdown_grace,
                                    http=HeadTimedH11), api)
    allow_many_connections()
    host, port = sock.getsockname()[:2]
    weights = "" if runtime.weights == "float" else f"{runtime.weights} weights, "
    print(
        f"trt-lookahead serve: {model_name} ({runtime.backend}, {runtime.dtype}, {weights}lookahead {api.label}, "
        f"max_seq_len {runtime.max_seq_len}, max_batch {runtime.max_batch}, max_queue {runtime.scheduler.max_queue}, "
        f"prefill {runtime.scheduler.prefill}) on "
        f"http://{host}:{port}/v1 (POST /v1/completions, /v1/chat/completions; GET /v1/models, /health, /metrics); "
        "Ctrl-C stops it", file=sys.stderr, flush=True,
    )
    # uvicorn re-raises the signal it shut down on once it is done; that signal has been handled: ignore it
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
