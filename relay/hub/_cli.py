"""``python -m relay hub``: its flags, and the composition root that builds the hub from them
(key, token, registry, contribution store, receipt loop, work desk, gRPC server, status page,
gateway links) and runs it until a signal."""

from __future__ import annotations

import argparse
import functools
import pathlib
import ssl
from typing import Any

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
    write_ready_file,
)
from kvasir_rpc.protocol import MAX_TUNNEL_CHANNELS
from relay._cli import check_listen_flags, read_token, start_listening, until_signal

__all__ = ["add_hub_command", "run_hub"]


def add_hub_command(sub: Any) -> None:
    """``hub``'s arguments, on the sub-command parsers ``sub``."""
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
                          "a layer or expert outside it are refused (close 4102)")
    hub.add_argument("--layers", type=int, help="the model's layer count, instead of --model (with --experts)")
    hub.add_argument("--experts", type=int, help="the model's experts per layer, instead of --model (with --layers)")
    hub.add_argument("--max-sessions-per-wallet", type=int, default=4,
                     help="live sessions one wallet may hold (more are refused with close 4202, retried)")
    hub.add_argument("--max-sessions-per-address", type=int, default=32,
                     help="live sessions from one address, IPv6 by /64 (more are refused with close 4203, retried); through a "
                          "gateway, the worker's address the gateway reports")
    hub.add_argument("--session-burst-per-address", type=float, default=32, metavar="N",
                     help="new sessions one address (IPv6 by /64; through a gateway, the worker's address) may "
                          "start at once, counted in new wallets: a wallet without work here that the backbone "
                          "accepted counts 1, one quarantined here in the last 30 days 4, a returning wallet with a "
                          "clean record (or a further session of a wallet already connected) 1/2; beyond it close "
                          "4205 says how long to wait, and a quarantine charges the liar's address 4")
    hub.add_argument("--sessions-per-minute-per-address", type=float, default=6, metavar="N",
                     help="how fast an address's --session-burst-per-address refills, in new wallets a minute")
    hub.add_argument("--session-burst", type=float, default=256, metavar="N",
                     help="new sessions the whole hub admits at once, counted as for --session-burst-per-address "
                          "except that a returning wallet (or a further session) counts 0, so strangers cannot keep "
                          "out the workers that already serve the hub")
    hub.add_argument("--sessions-per-minute", type=float, default=60, metavar="N",
                     help="how fast --session-burst refills, in new wallets a minute")
    hub.add_argument("--max-sessions", type=int, default=1024,
                     help="live sessions in all, direct and through a gateway (more: HTTP 503 or close 4204)")
    hub.add_argument("--max-pending", type=int, default=64,
                     help="direct connections waiting for their hello to be verified (more: HTTP 503)")
    hub.add_argument("--max-buffered-bytes", type=int, default=256 << 20,
                     help="bytes of unfinished messages on direct connections, in all (more: close 4208)")
    hub.add_argument("--message-deadline", type=float, default=30.0,
                     help="seconds a message may stay unfinished on a direct connection (then close 4209)")
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
    token = read_token("hub", "--gateway-token-file", args.gateway_token_file,
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
    check_listen_flags("hub", ("--grpc", grpc_address), ("--listen", ws_address),
                  *([("--http", http_address)] if http_address else []))
    token, gateway_ssl = _gateway_link(args) if args.gateway else ("", None)
    key, backbone_token = _hub_state(args)
    registry = SessionRegistry()
    from relay.hub._contributions import ContributionStore, ContributionStoreError
    from relay.hub._receipts import ReceiptSender
    from relay.hub._work_desk import WorkDesk

    try:
        store = ContributionStore(args.contrib_db)
        ended = store.end_open_sessions()
        desk = WorkDesk(registry, store, key, quarantine_s=args.quarantine_seconds)  # reads the bans
    except ContributionStoreError as exc:
        fail(f"hub: --contrib-db: {exc}; point --contrib-db at this hub's database, or at a new path to start one")
    if ended:
        log.info("sessions of a previous run closed; their receipts will be sent", sessions=ended)
    sender = ReceiptSender(store, registry, key, args.ledger, interval_s=args.receipt_interval)
    registry.on_removed.append(sender.session_ended)
    try:
        server, bound_grpc = create_session_server(registry, grpc_address, backbone_token=backbone_token, desk=desk)
    except (OSError, RuntimeError) as exc:  # taken since check_listen_flags
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
            nursery.start_soon(until_signal, nursery, log, "hub")
            nursery.start_soon(sender.run)
            ws_port = await start_listening(nursery, failed, "hub", "--listen", ws_address, functools.partial(
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
                http_port = await start_listening(nursery, failed, "hub", "--http", http_address, serve_hub_http,
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

