"""Listening addresses that belong to one process only.

grpcio sets SO_REUSEPORT on its listening sockets unless told not to, so a second server on
a busy port starts "fine" and the kernel then spreads connections over both. Every gRPC
server here takes ``NO_PORT_SHARING`` among its options and binds with ``bind_grpc``; a
component that cannot listen stops with one line: ``ListenError``'s own (``cannot listen on
ADDRESS: REASON``), or ``ListenError.line(component, flag)``, which names the flag and the
fix (another program on the port, a port that needs privileges, an address not on this
machine).
"""

from __future__ import annotations

import errno
import socket
from typing import Any

__all__ = ["NO_PORT_SHARING", "ListenError", "as_listen_error", "bind_grpc", "check_listen"]

NO_PORT_SHARING: tuple[str, int] = ("grpc.so_reuseport", 0)

_REASONS = {
    errno.EADDRINUSE: "address in use",
    errno.EACCES: "permission denied (ports below 1024 need privileges)",
    errno.EADDRNOTAVAIL: "no such address on this machine",
}


class ListenError(OSError):
    """An address this process cannot listen on; ``str()`` is the line to show, ``line()``
    the same with the flag and the fix. ``errno`` is the failed bind's (None when the
    address did not resolve or gRPC gave no reason)."""

    def __init__(self, address: str, reason: str, code: int | None = None) -> None:
        super().__init__(f"cannot listen on {address}: {reason}")
        self.errno = code
        self.address = address
        self.reason = reason

    def line(self, component: str, flag: str) -> str:
        """One line for a person: ``COMPONENT: FLAG ADDRESS`` then what is wrong and what to do."""
        where = f"{component}: {flag} {self.address}"
        if self.errno == errno.EADDRINUSE:
            return (f"{where} is in use by another program: stop it or choose another port "
                    "(port 0 picks a free one)")
        if self.errno == errno.EACCES:
            parts = _split(self.address)
            port = parts[1] if parts else 0
            higher = ("listen on a higher port such as 8443 behind a proxy that forwards 443" if port == 443
                      else "choose a port above 1023")
            return (f"{where} needs privileges: run as root, grant CAP_NET_BIND_SERVICE "
                    f"(setcap 'cap_net_bind_service=+ep' on the python binary), or {higher}")
        if self.errno == errno.EADDRNOTAVAIL:
            return (f"{where}: no such address on this machine: give one of its own addresses "
                    "(0.0.0.0 for all of them, 127.0.0.1 for this machine only)")
        return f"{where}: {self.reason}"


def _split(address: str) -> tuple[str, int] | None:
    """(host, port) of a gRPC-style ``HOST:PORT`` / ``[V6]:PORT``; None for anything else
    (``unix:`` paths, names gRPC resolves its own way)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or address.startswith("unix"):
        return None
    return host.strip("[]") or "0.0.0.0", int(port)


def _reason(exc: OSError) -> str:
    return _REASONS.get(exc.errno or 0) or (exc.strerror or str(exc)).lower()


def check_listen(address: str) -> None:
    """Raise ListenError when ``HOST:PORT`` cannot be bound right now (something listens
    there, no such local address, a privileged port). Binds and closes at once, as a listener
    would (SO_REUSEADDR, no SO_REUSEPORT, the system's dual-stack default as gRPC's), on
    every address ``HOST`` resolves to. Port 0 and
    other address forms pass: the real bind reports them."""
    parts = _split(address)
    if parts is None or parts[1] == 0:
        return
    host, port = parts
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(address, f"cannot resolve {host!r} ({exc.strerror}): give an IP address "
                                   "or a name this machine resolves") from None
    for family, kind, proto, _name, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                raise ListenError(address, _reason(exc), exc.errno) from None


def bind_grpc(server: Any, address: str, credentials: Any = None) -> int:
    """Add ``address`` to a ``grpc.Server`` (``credentials``: secure), checked first with
    ``check_listen``. Returns the bound port; raises ListenError naming the address. The
    server must have been made with ``NO_PORT_SHARING``, or a busy port may still bind."""
    check_listen(address)  # also spares the user gRPC's own multi-line log of the failure
    try:
        port = int(server.add_secure_port(address, credentials) if credentials is not None
                   else server.add_insecure_port(address))
    except RuntimeError:  # grpcio >= 1.50 raises where older ones returned 0
        port = 0
    if port == 0:
        check_listen(address)  # taken since the first check? then that is the reason
        raise ListenError(address, "gRPC could not bind it (GRPC_VERBOSITY=debug tells why)")
    return port


def as_listen_error(address: str, exc: BaseException) -> ListenError | None:
    """The ListenError for ``exc``, raised while binding ``address``, when it (or the only
    exception inside its groups) is a failed bind: an OSError with an errno (trio's
    listeners), or gRPC's RuntimeError / errno-less OSError (then ``check_listen`` finds the
    reason). None for anything else, which the caller re-raises."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, ListenError):
        return exc
    if isinstance(exc, OSError) and exc.errno is not None:
        return ListenError(address, _reason(exc), exc.errno)
    if isinstance(exc, (OSError, RuntimeError)):
        try:
            check_listen(address)
        except ListenError as found:
            return found
        return ListenError(address, str(exc) or type(exc).__name__)
    return None
