"""Relay services on trio + wsproto: the LAN hub and the public gateway.

Names load on first use, so ``python -m relay gateway`` imports no protobuf or gRPC module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvasir_rpc import lazy_getattr

if TYPE_CHECKING:
    from relay._gateway import GatewayConfig, GatewayStats, serve_gateway
    from relay._hub import HubConfig, create_session_server, serve_hub
    from relay._registry import SessionRegistry, SessionStats

_LAZY = {
    "GatewayConfig": "relay._gateway",
    "GatewayStats": "relay._gateway",
    "serve_gateway": "relay._gateway",
    "HubConfig": "relay._hub",
    "create_session_server": "relay._hub",
    "serve_hub": "relay._hub",
    "SessionRegistry": "relay._registry",
    "SessionStats": "relay._registry",
}
__all__ = list(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
