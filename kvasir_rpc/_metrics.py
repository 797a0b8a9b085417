"""Prometheus metrics shared by the components: ``/metrics`` served from a daemon thread, a
collector that reads a component's own counters at scrape time, and the latency buckets of
our calls.

Every component builds its own ``prometheus_client.CollectorRegistry`` (never the global
one, so that a test or a process running two components keeps their numbers apart) and names
its metrics ``kvasir_<component>_...``, units in the name, counters ending ``_total``.

Counting on a hot path stays a plain ``int`` add in the component (its ``statistics()``
record); ``StatsCollector`` turns that record into metric families only when scraped.
"""

from __future__ import annotations

import socket
import socketserver
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

__all__ = [
    "LATENCY_BUCKETS_S",
    "METRICS_PATH",
    "StatsCollector",
    "counter_family",
    "gauge_family",
    "latency_histogram",
    "serve_metrics",
]

METRICS_PATH = "/metrics"
#: Seconds, from a sub-millisecond call on one machine to a WAN call near its timeout.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# A scraper that connects and sends nothing (or reads nothing) holds one thread this long at most.
_CLIENT_TIMEOUT_S = 10.0
#: Connections served at once (a thread each); one more is closed unanswered at once, so a client
#: that opens many and sends nothing holds at most this many threads, each for _CLIENT_TIMEOUT_S.
MAX_HTTP_CONNECTIONS = 64


def latency_histogram(name: str, documentation: str, registry: CollectorRegistry,
                      labelnames: Iterable[str] = ()) -> Histogram:
    """A histogram of durations in seconds (``name`` ends ``_seconds``) on LATENCY_BUCKETS_S,
    registered in ``registry``."""
    if not name.endswith("_seconds"):
        raise ValueError(f"a latency histogram's name ends with _seconds, got {name!r}")
    return Histogram(name, documentation, labelnames=tuple(labelnames), registry=registry,
                     buckets=LATENCY_BUCKETS_S)


def counter_family(name: str, documentation: str, value: float | None = None, *,
                   labels: Mapping[tuple[str, ...], float] | None = None,
                   labelnames: Iterable[str] = ()) -> CounterMetricFamily:
    """A counter family (``name`` ends ``_total``): one ``value``, or one sample per label
    tuple of ``labels`` (keys in the order of ``labelnames``)."""
    if not name.endswith("_total"):
        raise ValueError(f"a counter's name ends with _total, got {name!r}")
    if labels is None:
        return CounterMetricFamily(name, documentation, value=value or 0)
    family = CounterMetricFamily(name, documentation, labels=list(labelnames))
    for key, v in sorted(labels.items()):
        family.add_metric(list(key), v)
    return family


def gauge_family(name: str, documentation: str, value: float | None = None, *,
                 labels: Mapping[tuple[str, ...], float] | None = None,
                 labelnames: Iterable[str] = ()) -> GaugeMetricFamily:
    """A gauge family: one ``value``, or one sample per label tuple of ``labels``."""
    if labels is None:
        return GaugeMetricFamily(name, documentation, value=value or 0)
    family = GaugeMetricFamily(name, documentation, labels=list(labelnames))
    for key, v in sorted(labels.items()):
        family.add_metric(list(key), v)
    return family


class StatsCollector(Collector):
    """A collector whose families come from ``collect_fn()``, called at each scrape (on the
    metrics server's thread: it reads thread-safe ``statistics()`` records, never awaits)."""

    def __init__(self, collect_fn: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect_fn

    def collect(self) -> Iterable[Metric]:
        return list(self._collect())

    def describe(self) -> Iterable[Metric]:
        # Registration must not scrape (the component may not be running yet).
        return []


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = False
    max_connections = MAX_HTTP_CONNECTIONS
    # The listen backlog: at socketserver's 5, a burst of connections past it waits for the
    # kernel's SYN-ACK retries (seconds) before this server even sees it.
    request_queue_size = 128

    def __init__(self, *args: Any, **kw: Any) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        super().__init__(*args, **kw)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Before a thread is made: past the cap the connection is closed unanswered.
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went quiet past the timeout, or went away, is not a traceback on stderr.
        if isinstance(sys.exc_info()[1], (TimeoutError, ConnectionError)):
            return
        super().handle_error(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def server_bind(self) -> None:
        # HTTPServer's own looks the host's name up (socket.getfqdn): a DNS wait for nothing.
        socketserver.TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = int(self.server_address[1])
        self.setup_environ()


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    timeout = _CLIENT_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # a scrape every few seconds is not news


def _routed(app: Any, routes: Mapping[str, Any]) -> Any:
    where = ", ".join([METRICS_PATH, *(f"{prefix}..." for prefix in routes)])

    def route(environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO") or ""
        if path == METRICS_PATH:
            return app(environ, start_response)
        for prefix, other in routes.items():
            if path.startswith(prefix):
                return other(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [f"not found; this server answers {where}\n".encode()]

    return route


def serve_metrics(registry: CollectorRegistry, host: str, port: int, *,
                  routes: Mapping[str, Any] | None = None) -> tuple[Callable[[], None], int]:
    """Serve ``registry`` at ``http://HOST:PORT/metrics`` (Prometheus text format), and each
    WSGI app of ``routes`` at the paths starting with its key (``"/v1/balance/"``); other paths
    answer 404. From a daemon thread, a thread per connection, at most MAX_HTTP_CONNECTIONS at
    once; port 0 picks a free port. Returns ``(stop, bound port)``: ``stop()`` closes the
    listening socket and waits for the thread (idempotent). Raises OSError when the address
    cannot be bound."""
    for prefix in routes or {}:
        if not prefix.startswith("/") or prefix.startswith(METRICS_PATH):
            raise ValueError(f"a route's prefix starts with / and is not under {METRICS_PATH}, got {prefix!r}")
    server_class = _Server6 if ":" in host else _Server
    httpd = make_server(host, port, _routed(make_wsgi_app(registry), dict(routes or {})),
                        server_class=server_class, handler_class=_QuietHandler)
    bound = int(httpd.server_address[1])
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.5},
                              name=f"metrics-{bound}", daemon=True)
    thread.start()
    stopped = threading.Lock()

    def stop() -> None:
        if not stopped.acquire(blocking=False):
            return
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5.0)

    return stop, bound
