"""Throughput of the ledger: durable credited receipts per second through the gRPC service."""

from __future__ import annotations

import secrets
import threading
import time

import grpc

from kvasir_rpc import Wallet, ledger_pb2, ledger_pb2_grpc, sign_receipt
from ledger._open import open_store
from ledger._service import MAX_BATCH, create_server

__all__ = ["bench_receipts"]


def _signed_batches(key: Wallet, n: int, batch_size: int, sessions: int) -> list[ledger_pb2.SubmitReceiptsRequest]:
    # Receipts of `sessions` sessions interleaved, each session's seq rising: what a hub
    # with many workers sends. Signed before the clock starts; signing is the hub's cost.
    tag = secrets.token_hex(4)
    wallets = [Wallet.generate().address for _ in range(sessions)]
    now = time.time_ns() // 1_000_000
    signed = []
    for i in range(n):
        s = i % sessions
        seq = i // sessions + 1
        receipt = ledger_pb2.ByteReceipt(
            hub_key=key.address, session_id=f"bench-{tag}-{s}", wallet=wallets[s], seq=seq,
            cumulative_bytes=seq * 65536, issued_at_unix_ms=now,
        )
        signed.append(sign_receipt(key, receipt))
    return [ledger_pb2.SubmitReceiptsRequest(receipts=signed[i : i + batch_size]) for i in range(0, n, batch_size)]


def bench_receipts(
    store_url: str,
    n: int = 5000,
    *,
    batch_size: int = 100,
    submitters: int = 1,
    sessions_per_submitter: int = 16,
    timeout_s: float = 60.0,
) -> float:
    """Credit ``n`` fresh receipts through a ledger server on 127.0.0.1 backed by
    ``store_url`` and return credited receipts per second (committed before each answer).

    ``submitters`` hubs, each with its own key, send ``batch_size`` receipts per call, one
    call in flight each. The database keeps the credits (use a scratch one). Raises
    RuntimeError if any receipt is not CREDITED, grpc.RpcError on a failed call (each call
    has a ``timeout_s`` deadline), ValueError for arguments out of range.
    """
    if n < 1 or not 1 <= batch_size <= MAX_BATCH or submitters < 1:
        raise ValueError(f"need n >= 1, 1 <= batch_size <= {MAX_BATCH}, submitters >= 1")
    keys = [Wallet.generate() for _ in range(submitters)]
    per = [n // submitters + (i < n % submitters) for i in range(submitters)]
    work = [_signed_batches(k, m, batch_size, sessions_per_submitter) for k, m in zip(keys, per) if m]
    store = open_store(store_url, pool_size=max(2, submitters))
    server, port = create_server("127.0.0.1:0", store, [k.address for k in keys], 7, max_workers=max(2, submitters))
    errors: list[BaseException] = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=10)
            stub = ledger_pb2_grpc.LedgerServiceStub(channel)
            stub.GetBalance(ledger_pb2.GetBalanceRequest(wallet="0" * 64), timeout=timeout_s)  # warm the pool

            def submit(batches: list[ledger_pb2.SubmitReceiptsRequest]) -> None:
                try:
                    for req in batches:
                        resp = stub.SubmitReceipts(req, timeout=timeout_s)
                        bad = [r for r in resp.results if r.status != ledger_pb2.RECEIPT_STATUS_CREDITED]
                        if bad:
                            raise RuntimeError(f"{len(bad)} receipts not credited, first: {bad[0]}")
                except BaseException as exc:  # reported by the caller's thread
                    errors.append(exc)

            threads = [threading.Thread(target=submit, args=(w,), daemon=True) for w in work]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout_s * (len(work[0]) + 1))
            elapsed = time.perf_counter() - start
        if errors:
            raise errors[0]
        if any(t.is_alive() for t in threads):
            raise RuntimeError("a submitter did not finish in time")
        return n / elapsed
    finally:
        server.stop(None)
        store.close()
