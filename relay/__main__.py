"""python -m relay hub --listen HOST:PORT --grpc HOST:PORT [--key PATH]"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import sys

import trio

from kvasir_rpc import Wallet, configure_logging, get_logger
from relay._hub import HubConfig, create_session_server, serve_hub
from relay._registry import SessionRegistry


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relay", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    hub = sub.add_parser("hub", help="the LAN hub: worker tunnels in, backbone gRPC targets out")
    hub.add_argument("--listen", type=_hostport, default=("127.0.0.1", 8765), help="WebSocket address for workers")
    hub.add_argument("--grpc", type=_hostport, default=("127.0.0.1", 8766), help="SessionService address; per-session targets bind on its host")
    hub.add_argument("--key", type=pathlib.Path, default=pathlib.Path("hub.key"), help="hub Ed25519 key file (created if missing)")
    hub.add_argument("--ready-file", type=pathlib.Path, help="write {ws_port, grpc_port, hub_key} here once listening")
    hub.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)

    configure_logging("hub", level=args.log_level)
    log = get_logger("relay")
    key = Wallet.load_or_create(args.key)
    registry = SessionRegistry()
    grpc_host, grpc_port = args.grpc
    server, bound_grpc = create_session_server(registry, f"{grpc_host}:{grpc_port}")
    config = HubConfig(listen_host=args.listen[0], listen_port=args.listen[1], grpc_host=grpc_host)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            ws_port = await nursery.start(serve_hub, config, key, registry)
            ready = {"ws_port": ws_port, "grpc_port": bound_grpc, "hub_key": key.address}
            log.info("hub listening", ws=f"{config.listen_host}:{ws_port}", grpc=f"{grpc_host}:{bound_grpc}", hub_key=key.address)
            if args.ready_file:
                tmp = args.ready_file.with_suffix(".tmp")
                tmp.write_text(json.dumps(ready))
                tmp.replace(args.ready_file)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    log.info("hub stopping")
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(run)
    finally:
        registry.close_watchers()
        server.stop(grace=1.0).wait(2.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
