"""python -m relay hub --listen HOST:PORT --grpc HOST:PORT [--key PATH] [--backbone-token-file PATH]
    [--model DIR | --layers N --experts M] [--gateway wss://HOST:PORT ...]
python -m relay gateway --listen HOST:PORT --cert PEM --key PEM --hub-token-file FILE

A mistake the operator must fix before starting again (a flag, a missing or unreadable file,
a port in use or needing privileges, a gateway that refuses the hub's token or whose
certificate is not trusted) ends the command with one line naming the flag and the fix, and
exit status 2 (kvasir_rpc.fail)."""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import signal
import ssl
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from kvasir_rpc import (
    BACKBONE_TOKEN_FILE,
    STATE_DIR,
    HelpFormatter,
    add_log_level,
    configure_logging,
    fail,
    get_logger,
    hostport,
    hostport_text,
    install_fast_masking,
    make_state_parent,
    run_main,
    write_ready_file,
)
from kvasir_rpc.protocol import MAX_TUNNEL_CHANNELS

if TYPE_CHECKING:
    from relay.gateway._gateway import Gateway


def _new_token_hint(path: pathlib.Path) -> str:
    return f"(umask 077; head -c 32 /dev/urandom | base64 > {path})"


def _read_token(component: str, flag: str, path: pathlib.Path, fix: str) -> str:
    """The token in ``path``, or the end of the program with one line naming ``flag`` and ``fix``."""
    from kvasir_rpc import TokenError, load_token

    try:
        return load_token(path)
    except TokenError as exc:
        fail(f"{component}: {flag}: {exc}: {fix}")


def _check_listen(component: str, *flag_addresses: tuple[str, str]) -> None:
    """Stop with one line naming the flag (exit 2) when an address cannot be listened on (in
    use, needing privileges, not on this machine): before any file or database is touched,
    so a second copy started by mistake changes nothing of the first's."""
    from kvasir_rpc import ListenError, check_listen

    for flag, address in flag_addresses:
        try:
            check_listen(address)
        except ListenError as exc:
            fail(exc.line(component, flag))


async def _start_listening(nursery: trio.Nursery, failed: list[str], component: str, flag: str, address: str,
                           serve, *args):  # type: ignore[no-untyped-def]
    """``await nursery.start(serve, *args)``. When ``address`` cannot be bound (taken since
    ``_check_listen``) the line to show goes to ``failed``, the nursery is cancelled and
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


async def _until_signal(nursery: trio.Nursery, log, what: str) -> None:  # type: ignore[no-untyped-def]
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            log.info(f"{what} stopping")
            nursery.cancel_scope.cancel()
            return


def _model_shape(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The model the hub serves, from --model (its config.json) or --layers/--experts; None
    when neither is given."""
    from kvasir_rpc import ModelShape, read_model_shape

    if args.model is not None:
        if args.layers is not None or args.experts is not None:
            fail("hub: --model and --layers/--experts are exclusive: give one")
        try:
            return read_model_shape(args.model)
        except ValueError as exc:
            fail(f"hub: --model: {exc}: give the model's checkpoint folder (only its config.json is read)")
    if (args.layers is None) != (args.experts is None):
        fail("hub: --layers and --experts go together: give both, or --model instead")
    if args.layers is None:
        return None
    try:
        return ModelShape(layers=args.layers, experts=args.experts)
    except ValueError as exc:
        fail(f"hub: --layers/--experts: {exc}")


