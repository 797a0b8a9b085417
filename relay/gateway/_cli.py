"""``python -m relay gateway``: its flags, their checks, and the composition root that builds
the gateway (one process or N on one port) and runs it until a signal."""

from __future__ import annotations

import argparse
import os
import pathlib
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from kvasir_rpc import (
    HelpFormatter,
    add_log_level,
    configure_logging,
    fail,
    get_logger,
    hostport,
    hostport_text,
    install_fast_masking,
    write_ready_file,
)
from relay._cli import check_listen_flags, new_token_hint, read_token, start_listening, until_signal

if TYPE_CHECKING:
    from relay.gateway._gateway import Gateway

__all__ = ["add_gateway_command", "check_gateway_args", "run_gateway"]


def add_gateway_command(sub: Any) -> None:
    """``gateway``'s arguments, on the sub-command parsers ``sub``."""
    gw = sub.add_parser("gateway", help="the public gateway: workers and hubs both dial out to it",
                        formatter_class=HelpFormatter)
    gw.add_argument("--listen", type=hostport(443), default="0.0.0.0:443", metavar="HOST:PORT",
                    help="public address (ports below 1024 need privileges: see the README's \"Through a public "
                         "gateway\"; port 0: any free port)")
    gw.add_argument("--cert", type=pathlib.Path, help="certificate chain (PEM)")
    gw.add_argument("--key", type=pathlib.Path, help="private key (PEM)")
    gw.add_argument("--insecure-plain-ws", action="store_true", help="serve ws:// (only behind a TLS terminator)")
    gw.add_argument("--hub-token-file", type=pathlib.Path, required=True, help="file holding the token hubs present")
    gw.add_argument("--handshake-timeout", type=float, default=10.0, help="seconds for TLS + HTTP upgrade")
    gw.add_argument("--max-message-bytes", type=int, default=4 << 20, help="larger messages are closed with 1009")
    gw.add_argument("--max-unpaired", type=int, default=64, help="workers waiting for a hub at once")
    gw.add_argument("--max-sessions", type=int, default=1024, help="live spliced sessions, workers waiting for a hub included")
    gw.add_argument("--max-sessions-per-address", type=int, default=32,
                    help="sessions (waiting or spliced) one source address may hold; an IPv6 /64 is one address "
                         "(more: HTTP 429)")
    gw.add_argument("--max-buffered-bytes", type=int, default=256 << 20,
                    help="bytes of unfinished messages held over all connections (a fragment past it: close 4208)")
    gw.add_argument("--message-deadline", type=float, default=30.0,
                    help="seconds from a message's first fragment to its last (later: close 4209)")
    gw.add_argument("--keepalive", type=float, default=20.0, help="ping a silent peer after this many seconds")
    gw.add_argument("--idle-timeout", type=float, default=120.0,
                    help="close a peer silent this long (1001); once a worker is paired, only its own traffic and "
                         "the hub's end-to-end checks (pings, or sealed heartbeats) count, so keep this above the hub's "
                         "--keepalive")
    gw.add_argument("--max-new-per-ip", type=float, default=50.0, help="new connections per source address per second")
    gw.add_argument("--http", type=hostport(), metavar="HOST:PORT",
                    help="serve Prometheus metrics at http://HOST:PORT/metrics (port 0: any free port, written to "
                         "--ready-file as http_port); off without it. Counters only, no addresses: still, keep it "
                         "on a private network")
    gw.add_argument("--processes", type=int, default=1,
                    help="serve with this many processes sharing the --listen port (SO_REUSEPORT: the kernel spreads "
                         "workers over them), under a parent that restarts one that dies; needs --hub-listen. Limits "
                         "apply per process; each serves its own --http (PORT+i)")
    gw.add_argument("--hub-listen", type=hostport(), metavar="HOST:PORT",
                    help="an address of its own for hubs (hub paths are still served on --listen with one process); "
                         "with --processes N process i listens on PORT+i (port 0: any free port, in --ready-file) and "
                         "hubs take one --gateway per process")
    gw.add_argument("--listen-fd", type=int, metavar="FD",
                    help="serve this inherited listening socket instead of binding --listen (set by --processes for "
                         "each of its processes; hub paths are then refused on it, 421)")
    gw.add_argument("--hub-fd", type=int, metavar="FD",
                    help="serve hubs on this inherited listening socket instead of binding --hub-listen (set by "
                         "--processes)")
    gw.add_argument("--ready-file", type=pathlib.Path,
                    help="write {port, http_port, hub_port, pid} here once listening; with --processes also "
                         "children: [{index, pid, hub_port, http_port}], once all listen")
    add_log_level(gw, "info")
    gw.set_defaults(func=run_gateway)


