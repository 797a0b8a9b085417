"""The worker: serves ExpertService for its expert slices through an outbound tunnel.

The names below load on first use (PEP 562), so ``python -m worker`` can check its arguments
and its files, and fail in one line, before torch loads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvasir_rpc import lazy_getattr

if TYPE_CHECKING:
    from worker._service import ExpertServicer, LoadedExperts
    from worker._tunnel import run_tunnel, serve_session

_LAZY = {
    "ExpertServicer": "worker._service",
    "LoadedExperts": "worker._service",
    "run_tunnel": "worker._tunnel",
    "serve_session": "worker._tunnel",
}

__all__ = ["ExpertServicer", "LoadedExperts", "run_tunnel", "serve_session"]


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
