"""``python -m backbone serve``: the backbone as a server (gRPC, and HTTP with ``--http``)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType

from kvasir_rpc import ListenError, check_listen, fail, get_logger, hostport_text, write_ready_file

log = get_logger("backbone.serve")


def run_serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from backbone.cli._setup import build_setup

    if args.max_batch < 1 or args.max_waiting < 0 or args.lanes < 1:
        parser.error("--max-batch and --lanes must be at least 1, --max-waiting at least 0")
    if args.lanes > args.max_batch:
        parser.error("--lanes cannot exceed --max-batch (each lane holds at least one request)")
    if args.max_tokens_limit is not None and args.max_tokens_limit < 1:
        parser.error("--max-tokens-limit must be at least 1")
    if args.max_prompt_bytes is not None and args.max_prompt_bytes < 1:
        parser.error("--max-prompt-bytes must be at least 1")
    if not args.http_timeout > 0:
        parser.error("--http-timeout must be a positive number of seconds")
    refusal = auth_refusal(args.listen, args.http, api_key_file=args.api_key_file is not None, no_auth=args.no_auth)
    if refusal is not None:
        fail(f"backbone: {refusal}")
    for option, address in (("--listen", args.listen), ("--http", args.http)):
        if address is None:
            continue
        try:
            check_listen(address)  # before the model loads: a taken port fails at once
        except ListenError as exc:
            fail(f"backbone: {option}: {exc}")
    api_key = ""
    if args.api_key_file is not None:
        from kvasir_rpc import TokenError, load_or_create_token

        try:
            api_key = load_or_create_token(args.api_key_file)
        except (TokenError, OSError) as exc:
            fail(f"backbone: --api-key-file: {exc}")
    else:
        for address in (args.listen, args.http):
            if address is not None and not _loopback(address):
                log.warning("serving beyond this machine with --no-auth: anyone who reaches it may call",
                            address=address)
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("backbone stopping", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    setup = build_setup(parser, args, kind="serve")
    if isinstance(setup, int):
        return setup
    from backbone.engine._batch import Engine
    from backbone.service._grpc_api import Backbone, serve_backbone

    result: dict[str, object] = {}
    engine = Engine(setup.model, setup.tokenizer, setup.dispatcher, max_batch=args.max_batch,
                    max_waiting=args.max_waiting, lanes=args.lanes, max_tokens_cap=args.max_tokens_limit)
    setup.dispatcher.measure_load_with(engine.load)
    backbone = Backbone(engine=engine, tokenizer=setup.tokenizer, dispatcher=setup.dispatcher,
                        model_id=args.model_name or args.model.resolve().name, api_key=api_key,
                        max_prompt_bytes=args.max_prompt_bytes or 0)
    http = server = None
    try:
        try:
            server, port, health = serve_backbone(args.listen, backbone)
        except ListenError as exc:
            fail(f"backbone: --listen: {exc}")
        http_port = None
        if args.http:
            from backbone.service._http_api import serve_http

            try:
                http = serve_http(backbone, args.http, timeout_s=args.http_timeout)
            except ListenError as exc:
                fail(f"backbone: --http: {exc}")
            http_port = http.port
        log.info("backbone serving", grpc=port, http=http_port, model=backbone.model_id,
                 max_batch=args.max_batch, lanes=args.lanes, remote=setup.watcher is not None,
                 max_prompt_bytes=backbone.max_prompt_bytes)
        write_ready_file(args.ready_file, {"grpc_port": port, "http_port": http_port, "model": backbone.model_id})
        # One line a person sees whatever the log level: where to call it, and on what.
        where = f"the workers of the hub at {args.hub}" if setup.watcher is not None else "every expert here"
        api = f"; the OpenAI API at http://{hostport_text(_host(args.http), http_port)}/v1" if http_port else ""
        print(f"backbone: serving {backbone.model_id} ({where}): kvasir.v1.BackboneService on "
              f"{hostport_text(_host(args.listen), port)}{api}; Ctrl-C stops it", file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass
        health.enter_graceful_shutdown()
    finally:
        # In this order: no new HTTP requests, running requests end with UNAVAILABLE, gRPC
        # stops, then the experts path reports its work to the hub.
        if http is not None:
            http.close()
        engine.close()
        if server is not None:
            server.stop(grace=2.0).wait(5.0)
        setup.close(result)
    log.info("backbone stopped", work_reported=result.get("work_reported"))
    return 0


def auth_refusal(listen: str | None, http: str | None, *, api_key_file: bool, no_auth: bool) -> str | None:
    """Why ``serve`` must not start with these options (a line naming the flag and the fix),
    or None: an address beyond loopback needs --api-key-file, or --no-auth said outright."""
    if api_key_file and no_auth:
        return "--no-auth and --api-key-file contradict each other: give one of them"
    if api_key_file or no_auth:
        return None
    for option, address in (("--listen", listen), ("--http", http)):
        if address is not None and not _loopback(address):
            return (f"{option} {address} is beyond loopback, where anyone who reaches it could generate: give "
                    "--api-key-file FILE (callers then send the key in FILE as a bearer token; it is created if "
                    "missing), or --no-auth to serve without a key")
    return None


def _loopback(address: str) -> bool:
    """Whether ``HOST:PORT`` listens on this machine only: a loopback IP or ``localhost``
    (any other name, an empty host or a wildcard counts as beyond)."""
    import ipaddress

    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def _host(address: str) -> str:
    """The host of a HOST:PORT flag (an IPv6 one without its brackets)."""
    return address.rsplit(":", 1)[0].strip("[]")
