"""Relay services on trio + wsproto: the LAN hub and the public gateway.

Names load on first use, so ``python -m relay gateway`` imports no protobuf or gRPC module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'relay' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
