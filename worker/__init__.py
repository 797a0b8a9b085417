"""The worker: serves ExpertService for its expert slices through an outbound tunnel.

The names below load on first use (PEP 562), so ``python -m worker`` can check its arguments
and its files, and fail in one line, before torch loads."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'worker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
