"""python -m worker (--hub ws://HOST:PORT | --gateway wss://HOST:PORT) --model DIR --experts SPEC --wallet PATH
[--hub-key HEX] [--e2e auto|require] [--device auto|cpu|cuda|mps] [--sessions N]"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import pathlib
import shutil
import signal
import ssl
import sys
import tempfile
import time
from concurrent import futures

import grpc
import trio

from kvasir_rpc import (
    NO_PORT_SHARING,
    CheckpointError,
    ListenError,
    SpecError,
    Wallet,
    WorkerHandshake,
    __version__,
    bind_grpc,
    check_listen,
    configure_logging,
    enable_reflection,
    expert_pb2,
    expert_pb2_grpc,
    format_slices,
    get_logger,
    is_address,
)
from worker._load import load_experts
from worker._service import ExpertServicer
from worker._tunnel import TunnelHolder, run_tunnel

log = get_logger("worker")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker", description="Serve expert slices to a Kvasir hub.")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--hub", help="ws://HOST:PORT of a hub on this LAN")
    where.add_argument("--gateway", help="wss://HOST:PORT of a public gateway (port 443 passes most NATs)")
    p.add_argument("--ca-file", type=pathlib.Path, help="CA bundle to verify the gateway (default: system trust)")
    p.add_argument("--model", required=True, type=pathlib.Path, help="Hugging Face checkpoint folder")
    p.add_argument("--experts", default="all", help="slices to serve: all, 0-3:0-15, *:0-7, comma-separated")
    p.add_argument("--wallet", required=True, type=pathlib.Path, help="Ed25519 wallet file (created if missing)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    p.add_argument("--threads", type=int, default=int(os.environ.get("KVASIR_THREADS", "0")) or None,
                   help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--sessions", type=int, default=1,
                   help="hold N sessions from this one process (one tunnel each, one gRPC server behind them), "
                        "the slices of --experts split among them in order so each announces its own share; "
                        "the hub's --max-sessions-per-wallet applies to them (default 1)")
    p.add_argument("--drain-timeout", type=float, default=10.0, help="seconds to finish in-flight calls on SIGTERM")
    p.add_argument("--direct-grpc", metavar="HOST:PORT",
                   help="also serve ExpertService on this TCP address, without the tunnel (benchmarks, "
                        "trusted LANs); off by default: the worker opens no listening socket")
    p.add_argument("--hub-key", metavar="HEX",
                   help="the hub's public key (64 hex characters, in its ready file and its 'hub listening' log "
                        "line): serve only that hub; without it, whoever answers the dial as a hub is served")
    p.add_argument("--e2e", choices=["auto", "require"],
                   help="require: refuse a session whose tunnel is not encrypted end to end (default with "
                        "--gateway); auto: take what the hub chooses (default with --hub)")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    if args.hub_key is not None and not is_address(args.hub_key):
        p.error("--hub-key must be 64 lowercase hex characters (the hub's Ed25519 public key)")
    require_e2e = (args.e2e or ("require" if args.gateway else "auto")) == "require"
    configure_logging("worker", level=args.log_level)
    if args.sessions < 1:
        p.error("--sessions must be at least 1")
    if args.direct_grpc:
        try:
            check_listen(args.direct_grpc)  # now, not after minutes of loading experts
        except ListenError as exc:
            print(f"worker: {exc}", file=sys.stderr)
            return 1
    from kvasir_rpc import install_fast_masking

    install_fast_masking()

    import torch

    from kvasir_rpc import threads_initializer

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        wallet = Wallet.load_or_create(args.wallet)
        experts = load_experts(args.model, args.experts, args.device)
        shares = experts.shares(args.sessions)
    except (CheckpointError, SpecError, ValueError, OSError) as exc:
        print(f"worker: {exc}", file=sys.stderr)
        return 2
    log.info(
        "experts loaded",
        wallet=wallet.address,
        slices=format_slices(experts.slices),
        device=str(experts.device),
        digest=experts.weights_digest.hex(),
        sessions=args.sessions,
    )

    # The gRPC server listens on a Unix socket in a private folder: no TCP or UDP listener.
    sock_dir = tempfile.mkdtemp(prefix="kvasir-worker-")
    os.chmod(sock_dir, 0o700)
    uds_path = os.path.join(sock_dir, "expert.sock")
    servicer = ExpertServicer(experts, wallet.address)
    server = grpc.server(
        # Carry --threads into the pool's threads (see threads_initializer). A backbone keeps
        # one Dispatch stream open per session, and each holds a thread for its life.
        futures.ThreadPoolExecutor(max_workers=7 + args.sessions, thread_name_prefix="expert",
                                   initializer=threads_initializer()),
        options=[("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20),
                 NO_PORT_SHARING],
    )
    expert_pb2_grpc.add_ExpertServiceServicer_to_server(servicer, server)
    # Reflection reaches only those who reach the server: the key holder through the hub's target.
    enable_reflection(server, [expert_pb2.DESCRIPTOR.services_by_name["ExpertService"].full_name])
    try:
        bind_grpc(server, f"unix:{uds_path}")
        if args.direct_grpc:
            # Opt-in, for benchmarks and trusted LANs: the one case where the worker listens.
            bind_grpc(server, args.direct_grpc)
    except ListenError as exc:
        print(f"worker: {exc}", file=sys.stderr)
        shutil.rmtree(sock_dir, ignore_errors=True)
        return 1
    server.start()

    def make_handshake(slices: dict[int, tuple[int, ...]], digest: bytes) -> WorkerHandshake:
        return WorkerHandshake(
            wallet,
            slices=slices,
            weights_digest=digest,
            device=str(experts.device),
            model_type=experts.model_type,
            worker_version=__version__,
            expected_hub_key=args.hub_key,
            require_encryption=require_e2e,
        )

    holders = [TunnelHolder() for _ in shares]
    if args.gateway:
        if not args.gateway.startswith(("wss://", "ws://")):
            print("worker: --gateway must be a wss:// URL", file=sys.stderr)
            return 2
        url = args.gateway.rstrip("/") + "/v1/worker"
        if args.hub_key is None:
            log.warning("no --hub-key: the gateway (or anyone in front of it) could stand in for the hub and be "
                        "served; pin the hub's key to serve only it")
        ssl_context = (ssl.create_default_context(cafile=str(args.ca_file) if args.ca_file else None)
                       if url.startswith("wss://") else None)
    else:
        url, ssl_context = args.hub, None

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            for (slices, digest), holder in zip(shares, holders):
                nursery.start_soon(functools.partial(run_tunnel, url, functools.partial(make_handshake, slices, digest),
                                                     uds_path, holder=holder, ssl_context=ssl_context))
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("draining", signal=signal.Signals(signum).name)
                    t0 = time.monotonic()
                    drained = await trio.to_thread.run_sync(servicer.drain, args.drain_timeout)
                    # Let the answers just computed cross the tunnel before streams are cut.
                    await trio.sleep(0.2)
                    await trio.to_thread.run_sync(lambda: server.stop(grace=1.0).wait(3.0))
                    log.info("drained", in_time=drained, seconds=round(time.monotonic() - t0, 3),
                             calls=servicer.calls, rows=servicer.rows)
                    async with trio.open_nursery() as closing:
                        for holder in holders:
                            closing.start_soon(holder.close)
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(run)
    finally:
        server.stop(grace=None)
        shutil.rmtree(sock_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    code = main()
    # On the way out: the interpreter's last collection walks every object torch and
    # transformers made, for seconds, to free memory the OS takes back at exit anyway.
    # Frozen objects are skipped; the rest of shutdown (atexit, flushing) is as usual.
    gc.freeze()
    sys.exit(code)
