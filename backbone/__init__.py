"""The backbone: dense layers and the router on this machine, experts anywhere."""

from backbone._experts import IMPLEMENTATION, Dispatcher, DispatchStats, install
from backbone._generate import Decode, compare, decode, load_model
from backbone._links import SessionWatcher, WorkerLink

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
