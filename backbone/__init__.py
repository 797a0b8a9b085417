"""The backbone: dense layers and the router on this machine, experts anywhere.

The names below load on first use (PEP 562), so ``python -m backbone`` can check its
arguments, its files and its hub, and fail in one line, before torch and transformers load."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvasir_rpc import lazy_getattr

if TYPE_CHECKING:
    from backbone._experts import IMPLEMENTATION, Dispatcher, DispatchStats, install
    from backbone._generate import Decode, compare, decode, load_model
    from backbone._links import SessionWatcher, WorkerLink

_LAZY = {
    "IMPLEMENTATION": "backbone._experts",
    "Dispatcher": "backbone._experts",
    "DispatchStats": "backbone._experts",
    "install": "backbone._experts",
    "Decode": "backbone._generate",
    "compare": "backbone._generate",
    "decode": "backbone._generate",
    "load_model": "backbone._generate",
    "SessionWatcher": "backbone._links",
    "WorkerLink": "backbone._links",
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
