"""The gateway's Prometheus metrics (``kvasir_gateway_*``), read from ``Gateway.statistics()``
at scrape time: the relay path only adds to plain ints."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from kvasir_rpc import StatsCollector, counter_family, gauge_family
from relay.gateway._gateway import GatewayStats

__all__ = ["gateway_registry"]


def _code_label(code: int) -> str:
    # Codes come from peers: only the standard range is its own label, the rest "other".
    return str(code) if 1000 <= code <= 1015 else "other"


def _families(stats: Callable[[], GatewayStats]) -> Iterator[Metric]:
    s = stats()
    yield gauge_family("kvasir_gateway_connections", "TCP connections open (handshaking, waiting or spliced)",
                       s.connections)
    yield gauge_family("kvasir_gateway_hubs_connected", "hubs holding a control connection (0 or 1)",
                       int(s.hub_connected))
    yield gauge_family("kvasir_gateway_sessions", "live spliced sessions (worker <-> hub)", s.sessions)
    yield gauge_family("kvasir_gateway_workers_waiting", "workers waiting for a hub to take their session",
                       s.unpaired)
    yield gauge_family("kvasir_gateway_buffered_bytes", "bytes of unfinished messages held, all connections",
                       s.buffered_bytes)
    yield gauge_family("kvasir_gateway_addresses", "source addresses holding a session (IPv6 by /64)",
                       len(s.sessions_by_address))
    yield counter_family("kvasir_gateway_sessions_spliced_total", "worker sessions a hub took (spliced)",
                         s.sessions_spliced)
    yield counter_family("kvasir_gateway_refusals_total", "connections and requests refused, by reason",
                         labels={(why,): n for why, n in s.refused.items()}, labelnames=("reason",))
    closed: dict[tuple[str, ...], int] = {}
    for (side, code), n in s.sessions_closed.items():
        key = (side, _code_label(code))
        closed[key] = closed.get(key, 0) + n
    yield counter_family("kvasir_gateway_sessions_closed_total",
                         "spliced sessions ended, by the side that closed first (worker, hub, gateway) and its "
                         "close code", labels=closed, labelnames=("by", "code"))
    yield counter_family("kvasir_gateway_relayed_bytes_total",
                         "message bytes relayed between spliced workers and hubs, by direction",
                         labels={(d,): n for d, n in s.relayed_bytes_by_direction.items()}, labelnames=("direction",))
    yield counter_family("kvasir_gateway_relayed_messages_total",
                         "messages relayed between spliced workers and hubs, by direction",
                         labels={(d,): n for d, n in s.relayed_messages_by_direction.items()},
                         labelnames=("direction",))


def gateway_registry(stats: Callable[[], GatewayStats]) -> CollectorRegistry:
    """A registry of the gateway's metrics, read from ``stats()`` (``Gateway.statistics``) at
    each scrape."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(lambda: _families(stats)))
    return registry
