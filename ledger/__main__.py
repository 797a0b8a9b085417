"""python -m ledger serve --listen HOST:PORT --db URL --trust-key HEX [--trust-key HEX ...]
                         [--rate-nano-per-byte 7] [--ready-file PATH]
python -m ledger bench --db URL [-n N] [--batch B] [--submitters S]

A mistake the operator must fix before starting again (a port in use, a database that cannot
be opened) ends the command with one line naming the flag and the fix, and exit status 2."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import signal
import threading
from types import FrameType

from kvasir_rpc import (
    STATE_DIR,
    HelpFormatter,
    add_log_level,
    configure_logging,
    fail,
    get_logger,
    hostport,
    hostport_text,
    make_state_parent,
    run_main,
    write_ready_file,
)

DEFAULT_DB = f"sqlite:///{STATE_DIR / 'ledger.db'}"


def _listen(text: str) -> str:
    return hostport_text(*hostport()(text))



def _hub_key(text: str) -> str:
    from kvasir_rpc import is_address

    if not is_address(text):
        raise argparse.ArgumentTypeError(f"a hub key is 64 lowercase hex characters, got {text[:80]!r}")
    return text


def run_serve(args: argparse.Namespace) -> int:
    from kvasir_rpc import ListenError, check_listen
    from ledger._open import open_store
    from ledger._service import serve_ledger
    from ledger._store import StoreError

    configure_logging("ledger", level=args.log_level)
    log = get_logger("ledger")
    for flag, address in (("--listen", args.listen), ("--http", hostport_text(*args.http) if args.http else None)):
        if address is None:
            continue
        try:
            check_listen(address)  # before the database: a second ledger must not touch it
        except ListenError as exc:
            fail(exc.line("ledger", flag))
    if args.db == DEFAULT_DB:
        try:
            make_state_parent(pathlib.Path(DEFAULT_DB.removeprefix("sqlite:///")))
        except OSError as exc:
            fail(f"ledger: --db {args.db}: cannot make its folder ({exc.strerror or exc}): run from a writable "
                 "folder or give --db")
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("ledger stopping", signal=signal.Signals(signum).name)
        stop.set()

    # Installed before anything slow, so a SIGTERM during start-up still stops us cleanly.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        store = open_store(args.db, pool_size=args.workers)
    except StoreError as exc:
        fail(f"ledger: --db {_redact(args.db)}: {exc}: check the URL (sqlite:///PATH or postgresql://...) and "
             "that the database is reachable and this ledger's")
    try:
        metrics = stop_metrics = http_port = None
        if args.http is not None:
            from kvasir_rpc import as_listen_error, serve_metrics
            from ledger._http import BALANCE_PREFIX, balance_app
            from ledger._metrics import LedgerMetrics

            metrics = LedgerMetrics(store)
            try:
                stop_metrics, http_port = serve_metrics(metrics.registry, *args.http,
                                                        routes={BALANCE_PREFIX: balance_app(store)})
            except OSError as exc:  # taken since check_listen
                err = as_listen_error(hostport_text(*args.http), exc)
                fail(err.line("ledger", "--http") if err is not None else f"ledger: --http: {exc}")
        try:
            server, port, health = serve_ledger(args.listen, store, args.trust_key, args.rate_nano_per_byte,
                                                max_workers=args.workers, metrics=metrics)
        except ListenError as exc:  # taken since check_listen
            fail(exc.line("ledger", "--listen"))
        except (OSError, ValueError) as exc:
            fail(f"ledger: cannot serve on --listen {args.listen}: {exc}")
        log.info("ledger listening", address=args.listen, port=port, db=_redact(args.db),
                 trusted_hubs=len(set(args.trust_key)), rate_nano_per_byte=args.rate_nano_per_byte,
                 metrics=f"http://{hostport_text(args.http[0], http_port)}/metrics" if http_port else None)
        write_ready_file(args.ready_file, {"port": port, "http_port": http_port})
        while not stop.wait(1.0):
            pass
        health.enter_graceful_shutdown()
        # In-flight batches finish (and commit) within the grace; later calls get UNAVAILABLE.
        server.stop(grace=3.0).wait(5.0)
        log.info("ledger stopped", **dataclasses.asdict(store.statistics()))
    finally:
        if stop_metrics is not None:
            stop_metrics()
        store.close()
    return 0


def _redact(url: str) -> str:
    # postgresql://user:secret@host/db -> postgresql://user:***@host/db
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if sep and at and ":" in creds:
        return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}"
    return url


def run_bench(args: argparse.Namespace) -> int:
    from ledger._bench import bench_receipts

    configure_logging("ledger-bench", level="warning")
    rate = bench_receipts(args.db, args.n, batch_size=args.batch, submitters=args.submitters)
    print(json.dumps({"db": _redact(args.db), "receipts": args.n, "batch_size": args.batch,
                      "submitters": args.submitters, "receipts_per_s": round(rate, 1)}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line, every sub-command's arguments with their help and defaults."""
    parser = argparse.ArgumentParser(prog="python -m ledger", formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, help="what to run")
    serve = sub.add_parser("serve", help="serve LedgerService (gRPC, reflection, health)", formatter_class=HelpFormatter)
    serve.add_argument("--listen", type=_listen, default="127.0.0.1:8767", metavar="HOST:PORT",
                       help="gRPC address (port 0: any free port)")
    serve.add_argument("--db", default=DEFAULT_DB,
                       help="sqlite:///PATH (a relative PATH; sqlite:////PATH for an absolute one) or "
                            "postgresql://USER@HOST:PORT/DB")
    serve.add_argument("--trust-key", type=_hub_key, action="append", required=True,
                       help="a hub's Ed25519 public key (64 hex) whose receipts count; repeat for more hubs")
    serve.add_argument("--rate-nano-per-byte", type=int, default=7, help="nano-KVR per byte (7 = 0.007 KVR per 10^6 bytes)")
    serve.add_argument("--http", type=hostport(), metavar="HOST:PORT",
                       help="serve Prometheus metrics at http://HOST:PORT/metrics (totals only, no wallet addresses) "
                            "and a wallet's balance as JSON at /v1/balance/WALLET, readable by a web page on any "
                            "origin (port 0: any free port, written to --ready-file as http_port); off without it")
    serve.add_argument("--ready-file", type=pathlib.Path,
                       help="write {port, http_port} here (atomically) once listening")
    serve.add_argument("--workers", type=int, default=8, help="concurrent calls, and database connections")
    add_log_level(serve, "info")
    serve.set_defaults(func=run_serve)
    bench = sub.add_parser("bench", help="durable credited receipts per second through the gRPC service",
                           formatter_class=HelpFormatter)
    bench.add_argument("--db", required=True, help="a scratch database URL (the benchmark adds credits to it)")
    bench.add_argument("-n", type=int, default=5000, help="receipts in all")
    bench.add_argument("--batch", type=int, default=100, help="receipts per SubmitReceipts call")
    bench.add_argument("--submitters", type=int, default=1, help="concurrent hubs")
    bench.set_defaults(func=run_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve" and not 1 <= args.rate_nano_per_byte <= 1000:
        parser.error("--rate-nano-per-byte must be 1 to 1000")
    return int(args.func(args))


if __name__ == "__main__":
    run_main("ledger", main)
