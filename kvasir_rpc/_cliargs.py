"""Small pieces the component command lines share: HOST:PORT arguments, ready files, help
that shows defaults, and the one-line ends (a configuration error: exit 2; Ctrl-C: exit 130)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Callable
from typing import NoReturn

__all__ = [
    "BACKBONE_TOKEN_FILE",
    "LOG_LEVELS",
    "STATE_DIR",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "HelpFormatter",
    "add_log_level",
    "fail",
    "hostport",
    "hostport_text",
    "make_state_parent",
    "run_main",
    "write_ready_file",
]

#: Exit status of a usage or configuration error (argparse's own), everywhere.
EXIT_USAGE = 2
#: Exit status after Ctrl-C (128 + SIGINT), as a shell reports it.
EXIT_INTERRUPTED = 130
LOG_LEVELS = ("debug", "info", "warning", "error")
#: Where state files (keys, tokens, databases) go unless a flag says otherwise: a folder of
#: the working directory, git-ignored, created mode 0700 on first use.
STATE_DIR = pathlib.Path(".kvasir")
#: The backbone token the hub creates (its --backbone-token-file) and the backbone presents
#: (its --hub-token-file): one default for both, so "the same file" needs no flag.
BACKBONE_TOKEN_FILE = STATE_DIR / "hub-backbone.token"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` that shows each argument's default (argparse's own formatter shows none),
    leaving out the empty ones: ``(default: None)`` of an option that has none, and
    ``(default: False)`` of a switch."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def add_log_level(parser: argparse.ArgumentParser, default: str = "info") -> None:
    """``--log-level`` with its choices checked (``--log-level bogus`` is a usage error)."""
    parser.add_argument("--log-level", default=default, choices=LOG_LEVELS, type=str.lower,
                        help="least severe log lines shown")


def fail(message: str, status: int = EXIT_USAGE) -> NoReturn:
    """End the program with one line on stderr (no traceback): by default exit 2, for a usage
    or configuration error the person running it can fix. ``message`` names the flag and the fix."""
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(status)


def _only_interrupts(exc: BaseException) -> bool:
    if isinstance(exc, KeyboardInterrupt):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_interrupts(e) for e in exc.exceptions)
    return False


def run_main(prog: str, main: Callable[[], int]) -> NoReturn:
    """Run a command's ``main`` and exit with its status. Ctrl-C (a KeyboardInterrupt, also
    inside trio's exception groups) prints one line and exits 130, with no traceback."""
    try:
        status = main()
    except BaseException as exc:
        if not _only_interrupts(exc):
            raise
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    raise SystemExit(status)


def make_state_parent(path: pathlib.Path) -> None:
    """Create the folder ``path`` goes in when it is missing, mode 0700 (its parents too, with
    the usual mode): secrets and databases under it are then the owner's alone. Raises
    OSError when it cannot be made."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)


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


def hostport_text(host: str, port: int) -> str:
    """``HOST:PORT`` as ``hostport`` reads it back: an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def write_ready_file(path: pathlib.Path | None, info: dict[str, object]) -> None:
    """Write ``info`` as JSON to ``path`` (if given) by write-then-rename, so a reader never
    sees a half-written file."""
    if path is not None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(path)
