"""The ledger's balance over plain HTTP (``--http``: ``GET /v1/balance/<wallet>`` beside
``/metrics``), what a worker in a web page reads to show the KVR credited to its wallet.

Fast: the WSGI route on a real HTTP server in-process over a real SQLite file (every answer:
the JSON of GetBalance, CORS, bad wallets, other methods, other paths), and the server's cap on
connections held open by a client that sends nothing. Integration: a real ``python -m ledger
serve --http`` process credits receipts over gRPC and answers the same balance over HTTP."""

from __future__ import annotations

import http.client
import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from helpers import wait_until
from prometheus_client import CollectorRegistry

from kvasir_rpc import Wallet, ledger_pb2, ledger_pb2_grpc, serve_metrics, sign_receipt
from ledger import LedgerStore, open_store

ROOT = pathlib.Path(__file__).resolve().parent.parent
HTTP_TIMEOUT_S = 10.0
RATE = 7
HUB = Wallet.generate()
FIELDS = {"wallet", "pendingNanoKvr", "pendingKvr", "bytesCredited", "units", "creditCount"}


def _receipt(session: str, wallet: str, seq: int, cumulative: int) -> ledger_pb2.SignedReceipt:
    return sign_receipt(HUB, ledger_pb2.ByteReceipt(
        hub_key=HUB.address, session_id=session, wallet=wallet, seq=seq, cumulative_bytes=cumulative,
        issued_at_unix_ms=1_700_000_000_000 + seq,
    ))


def _get(url: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


@pytest.fixture
def served(tmp_path: pathlib.Path) -> Iterator[tuple[str, LedgerStore]]:
    from ledger._http import BALANCE_PREFIX, balance_app

    with open_store(f"sqlite:///{tmp_path / 'ledger.db'}") as store:
        stop, port = serve_metrics(CollectorRegistry(), "127.0.0.1", 0, routes={BALANCE_PREFIX: balance_app(store)})
        try:
            yield f"http://127.0.0.1:{port}", store
        finally:
            stop()


def test_a_balance_reads_as_the_json_of_get_balance_from_any_origin(served) -> None:  # type: ignore[no-untyped-def]
    base, store = served
    w = Wallet.generate().address
    store.submit([_receipt("s1-http", w, seq, seq * 255_590 + (seq == 5) * 2) for seq in range(1, 6)],
                 frozenset({HUB.address}), RATE)
    status, headers, body = _get(f"{base}/v1/balance/{w}")
    assert status == 200 and headers["content-type"] == "application/json"
    assert headers["access-control-allow-origin"] == "*" and headers["cache-control"] == "no-store"
    got = json.loads(body)
    assert got == {"wallet": w, "pendingNanoKvr": "8945664", "pendingKvr": "0.008945664",
                   "bytesCredited": "1277952", "units": "1.277952", "creditCount": "5"}
    # A wallet never credited: every field present, zero.
    status, _, body = _get(f"{base}/v1/balance/{'0' * 64}")
    assert status == 200 and json.loads(body) == {
        "wallet": "0" * 64, "pendingNanoKvr": "0", "pendingKvr": "0.000000000", "bytesCredited": "0",
        "units": "0.000000", "creditCount": "0"}
    # HEAD: the headers alone; a CORS preflight: allowed, no body.
    status, headers, body = _get(f"{base}/v1/balance/{w}", "HEAD")
    assert (status, body) == (200, b"") and headers["access-control-allow-origin"] == "*"
    status, headers, body = _get(f"{base}/v1/balance/{w}", "OPTIONS")
    assert (status, body) == (204, b"") and "GET" in headers["access-control-allow-methods"]
    # The metrics are still where they were.
    status, headers, _ = _get(f"{base}/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize(("path", "method", "code", "says"), [
    ("/v1/balance/ABC", "GET", 400, "64 lowercase hex"),
    (f"/v1/balance/{'A' * 64}", "GET", 400, "64 lowercase hex"),
    ("/v1/balance/", "GET", 400, "64 lowercase hex"),
    (f"/v1/balance/{'x' * 5000}", "GET", 400, "64 lowercase hex"),
    (f"/v1/balance/{'0' * 64}/credits", "GET", 400, "64 lowercase hex"),
    (f"/v1/balance/{'0' * 64}", "POST", 405, "GET /v1/balance/"),
    (f"/v1/balance/{'0' * 64}", "DELETE", 405, "GET /v1/balance/"),
    ("/v1/balances", "GET", 404, "/v1/balance/"),
    ("/", "GET", 404, "/metrics"),
])
def test_bad_requests_get_a_precise_answer_and_change_nothing(served, path, method, code, says) -> None:  # type: ignore[no-untyped-def]
    base, store = served
    status, headers, body = _get(f"{base}{path}", method)
    assert status == code and says in body.decode()
    assert len(body) < 300  # a stranger's 5000 characters are not echoed back
    if code == 405:
        assert "GET" in headers["allow"]
    assert store.statistics().batches == 0  # nothing written


