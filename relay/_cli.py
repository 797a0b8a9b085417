"""What the hub's and the gateway's commands share: reading a token file, checking and
binding listen addresses with one line naming the flag on failure, and stopping on a signal."""

from __future__ import annotations

import pathlib
import signal

import trio

from kvasir_rpc import (
    fail,
)

__all__ = ["check_listen_flags", "new_token_hint", "read_token", "start_listening", "until_signal"]


def new_token_hint(path: pathlib.Path) -> str:
    return f"(umask 077; head -c 32 /dev/urandom | base64 > {path})"


def read_token(component: str, flag: str, path: pathlib.Path, fix: str) -> str:
    """The token in ``path``, or the end of the program with one line naming ``flag`` and ``fix``."""
    from kvasir_rpc import TokenError, load_token

    try:
        return load_token(path)
    except TokenError as exc:
        fail(f"{component}: {flag}: {exc}: {fix}")


def check_listen_flags(component: str, *flag_addresses: tuple[str, str]) -> None:
    """Stop with one line naming the flag (exit 2) when an address cannot be listened on (in
    use, needing privileges, not on this machine): before any file or database is touched,
    so a second copy started by mistake changes nothing of the first's."""
    from kvasir_rpc import ListenError, check_listen

    for flag, address in flag_addresses:
        try:
            check_listen(address)
        except ListenError as exc:
            fail(exc.line(component, flag))


async def start_listening(nursery: trio.Nursery, failed: list[str], component: str, flag: str, address: str,
                           serve, *args):  # type: ignore[no-untyped-def]
    """``await nursery.start(serve, *args)``. When ``address`` cannot be bound (taken since
    ``check_listen_flags``) the line to show goes to ``failed``, the nursery is cancelled and
    None returned: the caller exits 2 once trio.run is over (an exception would leave trio
    wrapped in an exception group, and print a traceback)."""
    from kvasir_rpc import as_listen_error

    try:
        return await nursery.start(serve, *args)
    except (OSError, BaseExceptionGroup) as exc:
        err = as_listen_error(address, exc)
        if err is None:
            raise
        failed.append(err.line(component, flag))
        nursery.cancel_scope.cancel()
        return None


async def until_signal(nursery: trio.Nursery, log, what: str) -> None:  # type: ignore[no-untyped-def]
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            log.info(f"{what} stopping")
            nursery.cancel_scope.cancel()
            return

