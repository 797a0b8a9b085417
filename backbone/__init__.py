"""The backbone: dense layers and the router on this machine, experts anywhere.

The names below load on first use (PEP 562), so ``python -m backbone`` can check its
arguments, its files and its hub, and fail in one line, before torch and transformers load."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvasir_rpc import lazy_getattr

if TYPE_CHECKING:
    from backbone.engine._decode import Decode, compare, decode, load_model
    from backbone.experts._dispatch import IMPLEMENTATION, Dispatcher, DispatchStats, install
    from backbone.experts._links import SessionWatcher, WorkerLink

_LAZY = {
    "IMPLEMENTATION": "backbone.experts._dispatch",
    "Dispatcher": "backbone.experts._dispatch",
    "DispatchStats": "backbone.experts._dispatch",
    "install": "backbone.experts._dispatch",
    "Decode": "backbone.engine._decode",
    "compare": "backbone.engine._decode",
    "decode": "backbone.engine._decode",
    "load_model": "backbone.engine._decode",
    "SessionWatcher": "backbone.experts._links",
    "WorkerLink": "backbone.experts._links",
}

__all__ = [
    "IMPLEMENTATION",
    "Decode",
    "DispatchStats",
    "Dispatcher",
    "SessionWatcher",
    "WorkerLink",
    "compare",
    "decode",
    "install",
    "load_model",
]


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
