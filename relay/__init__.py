"""Relay services on trio + wsproto: the LAN hub (and, later, the public gateway)."""

from relay._hub import HubConfig, create_session_server, serve_hub
from relay._registry import SessionRegistry, SessionStats

__all__ = ["HubConfig", "SessionRegistry", "SessionStats", "create_session_server", "serve_hub"]
