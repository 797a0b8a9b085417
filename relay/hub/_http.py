"""The hub's ``--http``: Prometheus metrics at ``/metrics``, the status document at
``/api/status`` and the live status page at ``/`` (served with the status document inside, so
its first paint shows the hub as it is, then polling ``/api/status``). Read-only: it shows public addresses
(the hub's key, wallets) and counters, never a token, a target or a worker's IP address.

A Starlette app served by Hypercorn on the hub's own trio event loop (``serve_hub_http`` is a
service for ``nursery.start``). Metrics are read at scrape time from the counters the hub
keeps anyway (``HubCollector``): nothing is added to the tunnels' hot path but the keepalive
round trips, observed once per check.

Why no per-call latency histogram: the hub splices a session's HTTP/2 bytes without parsing
them (and on an encrypted session cannot); the backbone's calls are messages on one long-lived
stream, so timing each would mean parsing HTTP/2 and gRPC framing of every byte and pairing
requests with partials. The backbone times its calls; the hub reports round trips.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import logging
from collections.abc import Callable, Iterator

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvasir_rpc import get_logger
from relay.hub._admission import SessionRateStats
from relay.hub._receipts import ReceiptSenderStats
from relay.hub._registry import SessionRegistry
from relay.hub._status import SAMPLE_S, StatusBoard
from relay.hub._work_desk import WorkDeskStats

__all__ = ["HubCollector", "embed_json", "hub_metrics", "make_app", "page_with", "serve_hub_http"]

log = get_logger("relay.http")

# Keepalive round trips, LAN to intercontinental.
RTT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class HubCollector(Collector):
    """The hub's counters as Prometheus metrics, read when scraped (``kvasir_hub_*``)."""

    def __init__(self, registry: SessionRegistry, *, desk: Callable[[], WorkDeskStats] | None = None,
                 sender: Callable[[], ReceiptSenderStats] | None = None,
                 rate: Callable[[], SessionRateStats] | None = None) -> None:
        self._registry = registry
        self._desk = desk
        self._sender = sender
        self._rate = rate

    def collect(self) -> Iterator[Metric]:
        sessions = self._registry.statistics()
        totals = self._registry.totals()
        live = GaugeMetricFamily("kvasir_hub_sessions", "Live worker sessions", labels=["encrypted", "via"])
        for encrypted in (True, False):
            for via in ("direct", "gateway"):
                n = sum(s.encrypted == encrypted and (via == "gateway") == s.via_gateway for s in sessions)
                live.add_metric([str(encrypted).lower(), via], n)
        yield live
        yield CounterMetricFamily("kvasir_hub_sessions_opened", "Sessions opened (hello verified)",
                                  value=totals.opened)
        closed = CounterMetricFamily("kvasir_hub_sessions_closed", "Sessions ended, by why", labels=["reason"])
        for reason, n in sorted(totals.closed.items()):
            closed.add_metric([reason], n)
        yield closed
        tunnel = CounterMetricFamily("kvasir_hub_tunnel_bytes", "Tunnel payload bytes after the handshake "
                                     "(not work: see kvasir_hub_work_bytes_total)", labels=["direction"])
        tunnel.add_metric(["to_worker"], totals.bytes_to_worker)
        tunnel.add_metric(["from_worker"], totals.bytes_from_worker)
        yield tunnel
        if self._rate is not None:
            rate = self._rate()
            admitted = CounterMetricFamily("kvasir_hub_sessions_admitted", "New sessions that passed the rate "
                                           "limits, by the wallet's standing (new, returning, suspect)",
                                           labels=["standing"])
            for standing, n in sorted(rate.admitted.items()):
                admitted.add_metric([standing], n)
            yield admitted
            limited = CounterMetricFamily("kvasir_hub_sessions_rate_limited", "New sessions refused (close 4205) "
                                          "by the rate limits, by the limit (address, hub) and the wallet's standing",
                                          labels=["limit", "standing"])
            for (limit, standing), n in sorted(rate.refused.items()):
                limited.add_metric([limit, standing], n)
            yield limited
            yield CounterMetricFamily("kvasir_hub_quarantine_penalties", "Addresses charged for a session "
                                      "quarantined while it lived", value=rate.penalties)
        if self._desk is not None:
            desk = self._desk()
            yield CounterMetricFamily("kvasir_hub_work_reports", "ReportWork calls from the backbone",
                                      value=desk.reports)
            yield CounterMetricFamily("kvasir_hub_work_bytes", "Bytes of work the backbone accepted and the hub "
                                      "counted (what receipts pay)", value=desk.work_bytes)
            yield CounterMetricFamily("kvasir_hub_work_calls", "Expert calls behind the work counted",
                                      value=desk.work_calls)
            yield CounterMetricFamily("kvasir_hub_work_rows", "Assignment rows behind the work counted",
                                      value=desk.work_rows)
            yield CounterMetricFamily("kvasir_hub_work_refused", "Work reports refused (unknown or quarantined "
                                      "sessions)", value=desk.refused)
            quarantines = CounterMetricFamily("kvasir_hub_quarantines", "Sessions quarantined for wrong work, "
                                              "by violation", labels=["violation"])
            for violation, n in sorted(desk.quarantines.items()):
                quarantines.add_metric([violation], n)
            yield quarantines
        if self._sender is not None:
            sent = self._sender()
            receipts = CounterMetricFamily("kvasir_hub_receipts", "Receipts the ledger answered, by outcome",
                                           labels=["outcome"])
            receipts.add_metric(["acknowledged"], sent.acked)
            receipts.add_metric(["rejected"], sent.rejected)
            receipts.add_metric(["refused_pending"], sent.refused)
            yield receipts
            yield CounterMetricFamily("kvasir_hub_receipts_sent", "Receipts answered for good by the ledger "
                                      "(acknowledged + rejected)", value=sent.submitted)
            yield CounterMetricFamily("kvasir_hub_ledger_errors", "Receipt passes that could not reach the ledger",
                                      value=sent.ledger_errors)
            yield CounterMetricFamily("kvasir_hub_credited_bytes", "Bytes of work the ledger credited for this "
                                      "hub's receipts", value=sent.credited_bytes)
            yield CounterMetricFamily("kvasir_hub_credited_nano_kvr", "nano-KVR the ledger credited for this "
                                      "hub's receipts", value=sent.credited_nano_kvr)


