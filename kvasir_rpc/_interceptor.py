"""NeverUnknown: the server interceptor every Kvasir gRPC server runs, so that an exception a
handler lets out never reaches the caller as UNKNOWN (grpcio's answer to any exception, with
the exception's text as details) but as the status that says what to do:

* ``context.abort(...)``, or a code the handler set: that status, untouched;
* ``MemoryError``, torch's out-of-memory error: RESOURCE_EXHAUSTED (retry later, or smaller);
* ``sqlite3.OperationalError`` saying locked or busy: UNAVAILABLE (retry);
* ``TimeoutError``: DEADLINE_EXCEEDED when the call's own deadline has passed, otherwise
  UNAVAILABLE (a wait inside the server ran out; retry);
* ``NotImplementedError``: UNIMPLEMENTED;
* anything else: INTERNAL (the server logged it; tell its operator).

The details name the method, the exception's type and a short text (never the request's
bytes), at most ``MAX_DETAILS`` characters. Each mapped exception is logged once, with its
traceback (a busy database, which is no fault, without). A handler's ``context.abort`` passes
untouched: grpcio raises a bare Exception after setting the code, which is seen here as a
code already set. So does the RpcError a request stream raises once the caller went away
(cancelled, deadline passed): there is no one to answer, and nothing to log.

When no exception is raised the cost is one try block per call, and for a streaming answer a
generator in between (``yield from``) per message.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from kvasir_rpc._log import get_logger

__all__ = ["MAX_DETAILS", "NeverUnknown"]

log = get_logger("kvasir_rpc.interceptor")

# The longest details string sent, and the longest part of it taken from the exception's text.
MAX_DETAILS = 300
_TEXT_CHARS = 120
# Attributes grpcio reads on a handler's behaviour, kept on the wrapper.
_BEHAVIOR_ATTRS = ("experimental_non_blocking", "experimental_thread_pool")


class NeverUnknown(grpc.ServerInterceptor):
    """Maps what a handler lets out to a status other than UNKNOWN (see the module docstring).
    Put it first in a server's ``interceptors``, so that it also sees what the others raise."""

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return _replace(handler, unary_unary=_call(method, handler.unary_unary))
        if handler.stream_unary is not None:
            return _replace(handler, stream_unary=_call(method, handler.stream_unary))
        if handler.unary_stream is not None:
            return _replace(handler, unary_stream=_stream(method, handler.unary_stream))
        if handler.stream_stream is not None:
            return _replace(handler, stream_stream=_stream(method, handler.stream_stream))
        return handler


