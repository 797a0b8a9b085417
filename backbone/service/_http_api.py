"""The OpenAI-compatible HTTP API: ``/v1/completions``, ``/v1/chat/completions`` (through the
checkpoint's chat template), ``/v1/models``, ``/health`` and ``/metrics`` (Prometheus: counters
only, no prompt or text, so open without the API key, as ``/health`` is); streaming as
server-sent events. A Starlette app served by Hypercorn's trio worker on a thread of its own, feeding
the same ``Engine`` as the gRPC service, so HTTP and gRPC requests share one batch.

The engine is thread-based; a request waits on it without a thread of its own: each
``RequestStream``'s listener (called on the engine's thread) schedules the set of a trio
Event on the server's loop, and the handler then drains the stream without blocking. A
client that goes away (mid-stream or while a whole answer is being made) cancels its engine
requests, which frees their slots at the engine's next step.

What a client sends is bounded before work is done on it: a connection that sends no request
head within the timeout (idle, or a head left unfinished) is closed; a body over the limit is
refused from its Content-Length, or once that much has arrived (413), and one not all there
within the timeout gets 408; a prompt over the backbone's ``max_prompt_bytes`` gets 400
before it is tokenized.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from backbone.engine._batch import InvalidRequest, Overloaded, Request, RequestStream, StreamEvent, Summary
from backbone.service._grpc_api import Backbone
from backbone.service._metrics import BackboneMetrics
from backbone.service._openai_shapes import (
    ApiError,
    ChatParams,
    CompletionParams,
    Prompt,
    chat_chunk,
    chat_object,
    chat_prompt_ids,
    completion_chunk,
    completion_object,
    error_for_event,
    error_for_invalid,
    finish_reason,
    parse_chat,
    parse_completion,
    usage,
)
from kvasir_rpc import METRICS_PATH, as_listen_error, check_listen, get_logger

log = get_logger("backbone.http")

__all__ = ["HTTP_TIMEOUT_S", "MAX_BODY_BYTES", "HttpServer", "make_app", "max_body_bytes", "serve_http"]

# The largest request body, unless the prompt limit needs more (max_body_bytes).
MAX_BODY_BYTES = 1 << 20
# JSON may spell a character of the prompt in up to this many times its UTF-8 bytes ("\u00e9").
_JSON_BYTES_PER_TEXT_BYTE = 4
# By default: a connection that sends no (complete) request head for this long is closed (an
# idle keep-alive one too), and a request whose body is not all there after it gets 408.
HTTP_TIMEOUT_S = 30.0
# How long close() lets running requests finish before it cancels them.
SHUTDOWN_GRACE_S = 2.0
START_TIMEOUT_S = 30.0


def _json(obj: object) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


class _JSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        return _json(content)


def _error_response(err: ApiError) -> Response:
    return _JSON(err.body(), status_code=err.status, headers=err.headers)


def _sse(obj: object) -> bytes:
    return b"data: " + _json(obj) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


# -- waiting on the engine from trio ---------------------------------------------------

_SHUTTING_DOWN = StreamEvent(error="the backbone is shutting down", error_kind="unavailable")


class _Watches:
    """The live _Watch objects of a server, so that a shutdown can end them."""

    def __init__(self) -> None:
        self.live: set[_Watch] = set()
        self.closing = False

    def close(self) -> None:
        """(On the loop.) Every watch ends with an "unavailable" error; new ones are refused."""
        self.closing = True
        for watch in list(self.live):
            watch.wake()


class _Watch:
    """The events of several RequestStreams on the trio loop, without a thread per stream:
    every stream's listener (on the engine's thread) asks the loop to set one Event."""

    def __init__(self, streams: Sequence[RequestStream], watches: _Watches) -> None:
        self.streams = list(streams)
        self._watches = watches
        self._token = trio.lowlevel.current_trio_token()
        self._ready = trio.Event()
        watches.live.add(self)
        for stream in self.streams:
            stream.add_listener(self._wake)

    def _wake(self) -> None:
        try:
            self._token.run_sync_soon(self.wake)
        except trio.RunFinishedError:  # the server stopped; cancel() already freed the slot
            pass

    def wake(self) -> None:
        """(On the loop.) Have events() look again."""
        self._ready.set()

    async def events(self) -> AsyncIterator[tuple[int, StreamEvent]]:
        """``(stream index, event)`` as they come, until every stream has had its last."""
        live = list(range(len(self.streams)))
        while live:
            if self._watches.closing:
                self.cancel()
                for i in live:
                    yield i, _SHUTTING_DOWN
                return
            # A fresh Event before looking: a wake from here on sets it.
            self._ready = trio.Event()
            got = False
            for i in list(live):
                while (event := self.streams[i].get(timeout=0)) is not None:
                    got = True
                    yield i, event
                    if event.last:
                        live.remove(i)
                        break
            if not got and live:
                await self._ready.wait()

    def cancel(self) -> None:
        """Free the slots of the streams not finished yet."""
        self._watches.live.discard(self)
        for stream in self.streams:
            stream.cancel()  # a no-op for a finished one


class _EventStream(StreamingResponse):
    """Server-sent events that cancel their engine requests however the response ends
    (finished, the client gone, the server stopping)."""

    def __init__(self, content: AsyncIterator[bytes], watch: _Watch) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._watch = watch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._watch.cancel()


async def _until_disconnect(request: HTTPRequest, scope: trio.CancelScope) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


# -- the app -------------------------------------------------------------------------

def max_body_bytes(max_prompt_bytes: int) -> int:
    """The largest request body: MAX_BODY_BYTES, or room for a prompt of ``max_prompt_bytes``
    however JSON spells it when that is more."""
    return max(MAX_BODY_BYTES, _JSON_BYTES_PER_TEXT_BYTE * max_prompt_bytes)


async def _body(request: HTTPRequest, *, limit: int, timeout_s: float) -> dict[str, Any]:
    """The JSON object of the body; ApiError 413 as soon as it is known to be over ``limit``
    bytes (from Content-Length, before reading it), 408 when it is not all there within
    ``timeout_s``."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        raise ApiError(400, f"send the body as JSON with Content-Type: application/json (got {ctype or 'none'!r})")
    too_large = ApiError(413, f"the body is larger than this server's limit of {limit} bytes; send a shorter "
                              f"prompt (the limit is {MAX_BODY_BYTES >> 20} MiB, or {_JSON_BYTES_PER_TEXT_BYTE} "
                              "times `python -m backbone serve --max-prompt-bytes` when that is more)",
                         code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    data = bytearray()
    try:
        with trio.move_on_after(timeout_s) as timer:
            async for chunk in request.stream():
                data += chunk
                if len(data) > limit:
                    raise too_large
    except ClientDisconnect:
        raise ApiError(499, "the client closed the connection before its body arrived", code="client_closed") from None
    if timer.cancelled_caught:
        raise ApiError(408, f"the body did not all arrive within {timeout_s:g} s (`python -m backbone serve "
                            "--http-timeout`)", code="timeout")
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


class _Api:
    """The routes, over one Backbone."""

    def __init__(self, backbone: Backbone, *, timeout_s: float) -> None:
        self.bb = backbone
        self.body_limit = max_body_bytes(backbone.max_prompt_bytes)
        self.timeout_s = timeout_s
        self.watches = _Watches()
        self.metrics = BackboneMetrics(backbone)

    def _authorize(self, request: HTTPRequest) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if not self.bb.key_presented(token.strip() if scheme.lower() == "bearer" else None):
            raise ApiError(401, "this backbone needs its API key: send 'Authorization: Bearer KEY' (the openai "
                                "package's api_key; KEY is in the file given to --api-key-file)",
                           code="invalid_api_key")

    def _model(self) -> dict[str, Any]:
        return {"id": self.bb.model_id, "object": "model", "created": self.bb.created, "owned_by": "kvasir"}

    async def models(self, request: HTTPRequest) -> Response:
        self._authorize(request)
        return _JSON({"object": "list", "data": [self._model()]})

    async def model(self, request: HTTPRequest) -> Response:
        self._authorize(request)
        try:
            self.bb.check_model(request.path_params["model"])
        except InvalidRequest as exc:
            raise error_for_invalid(exc) from None
        return _JSON(self._model())

    async def health(self, request: HTTPRequest) -> Response:
        running, waiting = self.bb.engine.load()
        return _JSON({"status": "ok", "running": running, "waiting": waiting})

    async def prometheus(self, request: HTTPRequest) -> Response:
        # Off the loop: a scrape takes the engine's and the dispatcher's locks.
        body = await trio.to_thread.run_sync(self.metrics.exposition)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    # -- generation ----------------------------------------------------------------------

    def _request(self, params: CompletionParams | ChatParams, prompt: str | None, ids: list[int] | None,
                 prompt_param: str) -> Request:
        max_tokens = params.max_tokens
        if max_tokens is None:  # chat without a limit: up to the context
            engine = self.bb.engine
            n = len(ids or ())
            max_tokens = max(1, min(engine.max_tokens_cap, engine.context_length - n))
        try:
            return self.bb.request(prompt=prompt, prompt_ids=ids, max_tokens=max_tokens, sampling=params.sampling,
                                   stop=params.stop, ignore_eos=params.ignore_eos)
        except InvalidRequest as exc:
            raise error_for_invalid(exc, prompt_param=prompt_param) from None

    def _check_bytes(self, field: str, texts: list[str]) -> None:
        try:
            self.bb.check_prompt_bytes(field, texts)
        except InvalidRequest as exc:
            raise error_for_invalid(exc) from None

    def _completion_requests(self, params: CompletionParams) -> list[Request]:
        # Every prompt's size before any is tokenized.
        prompts: list[Prompt] = params.prompts
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                self._check_bytes("prompt" if len(prompts) == 1 else f"prompt[{i}]", [p])
        return [self._request(params, p, None, "prompt") if isinstance(p, str) else
                self._request(params, None, p, "prompt") for p in prompts]

    def _chat_requests(self, params: ChatParams) -> list[Request]:
        self._check_bytes("messages", [m["content"] for m in params.messages])
        ids = chat_prompt_ids(self.bb.tokenizer, params.messages)
        return [self._request(params, None, ids, "messages")]

    def _submit(self, model: str, requests: list[Request]) -> _Watch:
        try:
            self.bb.check_model(model)
        except InvalidRequest as exc:
            raise error_for_invalid(exc) from None
        if self.watches.closing:
            raise error_for_event(_SHUTTING_DOWN)
        streams: list[RequestStream] = []
        try:
            for req in requests:
                streams.append(self.bb.engine.submit(req))
        except BaseException as exc:
            for stream in streams:
                stream.cancel()
            if isinstance(exc, Overloaded):
                raise ApiError(429, str(exc), type="rate_limit_error", code="rate_limit_exceeded",
                               headers={"Retry-After": "1"}) from None
            if isinstance(exc, InvalidRequest):
                raise error_for_invalid(exc) from None
            raise
        return _Watch(streams, self.watches)

    async def completions(self, request: HTTPRequest) -> Response:
        self._authorize(request)
        params = parse_completion(await _body(request, limit=self.body_limit, timeout_s=self.timeout_s))
        # Tokenizing is CPU work (up to the backbone's max_prompt_bytes of text a prompt): off the loop.
        requests = await trio.to_thread.run_sync(self._completion_requests, params)
        watch = self._submit(params.model, requests)
        ident, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.bb.model_id
        if params.stream:
            return _EventStream(self._completion_events(watch, params, ident, created), watch)
        texts, summaries = await _collect(request, watch)
        return _JSON(completion_object(ident, created, model, texts, summaries))

    async def chat(self, request: HTTPRequest) -> Response:
        self._authorize(request)
        params = parse_chat(await _body(request, limit=self.body_limit, timeout_s=self.timeout_s))
        requests = await trio.to_thread.run_sync(self._chat_requests, params)
        watch = self._submit(params.model, requests)
        ident, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.bb.model_id
        if params.stream:
            return _EventStream(self._chat_events(watch, params, ident, created), watch)
        texts, summaries = await _collect(request, watch)
        return _JSON(chat_object(ident, created, model, texts[0], summaries[0]))

    async def _completion_events(self, watch: _Watch, params: CompletionParams, ident: str,
                                 created: int) -> AsyncIterator[bytes]:
        model, with_usage = self.bb.model_id, params.include_usage
        summaries: list[Summary] = []
        async for i, event in watch.events():
            if event.error is not None:
                yield _sse(error_for_event(event).body())
                return
            finish = finish_reason(event.summary) if event.summary is not None else None
            if event.text or finish:
                yield _sse(completion_chunk(ident, created, model, i, event.text, finish, with_usage))
            if event.summary is not None:
                summaries.append(event.summary)
        if with_usage:
            yield _sse({"id": ident, "object": "text_completion", "created": created, "model": model,
                        "choices": [], "usage": usage(summaries)})
        yield _DONE

    async def _chat_events(self, watch: _Watch, params: ChatParams, ident: str, created: int) -> AsyncIterator[bytes]:
        model, with_usage = self.bb.model_id, params.include_usage
        chunk = functools.partial(chat_chunk, ident, created, model, with_usage=with_usage)
        yield _sse(chunk({"role": "assistant", "content": ""}, None))
        summaries: list[Summary] = []
        async for _i, event in watch.events():
            if event.error is not None:
                yield _sse(error_for_event(event).body())
                return
            if event.text:
                yield _sse(chunk({"content": event.text}, None))
            if event.summary is not None:
                yield _sse(chunk({}, finish_reason(event.summary)))
                summaries.append(event.summary)
        if with_usage:
            yield _sse({"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [], "usage": usage(summaries)})
        yield _DONE


async def _collect(request: HTTPRequest, watch: _Watch) -> tuple[list[str], list[Summary]]:
    """Every stream's whole text and summary; the engine requests are cancelled if the
    client goes away first (then the response goes nowhere)."""
    texts = [""] * len(watch.streams)
    summaries: list[Summary | None] = [None] * len(watch.streams)
    failed: StreamEvent | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_until_disconnect, request, nursery.cancel_scope)
            async for i, event in watch.events():
                if event.error is not None:
                    failed = event
                    break
                texts[i] += event.text
                summaries[i] = event.summary
            nursery.cancel_scope.cancel()
    finally:
        watch.cancel()
    if failed is not None:
        raise error_for_event(failed)
    done = [s for s in summaries if s is not None]
    if len(done) != len(summaries):  # the client went away
        raise ApiError(499, "the client closed the connection", code="client_closed")
    return texts, done


async def _api_error(request: HTTPRequest, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _error_response(exc)


async def _http_error(request: HTTPRequest, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err = ApiError(404, f"no route {request.method} {request.url.path}; this server has /v1/completions, "
                            "/v1/chat/completions, /v1/models, /health and /metrics", code="not_found")
    elif exc.status_code == 405:
        err = ApiError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
    else:
        err = ApiError(exc.status_code, str(exc.detail))
    return _error_response(err)


async def _server_error(request: HTTPRequest, exc: Exception) -> Response:
    log.error("an HTTP request failed", path=request.url.path, error=f"{type(exc).__name__}: {exc}")
    return _error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))


def make_app(backbone: Backbone, *, timeout_s: float = HTTP_TIMEOUT_S) -> Starlette:
    """The Starlette app of the API over ``backbone`` (a body must all arrive within
    ``timeout_s``). It waits on the engine with trio's primitives, so it runs under a trio
    server (``serve_http``)."""
    return _make_app(backbone, timeout_s)[0]


def _make_app(backbone: Backbone, timeout_s: float) -> tuple[Starlette, _Watches]:
    api = _Api(backbone, timeout_s=timeout_s)
    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route(METRICS_PATH, api.prometheus, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                                                       Exception: _server_error})
    return app, api.watches


# -- the server ----------------------------------------------------------------------

class HttpServer:
    """The API's Hypercorn server on its own thread; ``port`` is where it listens."""

    def __init__(self, port: int, thread: threading.Thread, token: trio.lowlevel.TrioToken,
                 stop: trio.Event, watches: _Watches) -> None:
        self.port = port
        self._thread, self._token, self._stop, self._watches = thread, token, stop, watches
        self._closed = False

    def close(self, timeout: float = SHUTDOWN_GRACE_S + 5.0) -> None:
        """Stop listening; running requests end at once with an "unavailable" error (an SSE
        error event, or HTTP 503) and free their engine slots; a response still being written
        after SHUTDOWN_GRACE_S is cut. Waits up to ``timeout`` for the server's thread.
        Idempotent."""
        if self._closed:
            return
        self._closed = True

        def shut() -> None:
            self._watches.close()
            self._stop.set()

        try:
            self._token.run_sync_soon(shut)
        except trio.RunFinishedError:
            pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the HTTP server did not stop in time", timeout=timeout)


def _port(bind: str) -> int:
    return int(bind.rsplit(":", 1)[1])


def serve_http(backbone: Backbone, address: str, *, timeout_s: float = HTTP_TIMEOUT_S) -> HttpServer:
    """Serve the API on ``address`` ("HOST:PORT", port 0 picks one) and return once it
    listens. A connection that sends no complete request head within ``timeout_s`` (idle
    between requests, or slow to finish one) is closed; a body not all there by then gets
    408. Raises ListenError when the address cannot be bound."""
    check_listen(address)
    config = Config()
    config.bind = [address]
    config.graceful_timeout = SHUTDOWN_GRACE_S
    # Hypercorn counts this from the connection's start, and again after each response, until
    # a request's head is complete: it bounds an idle connection and a head sent slowly alike.
    # (Its read_timeout would also cut a long response the client quietly reads.)
    config.keep_alive_timeout = timeout_s
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.include_server_header = False
    app, watches = _make_app(backbone, timeout_s)
    started: Future[tuple[int, trio.lowlevel.TrioToken, trio.Event]] = Future()

    async def main() -> None:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            # hypercorn types an ASGI app more narrowly than Starlette declares its __call__.
            serve_app = functools.partial(serve, app, config, shutdown_trigger=stop.wait,  # type: ignore[arg-type]
                                          mode="asgi")
            binds = await nursery.start(serve_app)
            started.set_result((_port(binds[0]), trio.lowlevel.current_trio_token(), stop))

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc)
            else:
                log.exception("the HTTP server failed")

    thread = threading.Thread(target=run, name="backbone-http", daemon=True)
    thread.start()
    try:
        port, token, stop = started.result(timeout=START_TIMEOUT_S)
    except TimeoutError:
        raise RuntimeError(f"the HTTP server did not start within {START_TIMEOUT_S:g} s") from None
    except Exception as exc:
        listen = as_listen_error(address, exc)
        if listen is not None:
            raise listen from None
        raise
    log.info("HTTP API listening", port=port)
    return HttpServer(port, thread, token, stop, watches)