def hub_metrics(registry: SessionRegistry, collector: HubCollector) -> CollectorRegistry:
    """The hub's own CollectorRegistry (never the process-global one): ``collector`` plus the
    keepalive round-trip histogram, which ``registry`` feeds (its ``on_rtt`` hook)."""
    metrics = CollectorRegistry(auto_describe=True)
    metrics.register(collector)
    rtt = Histogram("kvasir_hub_worker_rtt_seconds", "Keepalive round trips hub -> worker -> hub (a sealed "
                    "heartbeat, or a WebSocket ping that a relay may answer)", buckets=RTT_BUCKETS_S,
                    registry=metrics)
    registry.on_rtt.append(rtt.observe)
    return metrics


# Where the page takes the status document it paints first (see ``page_with``).
INITIAL_SLOT = b'<script type="application/json" id="initial"></script>'


@functools.cache
def _page() -> tuple[bytes, bytes]:
    """The page, split around its ``INITIAL_SLOT``'s content."""
    page = importlib.resources.files("relay.hub").joinpath("status_page.html").read_bytes()
    head, slot, tail = page.partition(INITIAL_SLOT)
    if not slot:
        raise RuntimeError("relay/hub/status_page.html has no initial-document slot")
    cut = len(head) + INITIAL_SLOT.index(b"</script>")
    return page[:cut], page[cut:]


def embed_json(doc: object) -> bytes:
    """``doc`` as JSON that is safe inside a ``<script>`` element: every ``<``, ``>`` and ``&``
    is written as a JSON ``\\u`` escape (they can only be inside strings), so no ``</script>``
    or ``<!--`` in a value can end or bend the element; JSON.parse reads the same value back."""
    text = json.dumps(doc, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                    ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text.encode()


def page_with(doc: object) -> bytes:
    """The status page with ``doc`` (``StatusBoard.snapshot()``) inside, so its first paint
    shows the hub as it is, before the page's first poll."""
    head, tail = _page()
    return head + embed_json(doc) + tail


def make_app(board: StatusBoard, metrics: CollectorRegistry) -> Starlette:
    """The HTTP app: ``/`` (the page), ``/api/status`` (JSON), ``/metrics`` (Prometheus text)."""

    async def page(request: Request) -> Response:
        return Response(page_with(board.snapshot()), media_type="text/html; charset=utf-8",
                        headers={"cache-control": "no-store"})

    async def status(request: Request) -> Response:
        return JSONResponse(board.snapshot(), headers={"cache-control": "no-store"})

    async def metrics_text(request: Request) -> Response:
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[Route("/", page, methods=["GET"]), Route("/api/status", status, methods=["GET"]),
                             Route("/metrics", metrics_text, methods=["GET"])])


async def _sample(board: StatusBoard, interval_s: float) -> None:
    while True:
        board.sample()
        await trio.sleep(interval_s)


async def serve_hub_http(address: str, board: StatusBoard, metrics: CollectorRegistry, *,
                         sample_s: float = SAMPLE_S, task_status=trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[no-untyped-def]
    """Serve the app on ``address`` ("HOST:PORT", port 0 picks one) until cancelled, sampling
    ``board`` every ``sample_s``; ``task_status.started(port)`` once listening. Raises OSError
    when the address cannot be bound."""
    config = Config()
    config.bind = [address]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.include_server_header = False
    config.graceful_timeout = 1.0
    app = make_app(board, metrics)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_sample, board, sample_s)
        # hypercorn types an ASGI app more narrowly than Starlette declares its __call__.
        binds = await nursery.start(functools.partial(serve, app, config, mode="asgi"))  # type: ignore[arg-type]
        port = int(binds[0].rsplit(":", 1)[1])
        log.info("status page and metrics listening", url=f"http://{address.rsplit(':', 1)[0]}:{port}/")
        task_status.started(port)