def check_gateway_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What the parser cannot check alone: ends the command with parser.error."""
    if bool(args.cert) != bool(args.key):
        parser.error("--cert and --key go together")
    for flag in ("max_sessions_per_address", "max_buffered_bytes", "message_deadline"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive")


def _start_gateway_metrics(gw: Gateway, http: tuple[str, int], stops: list[Callable[[], None]],
                           failed: list[str]) -> int | None:
    """Serve the gateway's /metrics on ``http``; the bound port, or None (the line to show
    in ``failed``). Called on the loop: each scrape reads the statistics there."""
    from kvasir_rpc import as_listen_error, serve_metrics
    from relay.gateway._metrics import gateway_registry

    token = trio.lowlevel.current_trio_token()
    registry = gateway_registry(lambda: trio.from_thread.run_sync(gw.statistics, trio_token=token))
    try:
        stop, port = serve_metrics(registry, *http)
    except OSError as exc:  # taken since check_listen_flags
        err = as_listen_error(hostport_text(*http), exc)
        failed.append(err.line("gateway", "--http") if err is not None else f"gateway: --http: {exc}")
        return None
    stops.append(stop)
    return port


def run_gateway(args: argparse.Namespace) -> int:
    from kvasir_rpc import check_secret_mode
    from relay.gateway._gateway import GatewayConfig, serve_gateway

    if args.processes < 1:
        fail(f"gateway: --processes must be at least 1 (got {args.processes})")
    if args.processes > 1:
        from relay.gateway._processes import supervise

        return supervise(args)
    configure_logging("gateway", level=args.log_level)
    install_fast_masking()
    log = get_logger("relay")
    address = hostport_text(*args.listen)
    if not args.cert and not args.insecure_plain_ws:
        fail("gateway: give --cert and --key (kvasir certs makes a development pair), or --insecure-plain-ws "
             "behind a TLS terminator")
    # A process of several (--processes) serves listening sockets its parent made and holds.
    child = args.listen_fd is not None
    check_listen_flags("gateway", *([] if child else [("--listen", address)]),
                  *([("--hub-listen", hostport_text(*args.hub_listen))] if args.hub_listen and not child else []),
                  *([("--http", hostport_text(*args.http))] if args.http else []))
    token = read_token("gateway", "--hub-token-file", args.hub_token_file,
                        f"make one with {new_token_hint(args.hub_token_file)} and give hubs a copy "
                        "(their --gateway-token-file)")
    ctx = None
    if args.cert:
        check_secret_mode(args.key, "TLS key file")
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(str(args.cert), str(args.key))
        except (OSError, ssl.SSLError) as exc:
            fail(f"gateway: --cert {args.cert} / --key {args.key}: {exc.strerror or exc}: give the certificate "
                 "chain and its private key, both PEM (kvasir certs writes gateway.pem and gateway.key)")
        ctx.set_alpn_protocols(["http/1.1"])
    config = GatewayConfig(
        host=args.listen[0], port=args.listen[1], hub_token=token, ssl_context=ctx,
        handshake_timeout_s=args.handshake_timeout, max_message_bytes=args.max_message_bytes,
        max_unpaired=args.max_unpaired, max_sessions=args.max_sessions, keepalive_s=args.keepalive,
        idle_timeout_s=args.idle_timeout, new_connections_per_ip_per_s=args.max_new_per_ip,
        max_sessions_per_address=args.max_sessions_per_address, max_buffered_bytes=args.max_buffered_bytes,
        message_deadline_s=args.message_deadline, shared_port=child, listen_fd=args.listen_fd, hub_fd=args.hub_fd,
        hub_host=args.hub_listen[0] if args.hub_listen else None, hub_port=args.hub_listen[1] if args.hub_listen else None,
    )

    failed: list[str] = []

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            flag = "--listen" if args.hub_listen is None else "--listen/--hub-listen"
            started = await start_listening(nursery, failed, "gateway", flag, address, serve_gateway, config)
            if started is None:
                return
            port, gw = started
            http_port = None
            if args.http is not None:
                http_port = _start_gateway_metrics(gw, args.http, stops, failed)
                if http_port is None:
                    nursery.cancel_scope.cancel()
                    return
            log.info("gateway listening", address=f"{config.host}:{port}", tls=ctx is not None,
                     hub_address=hostport_text(config.hub_host or config.host, gw.hub_port) if gw.hub_port else None,
                     metrics=f"http://{hostport_text(args.http[0], http_port)}/metrics" if http_port else None)
            write_ready_file(args.ready_file, {"port": port, "http_port": http_port, "hub_port": gw.hub_port,
                                               "pid": os.getpid()})
            await until_signal(nursery, log, "gateway")

    stops: list[Callable[[], None]] = []
    try:
        trio.run(run)
    finally:
        for stop in stops:
            stop()
    if failed:
        fail(failed[0])
    return 0