def test_clients_that_connect_and_send_nothing_hold_at_most_the_cap(served) -> None:  # type: ignore[no-untyped-def]
    """A page's balance read is public: a client that opens many connections and sends nothing
    holds at most MAX_HTTP_CONNECTIONS threads; the ones past the cap are closed unanswered at
    once, and reads work again as soon as the idle ones go."""
    from kvasir_rpc._metrics import MAX_HTTP_CONNECTIONS

    base, _ = served
    port = int(base.rsplit(":", 1)[1])
    threads_before = threading.active_count()
    idle: list[socket.socket] = []
    try:
        for _ in range(MAX_HTTP_CONNECTIONS):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=HTTP_TIMEOUT_S))
        # Each accepted connection has its thread once the server has accepted it.
        wait_until(lambda: threading.active_count() >= threads_before + MAX_HTTP_CONNECTIONS, HTTP_TIMEOUT_S,
                   "the server to accept the idle connections")
        extra = [socket.create_connection(("127.0.0.1", port), timeout=HTTP_TIMEOUT_S) for _ in range(40)]
        idle += extra
        for s in extra:  # closed unanswered: end of stream (or a reset), long before the 10 s timeout
            s.settimeout(HTTP_TIMEOUT_S / 2)
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
        assert threading.active_count() <= threads_before + MAX_HTTP_CONNECTIONS
    finally:
        for s in idle:
            s.close()

    def reads() -> bool:  # the idle ones' threads see their clients go and end
        try:
            return _get(f"{base}/v1/balance/{'0' * 64}")[0] == 200
        except (ConnectionError, http.client.RemoteDisconnected, urllib.error.URLError):
            return False

    wait_until(reads, HTTP_TIMEOUT_S, "reads to come back once the idle connections closed")


@pytest.mark.integration
def test_a_ledger_process_serves_over_http_the_balance_grpc_credits(tmp_path: pathlib.Path) -> None:
    ready = tmp_path / "ready.json"
    log = open(tmp_path / "ledger.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ledger", "serve", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
         "--db", f"sqlite:///{tmp_path / 'ledger.db'}", "--trust-key", HUB.address, "--ready-file", str(ready)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"))
    log.close()
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, 30, "the ledger to say it listens")
        assert proc.poll() is None, (tmp_path / "ledger.log").read_text()
        info = json.loads(ready.read_text())
        base = f"http://127.0.0.1:{info['http_port']}"
        w = Wallet.generate().address
        with grpc.insecure_channel(f"127.0.0.1:{info['port']}") as channel:
            stub = ledger_pb2_grpc.LedgerServiceStub(channel)
            before = json.loads(_get(f"{base}/v1/balance/{w}")[2])
            assert before["creditCount"] == "0"
            stub.SubmitReceipts(ledger_pb2.SubmitReceiptsRequest(
                receipts=[_receipt("s1-proc", w, 1, 1_000_003), _receipt("s1-proc", w, 2, 2_500_000)]), timeout=10)
            grpc_balance = stub.GetBalance(ledger_pb2.GetBalanceRequest(wallet=w), timeout=10)
        status, headers, body = _get(f"{base}/v1/balance/{w}")
        got = json.loads(body)
        assert status == 200 and set(got) == FIELDS and headers["access-control-allow-origin"] == "*"
        assert got["pendingKvr"] == grpc_balance.pending_kvr and int(got["pendingNanoKvr"]) == 2_500_000 * RATE
        assert int(got["bytesCredited"]) == grpc_balance.bytes_credited == 2_500_000
        assert int(got["creditCount"]) == grpc_balance.credit_count == 2
    finally:
        proc.terminate()
        try:
            assert proc.wait(15) == 0, (tmp_path / "ledger.log").read_text()
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
            raise
