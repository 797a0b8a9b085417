"""Small pieces the component command lines share: HOST:PORT arguments and ready files."""

from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Callable

__all__ = ["hostport", "write_ready_file"]


def hostport(default_port: int | None = None) -> Callable[[str], tuple[str, int]]:
    """An argparse type for ``HOST:PORT`` (``[v6]:PORT`` too). With ``default_port``, a bare
    ``HOST`` takes it. Returns ``(host, port)``; raises ArgumentTypeError with the input."""

    def parse(text: str) -> tuple[str, int]:
        host, sep, port = text.rpartition(":")
        if not sep or (host and host.count(":") and not host.startswith("[")):
            if default_port is None:
                raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
            return text.strip("[]"), default_port
        if not host or not port.isdigit() or int(port) > 65535:
            raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
        return host.strip("[]"), int(port)

    return parse


def write_ready_file(path: pathlib.Path | None, info: dict[str, object]) -> None:
    """Write ``info`` as JSON to ``path`` (if given) by write-then-rename, so a reader never
    sees a half-written file."""
    if path is not None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(path)
