"""Bounds on the hub's long-lived gRPC streams, so that no caller can hold every thread of
the SessionService server and starve ListSessions (or the backbone's own watch).

A synchronous gRPC server runs each RPC on a thread of its pool; a streaming RPC keeps its
thread until the stream ends. Streams are admitted into separate allowances, and the pool
is sized as their sum plus threads kept for unary calls:

* ``watch``: WatchSessions without credentials;
* ``backbone``: WatchSessions presenting ``authorization: Bearer <backbone token>``;
* ``other``: any other stream that holds a thread (server reflection).

A stream beyond its allowance ends at once with RESOURCE_EXHAUSTED and a message saying
what to do. Non-blocking handlers (health's Watch) hold no thread and are not counted.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from kvasir_rpc import AUTHORIZATION_METADATA, check_bearer

__all__ = ["StreamLimits", "StreamLimitsInterceptor", "StreamStats"]

WATCH_METHOD = "/kvasir.v1.SessionService/WatchSessions"


@dataclasses.dataclass(frozen=True)
class StreamLimits:
    watch: int = 4
    backbone: int = 4
    other: int = 4
    # Threads never taken by a stream: ListSessions and other unary calls run on these.
    unary: int = 4

    @property
    def threads(self) -> int:
        """The server's thread pool size that keeps ``unary`` threads free of streams."""
        return self.watch + self.backbone + self.other + self.unary


@dataclasses.dataclass(frozen=True)
class StreamStats:
    """Streams open now in each allowance, and streams refused (RESOURCE_EXHAUSTED) since
    the server started."""

    watch: int
    backbone: int
    other: int
    refused_watch: int
    refused_backbone: int
    refused_other: int


class StreamLimitsInterceptor(grpc.ServerInterceptor):
    """Admits streams into their allowance (see the module docstring)."""

    def __init__(self, limits: StreamLimits, backbone_token: str) -> None:
        self._limits = limits
        self._token = backbone_token
        self._lock = threading.Lock()
        self._open = {"watch": 0, "backbone": 0, "other": 0}
        self._refused = {"watch": 0, "backbone": 0, "other": 0}

    def statistics(self) -> StreamStats:
        """A frozen snapshot of the allowances' counters."""
        with self._lock:
            return StreamStats(watch=self._open["watch"], backbone=self._open["backbone"], other=self._open["other"],
                               refused_watch=self._refused["watch"], refused_backbone=self._refused["backbone"],
                               refused_other=self._refused["other"])

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return handler
        behavior = handler.stream_stream or handler.unary_stream or handler.stream_unary
        if getattr(behavior, "experimental_non_blocking", False):
            return handler
        method = handler_call_details.method
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=self._wrap_unary(method, handler.stream_unary))
        field = "stream_stream" if handler.stream_stream is not None else "unary_stream"
        return handler._replace(**{field: self._wrap_stream(method, behavior)})

    def _admit(self, method: str, context: grpc.ServicerContext) -> Callable[[], None]:
        """Take a slot for this stream or abort it; the function that gives the slot back.

        The slot is given back when the handler returns, that is when its thread is free
        again (WatchSessions notices a cancelled call within its poll interval; a stream
        whose iterator gRPC abandons is finalized, and its ``finally`` runs, when dropped)."""
        if method == WATCH_METHOD:
            metadata = context.invocation_metadata()
            presented = any(k == AUTHORIZATION_METADATA for k, _ in metadata or ())
            if presented and not check_bearer(metadata, self._token):
                context.abort(grpc.StatusCode.UNAUTHENTICATED,
                              "wrong backbone token: present the hub's --backbone-token-file, or no authorization")
            pool = "backbone" if presented else "watch"
        else:
            pool = "other"
        limit = getattr(self._limits, pool)
        with self._lock:
            admitted = self._open[pool] < limit
            if admitted:
                self._open[pool] += 1
            else:
                self._refused[pool] += 1
        if not admitted:
            if pool == "watch":
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the hub serves at most {limit} WatchSessions streams without credentials and all "
                              f"are taken: close one, poll ListSessions instead, or present the backbone token "
                              f"(authorization: Bearer)")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the hub serves at most {limit} {pool} streams ({method}) at once and all are taken: "
                          f"close one and retry")
        done = False

        def release() -> None:
            nonlocal done
            with self._lock:
                if not done:
                    done = True
                    self._open[pool] -= 1

        return release

    def _wrap_stream(self, method: str, behavior: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            release = self._admit(method, context)
            try:
                yield from behavior(request, context)
            finally:
                release()

        return wrapped

    def _wrap_unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(request_iterator: Any, context: grpc.ServicerContext) -> Any:
            release = self._admit(method, context)
            try:
                return behavior(request_iterator, context)
            finally:
                release()

        return wrapped