def _hub_state(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The hub's key and backbone token (each created when missing, under .kvasir/ by
    default), or the end of the program with one line naming the flag."""
    from kvasir_rpc import TokenError, Wallet, WalletError, load_or_create_token

    for flag, path in (("--key", args.key), ("--backbone-token-file", args.backbone_token_file),
                       ("--contrib-db", args.contrib_db)):
        try:
            make_state_parent(path)
        except OSError as exc:
            fail(f"hub: {flag} {path}: cannot make its folder ({exc.strerror or exc}): choose a writable place")
    try:
        key = Wallet.load_or_create(args.key)
    except (WalletError, OSError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        fail(f"hub: --key {args.key}: {why}: point --key at this hub's key file, or at a new path to make one")
    try:
        backbone_token = load_or_create_token(args.backbone_token_file)
    except (TokenError, OSError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        fail(f"hub: --backbone-token-file {args.backbone_token_file}: {why}: fix or delete the file (a new one is "
             "made when missing), or point --backbone-token-file elsewhere")
    return key, backbone_token


def _gateway_link(args: argparse.Namespace) -> tuple[str, ssl.SSLContext | None]:
    """The token and TLS context for every --gateway (checked: the URLs, the token file, the
    CA file), or the end of the program with one line naming the flag."""
    import urllib.parse

    schemes = set()
    for url in args.gateway:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("wss", "ws") or not parts.hostname:
            fail(f"hub: --gateway {url}: a gateway's address is wss://HOST:PORT (ws:// only behind a TLS terminator)")
        schemes.add(parts.scheme)
    if args.gateway_token_file is None:
        fail("hub: --gateway needs --gateway-token-file: a copy of the file the gateway reads with --hub-token-file")
    token = _read_token("hub", "--gateway-token-file", args.gateway_token_file,
                        "copy here the file the gateway reads with --hub-token-file")
    if "wss" not in schemes:
        return token, None
    try:
        return token, ssl.create_default_context(cafile=str(args.ca_file) if args.ca_file else None)
    except (OSError, ssl.SSLError) as exc:
        fail(f"hub: --ca-file {args.ca_file}: {exc.strerror or exc}: give the CA certificate (PEM) that signed "
             "the gateway's certificate (kvasir certs writes ca.pem)")


def _session_rate(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The hub's limiter of new sessions from its four flags, or the end of the program with
    one line naming the flag."""
    from relay.hub._admission import SessionRate, SessionRateLimits

    for flag, value in (("--session-burst-per-address", args.session_burst_per_address),
                        ("--session-burst", args.session_burst)):
        if not value >= 1:
            fail(f"hub: {flag} must be at least 1 new wallet (got {value:g})")
    for flag, value in (("--sessions-per-minute-per-address", args.sessions_per_minute_per_address),
                        ("--sessions-per-minute", args.sessions_per_minute)):
        if not value > 0:
            fail(f"hub: {flag} must be more than 0 (got {value:g}); give a large value to make it no limit")
    return SessionRate(SessionRateLimits(
        address_burst=args.session_burst_per_address, address_per_minute=args.sessions_per_minute_per_address,
        hub_burst=args.session_burst, hub_per_minute=args.sessions_per_minute))


