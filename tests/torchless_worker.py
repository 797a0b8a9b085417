"""``python -m worker`` in a process where torch (and transformers, accelerate,
compressed-tensors) cannot be imported, as on a machine where they are not installed: every
import of them raises ModuleNotFoundError, as it would there. Arguments as the worker's."""

from __future__ import annotations

import importlib.abc
import runpy
import sys

BLOCKED = ("torch", "transformers", "accelerate", "compressed_tensors")


class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: a worker without torch)", name=name)
        return None


if __name__ == "__main__":
    sys.meta_path.insert(0, _Absent())
    sys.argv[0] = "worker"
    runpy.run_module("worker", run_name="__main__", alter_sys=True)
