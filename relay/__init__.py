"""Relay services on trio + wsproto: the LAN hub and the public gateway.

Names load on first use, so ``python -m relay gateway`` imports no protobuf or gRPC module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvasir_rpc import lazy_getattr

if TYPE_CHECKING:
    from relay.gateway._gateway import GatewayConfig, GatewayStats, serve_gateway
    from relay.hub._registry import SessionRegistry, SessionStats
    from relay.hub._sessions import HubConfig, create_session_server, serve_hub

_LAZY = {
    "GatewayConfig": "relay.gateway._gateway",
    "GatewayStats": "relay.gateway._gateway",
    "serve_gateway": "relay.gateway._gateway",
    "HubConfig": "relay.hub._sessions",
    "create_session_server": "relay.hub._sessions",
    "serve_hub": "relay.hub._sessions",
    "SessionRegistry": "relay.hub._registry",
    "SessionStats": "relay.hub._registry",
}
__all__ = list(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