def run_hub(args: argparse.Namespace) -> int:
    from kvasir_rpc import as_listen_error, leaf_exception
    from relay.hub._gateway_link import GatewayRefused
    from relay.hub._registry import SessionRegistry
    from relay.hub._sessions import HubConfig, create_session_server, serve_hub

    configure_logging("hub", level=args.log_level)
    install_fast_masking()
    log = get_logger("relay")
    shape = _model_shape(args)
    for flag, value in (("--max-sessions-per-wallet", args.max_sessions_per_wallet),
                        ("--max-sessions-per-address", args.max_sessions_per_address),
                        ("--max-sessions", args.max_sessions), ("--max-pending", args.max_pending),
                        ("--max-buffered-bytes", args.max_buffered_bytes),
                        ("--backbones-per-worker", args.backbones_per_worker)):
        if value < 1:
            fail(f"hub: {flag} must be at least 1 (got {value})")
    if args.backbones_per_worker > MAX_TUNNEL_CHANNELS:
        fail(f"hub: --backbones-per-worker is at most {MAX_TUNNEL_CHANNELS} (got {args.backbones_per_worker})")
    if not (args.move_check >= 0 and args.move_min_age >= 0):
        fail(f"hub: --move-check and --move-min-age are 0 or more seconds (got {args.move_check:g}, "
             f"{args.move_min_age:g})")
    if not args.message_deadline > 0:
        fail(f"hub: --message-deadline must be more than 0 seconds (got {args.message_deadline:g})")
    rate = _session_rate(args)
    grpc_host, grpc_port = args.grpc
    ws_address, grpc_address = hostport_text(*args.listen), hostport_text(grpc_host, grpc_port)
    http_address = hostport_text(*args.http) if args.http else None
    _check_listen("hub", ("--grpc", grpc_address), ("--listen", ws_address),
                  *([("--http", http_address)] if http_address else []))
    token, gateway_ssl = _gateway_link(args) if args.gateway else ("", None)
    key, backbone_token = _hub_state(args)
    registry = SessionRegistry()
    import sqlite3

    from relay.hub._contributions import ContributionStore
    from relay.hub._receipts import ReceiptSender

    try:
        store = ContributionStore(args.contrib_db)
    except sqlite3.Error as exc:
        fail(f"hub: --contrib-db {args.contrib_db}: {exc}: point --contrib-db at this hub's database, "
             "or at a new path to start one")
    ended = store.end_open_sessions()
    if ended:
        log.info("sessions of a previous run closed; their receipts will be sent", sessions=ended)
    sender = ReceiptSender(store, registry, key, args.ledger, interval_s=args.receipt_interval)
    registry.on_removed.append(sender.session_ended)
    from relay.hub._work_desk import WorkDesk

    desk = WorkDesk(registry, store, key, quarantine_s=args.quarantine_seconds)
    try:
        server, bound_grpc = create_session_server(registry, grpc_address, backbone_token=backbone_token, desk=desk)
    except (OSError, RuntimeError) as exc:  # taken since _check_listen
        store.close()
        err = as_listen_error(grpc_address, exc)
        if err is None:
            raise
        fail(err.line("hub", "--grpc"))
    config = HubConfig(listen_host=args.listen[0], listen_port=args.listen[1], grpc_host=grpc_host,
                       gateway_urls=tuple(args.gateway or ()), gateway_token=token, gateway_ssl=gateway_ssl,
                       keepalive_s=args.keepalive, keepalive_timeout_s=args.keepalive_timeout,
                       backbone_token=backbone_token, target_auth_timeout_s=args.target_auth_timeout,
                       model_shape=shape, max_sessions_per_wallet=args.max_sessions_per_wallet,
                       max_sessions_per_address=args.max_sessions_per_address, max_sessions=args.max_sessions,
                       max_pending=args.max_pending, max_buffered_bytes=args.max_buffered_bytes,
                       message_deadline_s=args.message_deadline, e2e=args.e2e,
                       tunnel_channels=args.backbones_per_worker, move_check_s=args.move_check,
                       move_min_age_s=args.move_min_age)

    failed: list[str] = []

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            # Watching for SIGTERM/SIGINT from the start: listening may wait on a gateway's first
            # answer (up to its connect timeout), and a stop meanwhile is still a clean one.
            nursery.start_soon(_until_signal, nursery, log, "hub")
            nursery.start_soon(sender.run)
            ws_port = await _start_listening(nursery, failed, "hub", "--listen", ws_address, functools.partial(
                serve_hub, rate=rate, history=store.wallet_history), config, key, registry)
            if ws_port is None:
                return
            http_port = None
            if http_address is not None:
                from relay.hub._http import HubCollector, hub_metrics, serve_hub_http
                from relay.hub._status import StatusBoard

                board = StatusBoard(registry, hub_key=key.address, shape=shape, desk=desk.statistics,
                                    sender=sender.statistics)
                metrics = hub_metrics(registry, HubCollector(registry, desk=desk.statistics,
                                                             sender=sender.statistics, rate=rate.statistics))
                http_port = await _start_listening(nursery, failed, "hub", "--http", http_address, serve_hub_http,
                                                   http_address, board, metrics)
                if http_port is None:
                    return
            log.info("hub listening", ws=f"{config.listen_host}:{ws_port}", grpc=f"{grpc_host}:{bound_grpc}",
                     hub_key=key.address, gateway=args.gateway, e2e=args.e2e, http=http_port,
                     model=f"{shape.layers} layers x {shape.experts} experts" if shape else "any (protocol bounds)")
            write_ready_file(args.ready_file, {"ws_port": ws_port, "grpc_port": bound_grpc, "hub_key": key.address,
                                               "http_port": http_port})

    try:
        try:
            trio.run(run)
        except* GatewayRefused as eg:  # a wrong token or an untrusted certificate: retrying cannot help
            failed.append(str(leaf_exception(eg)))
    finally:
        registry.close_watchers()
        server.stop(grace=1.0).wait(2.0)
        try:
            # Sessions that ended after the receipt loop's last flush: their final counters.
            sender.close()
        finally:
            store.close()
    if failed:
        fail(failed[0])
    return 0


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
    except OSError as exc:  # taken since _check_listen
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
    _check_listen("gateway", *([] if child else [("--listen", address)]),
                  *([("--hub-listen", hostport_text(*args.hub_listen))] if args.hub_listen and not child else []),
                  *([("--http", hostport_text(*args.http))] if args.http else []))
    token = _read_token("gateway", "--hub-token-file", args.hub_token_file,
                        f"make one with {_new_token_hint(args.hub_token_file)} and give hubs a copy "
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
            started = await _start_listening(nursery, failed, "gateway", flag, address, serve_gateway, config)
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
            await _until_signal(nursery, log, "gateway")

    stops: list[Callable[[], None]] = []
    try:
        trio.run(run)
    finally:
        for stop in stops:
            stop()
    if failed:
        fail(failed[0])
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line, every sub-command's arguments with their help and defaults."""
    parser = argparse.ArgumentParser(prog="python -m relay", formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, help="which service to run")
    hub = sub.add_parser("hub", help="the LAN hub: worker tunnels in, backbone gRPC targets out",
                         formatter_class=HelpFormatter)
    hub.add_argument("--listen", type=hostport(8765), default="127.0.0.1:8765", metavar="HOST:PORT",
                     help="WebSocket address for LAN workers (port 0: any free port)")
    hub.add_argument("--grpc", type=hostport(8766), default="127.0.0.1:8766", metavar="HOST:PORT",
                     help="SessionService address; per-session targets bind on its host")
    hub.add_argument("--key", type=pathlib.Path, default=STATE_DIR / "hub.key",
                     help="hub Ed25519 key (created, mode 0600, if missing)")
    hub.add_argument("--backbone-token-file", type=pathlib.Path, default=BACKBONE_TOKEN_FILE,
                     help="the secret the backbone presents (created, mode 0600, if missing); the backbone's "
                          "--hub-token-file reads the same file by default")
    hub.add_argument("--target-auth-timeout", type=float, default=10.0,
                     help="seconds a connection to a session's target has to present its key")
    hub.add_argument("--model", type=pathlib.Path,
                     help="checkpoint folder of the model served (only its config.json is read): hellos announcing "
                          "a layer or expert outside it are refused (1008)")
    hub.add_argument("--layers", type=int, help="the model's layer count, instead of --model (with --experts)")
    hub.add_argument("--experts", type=int, help="the model's experts per layer, instead of --model (with --layers)")
    hub.add_argument("--max-sessions-per-wallet", type=int, default=4,
                     help="live sessions one wallet may hold (more are refused with 1013)")
    hub.add_argument("--max-sessions-per-address", type=int, default=32,
                     help="live sessions from one address, IPv6 by /64 (more are refused with 1013); through a "
                          "gateway, the worker's address the gateway reports")
    hub.add_argument("--session-burst-per-address", type=float, default=32, metavar="N",
                     help="new sessions one address (IPv6 by /64; through a gateway, the worker's address) may "
                          "start at once, counted in new wallets: a wallet without work here that the backbone "
                          "accepted counts 1, one quarantined here in the last 30 days 4, a returning wallet with a "
                          "clean record (or a further session of a wallet already connected) 1/2; beyond it close "
                          "1013 says how long to wait, and a quarantine charges the liar's address 4")
    hub.add_argument("--sessions-per-minute-per-address", type=float, default=6, metavar="N",
                     help="how fast an address's --session-burst-per-address refills, in new wallets a minute")
    hub.add_argument("--session-burst", type=float, default=256, metavar="N",
                     help="new sessions the whole hub admits at once, counted as for --session-burst-per-address "
                          "except that a returning wallet (or a further session) counts 0, so strangers cannot keep "
                          "out the workers that already serve the hub")
    hub.add_argument("--sessions-per-minute", type=float, default=60, metavar="N",
                     help="how fast --session-burst refills, in new wallets a minute")
    hub.add_argument("--max-sessions", type=int, default=1024,
                     help="live sessions in all, direct and through a gateway (more: HTTP 503 or close 1013)")
    hub.add_argument("--max-pending", type=int, default=64,
                     help="direct connections waiting for their hello to be verified (more: HTTP 503)")
    hub.add_argument("--max-buffered-bytes", type=int, default=256 << 20,
                     help="bytes of unfinished messages on direct connections, in all (more: close 1013)")
    hub.add_argument("--message-deadline", type=float, default=30.0,
                     help="seconds a message may stay unfinished on a direct connection (then close 1008)")
    hub.add_argument("--gateway", action="append", metavar="URL",
                     help="wss://HOST:PORT of a public gateway to take sessions from; repeat it for several gateway "
                          "hosts, or for each process of a gateway run with --processes (at its --hub-listen ports): "
                          "one control connection each")
    hub.add_argument("--gateway-token-file", type=pathlib.Path, help="file holding the gateway's hub token")
    hub.add_argument("--ca-file", type=pathlib.Path, help="CA bundle to verify the gateway (default: system trust)")
    hub.add_argument("--ledger", metavar="HOST:PORT", help="LedgerService to deliver signed byte receipts to")
    hub.add_argument("--contrib-db", type=pathlib.Path, default=STATE_DIR / "hub-contrib.sqlite",
                     help="SQLite file of per-session byte counters and receipts (survives restarts)")
    hub.add_argument("--receipt-interval", type=float, default=2.0, help="seconds between receipts")
    hub.add_argument("--keepalive", type=float, default=15.0,
                     help="check each worker this often (seconds): a sealed heartbeat on an encrypted session, "
                          "a WebSocket ping otherwise")
    hub.add_argument("--keepalive-timeout", type=float, default=10.0,
                     help="drop a session (close 1001) whose worker does not answer within this many seconds")
    hub.add_argument("--quarantine-seconds", type=float, default=24 * 3600.0,
                     help="how long a wallet caught delivering wrong work is refused")
    hub.add_argument("--backbones-per-worker", type=int, default=8, metavar="N",
                     help="backbone connections one worker's session carries at once, for workers that offer "
                          "it (a multiplexed tunnel); more are answered RESOURCE_EXHAUSTED, saying so; 1: one at "
                          "a time (default 8)")
    hub.add_argument("--move-check", type=float, default=30.0, metavar="SECONDS",
                     help="how often to look for an --experts auto worker to move to experts the backbones use "
                          "and no worker holds (one whose experts are all held elsewhere too); 0: never")
    hub.add_argument("--move-min-age", type=float, default=60.0, metavar="SECONDS",
                     help="how long a worker's session is left where it is before it may be asked to move")
    hub.add_argument("--e2e", choices=["auto", "on", "off"], default="auto",
                     help="encrypt hub <-> worker tunnels end to end, so a gateway (or an edge in front of it) "
                          "relays only ciphertext: auto for every session through a gateway and for "
                          "direct workers that require it; on: every session; off: none")
    hub.add_argument("--http", type=hostport(), metavar="HOST:PORT",
                     help="serve the live status page (/), its JSON (/api/status) and Prometheus metrics (/metrics) "
                          "here, read-only (port 0 picks one); off without it")
    hub.add_argument("--ready-file", type=pathlib.Path,
                     help="write {ws_port, grpc_port, hub_key, http_port} here once listening")
    add_log_level(hub, "info")
    hub.set_defaults(func=run_hub)
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
                    help="bytes of unfinished messages held over all connections (a fragment past it: close 1013)")
    gw.add_argument("--message-deadline", type=float, default=30.0,
                    help="seconds from a message's first fragment to its last (later: close 1008)")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "gateway" and bool(args.cert) != bool(args.key):
        parser.error("--cert and --key go together")
    if args.command == "gateway":
        for flag in ("max_sessions_per_address", "max_buffered_bytes", "message_deadline"):
            if getattr(args, flag) <= 0:
                parser.error(f"--{flag.replace('_', '-')} must be positive")
    return int(args.func(args))


if __name__ == "__main__":
    run_main("relay", main)
