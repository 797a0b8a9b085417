"""Small pieces the component command lines share: HOST:PORT arguments, ready files, help
that shows defaults, and the one-line ends (a configuration error: exit 2; Ctrl-C: exit 130;
a reader that closed our stdout, as ``| head`` does: exit 141, quietly)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import select
import sys
from collections.abc import Callable
from typing import NoReturn

__all__ = [
    "BACKBONE_TOKEN_FILE",
    "HUB_KEY_FILE",
    "LOG_LEVELS",
    "STATE_DIR",
    "WALLET_FILE",
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
#: The hub's key (its --key): it signs the receipts; a ledger trusts its public key.
HUB_KEY_FILE = STATE_DIR / "hub.key"
#: A worker's wallet (its --wallet), which ``kvasir balance`` reads when given no wallet.
WALLET_FILE = STATE_DIR / "wallet.key"
#: Exit status when the reader of stdout went away (128 + SIGPIPE), as a shell reports a
#: command that ``| head`` cut short.
_EXIT_BROKEN_PIPE = 141


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


def _stdout_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader has closed it: a BrokenPipeError is then
    ours to end quietly; one from any other socket is a real failure and keeps its traceback."""
    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, 0)  # errors and hang-ups are reported whatever the mask
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no stdout, no fd, or no poll (Windows)
        return sys.stdout is not None


def _stdout_to_devnull() -> None:
    """Python flushes stdout once more as it exits: let that go to /dev/null, not print
    "Exception ignored ... BrokenPipeError" on stderr."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def _flush_stdout() -> None:
    """Flush stdout; a reader that has left is no error (a BrokenPipeError from elsewhere is)."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        _stdout_to_devnull()


def run_main(prog: str, main: Callable[[], int]) -> NoReturn:
    """Run a command's ``main`` and exit with its status. Ctrl-C (a KeyboardInterrupt, also
    inside trio's exception groups) prints one line and exits 130, with no traceback. A reader
    that closed stdout early (``kvasir status | head``) ends it quietly with exit 141, as a
    shell's own tools do: nobody is left to read the rest, and a traceback helps no one."""
    try:
        try:
            status = main()
        except SystemExit:
            _flush_stdout()  # --help's text meets a closed pipe here, not at exit; the status stays
            raise
        sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        _stdout_to_devnull()
        raise SystemExit(_EXIT_BROKEN_PIPE) from None
    except BaseException as exc:
        if not _only_interrupts(exc):
            raise
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    raise SystemExit(status)


def make_state_parent(path: pathlib.Path) -> None:
    """Create the folder ``path`` goes in when it is missing, mode 0700 (its missing parents
    too), and tighten a ``.kvasir`` folder an older version made 0755 (``ensure_state_dir``):
    secrets and databases under it are then the owner's alone. Raises OSError when it cannot
    be made."""
    from kvasir_rpc._secrets import ensure_state_dir  # not at import: it loads the logging set-up

    ensure_state_dir(path.parent)


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