def _replace(handler: Any, **behavior: Callable[..., Any]) -> Any:
    """``handler`` with its behaviour wrapped: grpcio's handlers are named tuples."""
    if hasattr(handler, "_replace"):
        return handler._replace(**behavior)
    (field, wrapped), = behavior.items()
    make = {"unary_unary": grpc.unary_unary_rpc_method_handler,
            "unary_stream": grpc.unary_stream_rpc_method_handler,
            "stream_unary": grpc.stream_unary_rpc_method_handler,
            "stream_stream": grpc.stream_stream_rpc_method_handler}[field]
    return make(wrapped, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def _keep_attrs(wrapped: Callable[..., Any], behavior: Callable[..., Any]) -> Callable[..., Any]:
    for name in _BEHAVIOR_ATTRS:
        if hasattr(behavior, name):
            setattr(wrapped, name, getattr(behavior, name))
    return wrapped


def _call(method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
    """A unary-response behaviour (or a non-blocking streaming one, which answers through a
    callback grpcio passes as a third argument), its exceptions mapped."""

    def wrapped(request: Any, context: grpc.ServicerContext, *callback: Any) -> Any:
        try:
            return behavior(request, context, *callback)
        except Exception as exc:
            _abort_for(exc, context, method)
            raise

    return _keep_attrs(wrapped, behavior)


def _stream(method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
    """A streaming-response behaviour whose exceptions are mapped, raised when it is called or
    between messages alike."""
    if getattr(behavior, "experimental_non_blocking", False):
        return _call(method, behavior)

    def wrapped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from behavior(request, context)
        except Exception as exc:
            _abort_for(exc, context, method)
            raise

    return _keep_attrs(wrapped, behavior)


def _abort_for(exc: Exception, context: grpc.ServicerContext, method: str) -> None:
    """Abort the call with the status ``exc`` maps to (``context.abort`` raises), or return
    when ``exc`` is to pass as it is: the handler's own abort, or a call already over."""
    if context.code() is not None:  # context.abort() raised this, or the handler set the code
        return
    if isinstance(exc, grpc.RpcError) and not context.is_active():
        return  # the request stream says the caller cancelled or its deadline passed
    code, details, quiet = _status_of(exc, context, _where(method))
    if quiet:
        log.warning("rpc failed", method=method, status=code.name, error=_named(exc))
    else:
        log.error("rpc failed", method=method, status=code.name, error=_named(exc), peer=_peer(context),
                  exc_info=exc)
    context.abort(code, details[:MAX_DETAILS])


def _status_of(exc: Exception, context: grpc.ServicerContext, where: str) -> tuple[grpc.StatusCode, str, bool]:
    """(status, details, quiet: log without the traceback)."""
    if _out_of_memory(exc):
        return (grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{where}: the server ran out of memory ({_named(exc)}); retry later, or with a smaller request",
                False)
    if _database_busy(exc):
        return (grpc.StatusCode.UNAVAILABLE,
                f"{where}: the server's database is busy ({_text(exc)}); retry the same request shortly", True)
    if isinstance(exc, TimeoutError):
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return (grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{where}: the call's deadline passed while the server waited ({_named(exc)}); retry with a "
                    "longer deadline", False)
        return (grpc.StatusCode.UNAVAILABLE,
                f"{where}: the server timed out waiting for something it needs ({_named(exc)}); retry shortly",
                False)
    if isinstance(exc, NotImplementedError):
        return (grpc.StatusCode.UNIMPLEMENTED,
                f"{where} is not implemented by this server ({_named(exc)})", False)
    return (grpc.StatusCode.INTERNAL,
            f"{where} failed inside the server ({_named(exc)}); the server logged it with its traceback: "
            "report it to its operator", False)


def _out_of_memory(exc: Exception) -> bool:
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")  # never imported here: a torch error means torch is loaded
    if torch is None or not isinstance(exc, RuntimeError):
        return False
    kinds = tuple(k for k in (getattr(torch, "OutOfMemoryError", None),
                              getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)) if isinstance(k, type))
    # Older torch and other backends (MPS) raise a plain RuntimeError saying so.
    return (bool(kinds) and isinstance(exc, kinds)) or "out of memory" in _text(exc).lower()


def _database_busy(exc: Exception) -> bool:
    sqlite3 = sys.modules.get("sqlite3")
    if sqlite3 is None or not isinstance(exc, sqlite3.OperationalError):
        return False
    text = _text(exc).lower()
    return "locked" in text or "busy" in text


def _where(method: str) -> str:
    """``/kvasir.v1.LedgerService/GetBalance`` as ``LedgerService.GetBalance``."""
    service, _, name = method.rpartition("/")
    return f"{service.rpartition('.')[2]}.{name}" if service and name else method or "the call"


def _text(exc: BaseException) -> str:
    """The exception's text on one line, at most _TEXT_CHARS characters."""
    try:
        text = " ".join(str(exc).split())
    except Exception:  # an exception whose __str__ raises
        return ""
    return text if len(text) <= _TEXT_CHARS else text[: _TEXT_CHARS - 3] + "..."


def _named(exc: BaseException) -> str:
    text = _text(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _peer(context: grpc.ServicerContext) -> str:
    try:
        return str(context.peer())
    except Exception:
        return ""
