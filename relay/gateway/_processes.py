"""``python -m relay gateway --processes N``: N gateway processes on one public port.

The parent makes the listening sockets and hands them down; each child is an ordinary
one-process gateway serving two of them: one on the public ``--listen`` port, made with
SO_REUSEPORT (one per child, so the kernel spreads workers' connections over the children),
and one for hubs on an address of its own (``--hub-listen`` PORT+i). A pairing lives in the
child the worker reached, and only a hub connected to that child can take it: hubs keep one
control connection per child (one ``--gateway`` each) and dial each pairing's data
connection to the child that announced it. A hub that dials the shared port is refused (421)
with that explanation.

The parent keeps every socket open for its whole life, so a child that dies loses no port:
connections the kernel gives its public socket meanwhile wait in that socket's backlog for
the restarted child (restarted with backoff), and hubs find it where it was. SIGTERM or
SIGINT stops every child. Each child's ``--http`` metrics server is its own (PORT+i; with
port 0 a restarted child picks a new one, published in the ready file). ``--ready-file`` is written once every child listens, and again when a
restarted child listens: ``{port, http_port, hub_port, pid, processes, children}``, each
child ``{index, pid, hub_port, http_port}`` (``http_port``/``hub_port`` at the top level are
the first child's).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

from kvasir_rpc import configure_logging, fail, get_logger, hostport_text, write_ready_file

__all__ = ["supervise"]

log = get_logger("relay.gateway.procs")

_START_TIMEOUT_S = 60.0  # for every child to listen, at start and after a restart
_STOP_TIMEOUT_S = 10.0  # for the children to end after SIGTERM, then SIGKILL
_MIN_BACKOFF_S, _MAX_BACKOFF_S = 0.5, 30.0
_HEALTHY_S = 60.0  # a child that lived this long restarts after the shortest backoff again
_POLL_S = 0.1


def _listening(host: str, port: int, flag: str, *, reuse_port: bool) -> socket.socket:
    """A listening socket on ``host:port`` (with ``reuse_port``, SO_REUSEPORT: one of a group
    on the same port), or the end of the program with the line naming ``flag``."""
    from kvasir_rpc import as_listen_error

    address = hostport_text(host, port)
    try:
        family, kind, proto, _name, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                  flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, socket.gaierror) as exc:
        fail(f"gateway: {flag} {address}: {getattr(exc, 'strerror', None) or exc}: give an IP address or a name "
             "this machine resolves")
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(sockaddr)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        err = as_listen_error(address, exc)
        fail(err.line("gateway", flag) if err is not None else f"gateway: {flag} {address}: {exc}")
    sock.set_inheritable(True)
    return sock


class _Child:
    def __init__(self, index: int, public: socket.socket, hub: socket.socket, http: tuple[str, int] | None,
                 ready: pathlib.Path) -> None:
        self.index = index
        self.public = public
        self.hub = hub
        self.http = http
        self.ready = ready
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, object] | None = None
        self.started_at = 0.0
        self.backoff = _MIN_BACKOFF_S
        self.restart_at: float | None = None
        self.restarts = 0

    def details(self) -> dict[str, object]:
        info = self.info or {}
        return {"index": self.index, "pid": self.proc.pid if self.proc else None,
                "hub_port": info.get("hub_port"), "http_port": info.get("http_port"), "restarts": self.restarts}


def _child_argv(args: argparse.Namespace, port: int, child: _Child) -> list[str]:
    """The command line of one child: the parent's gateway flags, its sockets, and its own
    metrics and ready-file addresses."""
    tls = ["--cert", str(args.cert), "--key", str(args.key)] if args.cert else ["--insecure-plain-ws"]
    hub_host, hub_port = child.hub.getsockname()[:2]
    argv = [sys.executable, "-m", "relay", "gateway", "--listen", hostport_text(args.listen[0], port), *tls,
            "--hub-token-file", str(args.hub_token_file), "--listen-fd", str(child.public.fileno()),
            "--hub-listen", hostport_text(hub_host, hub_port), "--hub-fd", str(child.hub.fileno()),
            "--ready-file", str(child.ready),
            "--handshake-timeout", repr(args.handshake_timeout), "--max-message-bytes", str(args.max_message_bytes),
            "--max-unpaired", str(args.max_unpaired), "--max-sessions", str(args.max_sessions),
            "--max-sessions-per-address", str(args.max_sessions_per_address),
            "--max-buffered-bytes", str(args.max_buffered_bytes), "--message-deadline", repr(args.message_deadline),
            "--keepalive", repr(args.keepalive), "--idle-timeout", repr(args.idle_timeout),
            "--max-new-per-ip", repr(args.max_new_per_ip), "--log-level", args.log_level]
    if child.http is not None:
        argv += ["--http", hostport_text(*child.http)]
    return argv


def supervise(args: argparse.Namespace) -> int:
    """Run ``args.processes`` gateway children until SIGTERM/SIGINT; the exit status (a
    child's, when one fails before all listen: its line was printed above)."""
    configure_logging("gateway", level=args.log_level)
    n = args.processes
    if args.hub_listen is None:
        fail(f"gateway: --processes {n} needs --hub-listen HOST:PORT: a hub must reach each process at an address "
             "of its own (process i listens on PORT+i; hubs take one --gateway per process)")
    if not args.cert and not args.insecure_plain_ws:
        fail("gateway: give --cert and --key (kvasir certs makes a development pair), or --insecure-plain-ws "
             "behind a TLS terminator")
    hub_host, hub_port = args.hub_listen
    if hub_port and hub_port + n - 1 > 65535:
        fail(f"gateway: --hub-listen: ports {hub_port}..{hub_port + n - 1} for {n} processes pass 65535")
    if args.http is not None and args.http[1]:
        from kvasir_rpc import ListenError, check_listen

        for i in range(n):
            try:
                check_listen(hostport_text(args.http[0], args.http[1] + i))
            except ListenError as exc:
                fail(exc.line("gateway", "--http"))
    host, port = args.listen
    publics: list[socket.socket] = []
    for _ in range(n):  # port 0: the first picks it, the others join it
        publics.append(_listening(host, port, "--listen", reuse_port=True))
        port = publics[0].getsockname()[1]
    hubs = [_listening(hub_host, hub_port + i if hub_port else 0, "--hub-listen", reuse_port=False) for i in range(n)]
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        if not stopping:
            log.info("gateway stopping", signal=signal.Signals(signum).name)
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with tempfile.TemporaryDirectory(prefix="kvasir-gateway-") as tmp:
        children = [_Child(i, publics[i], hubs[i],
                           None if args.http is None else (args.http[0], args.http[1] + i if args.http[1] else 0),
                           pathlib.Path(tmp) / f"child{i}.json") for i in range(n)]

        def spawn(child: _Child) -> None:
            child.ready.unlink(missing_ok=True)
            child.info = None
            # Children stop on the parent's SIGTERM only: a Ctrl-C in a terminal reaches the
            # whole process group, and the parent then stops them itself, in order.
            child.proc = subprocess.Popen(_child_argv(args, port, child), stdin=subprocess.DEVNULL,
                                          start_new_session=True, preexec_fn=_die_with_parent,
                                          pass_fds=(child.public.fileno(), child.hub.fileno()))
            child.started_at = time.monotonic()
            child.restart_at = None

        def publish() -> None:
            first = children[0].details()
            write_ready_file(args.ready_file, {"port": port, "http_port": first["http_port"],
                                               "hub_port": first["hub_port"], "pid": os.getpid(), "processes": n,
                                               "children": [c.details() for c in children]})

        try:
            for child in children:
                spawn(child)
            deadline = time.monotonic() + _START_TIMEOUT_S
            while not stopping and any(c.info is None for c in children):
                for child in children:
                    assert child.proc is not None
                    if child.info is None and child.ready.exists():
                        child.info = json.loads(child.ready.read_text())
                    elif child.proc.poll() is not None:
                        log.error("a gateway process ended before it listened (its line above)", index=child.index,
                                  exit_code=child.proc.returncode)
                        return child.proc.returncode or 1
                if time.monotonic() > deadline:
                    fail(f"gateway: not every process listened within {_START_TIMEOUT_S:g} s")
                time.sleep(_POLL_S)
            if stopping:
                return 0
            publish()
            log.info("gateway listening", address=hostport_text(args.listen[0], port), processes=n,
                     hub_addresses=[hostport_text(*c.hub.getsockname()[:2]) for c in children])
            while not stopping:
                _watch(children, spawn, publish)
                time.sleep(_POLL_S)
            return 0
        finally:
            _stop_all(children)
            for sock in (*publics, *hubs):
                sock.close()


def _die_with_parent() -> None:
    """In a child, before it runs: SIGTERM when the parent dies (Linux), so a parent killed
    without its chance to stop them leaves no gateway process behind holding the port."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the parent's SIGTERM is the only stop


def _watch(children: list[_Child], spawn, publish) -> None:  # type: ignore[no-untyped-def]
    """One round of supervision: schedule the restart of a child that died (with backoff),
    restart those whose time has come, and publish a restarted child once it listens."""
    now = time.monotonic()
    for child in children:
        proc = child.proc
        assert proc is not None
        if child.restart_at is None and proc.poll() is not None:
            lived = now - child.started_at
            child.backoff = _MIN_BACKOFF_S if lived > _HEALTHY_S else min(child.backoff * 2, _MAX_BACKOFF_S)
            child.restart_at = now + child.backoff
            log.warning("a gateway process ended; restarting it", index=child.index, pid=proc.pid,
                        exit_code=proc.returncode, lived_s=round(lived, 1), restart_in_s=child.backoff)
        elif child.restart_at is not None and now >= child.restart_at:
            child.restarts += 1
            spawn(child)
        elif child.info is None and child.restart_at is None and child.ready.exists():
            child.info = json.loads(child.ready.read_text())
            log.info("gateway process restarted", index=child.index, pid=proc.pid)
            publish()


def _stop_all(children: list[_Child]) -> None:
    """SIGTERM every live child, then SIGKILL those still running after the deadline."""
    live = [c.proc for c in children if c.proc is not None and c.proc.poll() is None]
    for proc in live:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    for proc in live:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
