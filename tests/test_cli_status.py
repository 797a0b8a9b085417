"""``kvasir status`` and ``kvasir balance`` against real processes: what a terminal shows of a
live hub and a ledger, and one line with exit status 2 for a peer that is not there or a
wallet that is not one."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
from helpers import ROOT, LedgerProcess
from test_ledger import CREDITED, HUB, receipt

from kvasir.swarm import free_port
from kvasir_rpc import Wallet, ledger_pb2, ledger_pb2_grpc

pytestmark = pytest.mark.integration


def kvasir(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvasir", *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, stdin=subprocess.DEVNULL)


def test_status_lists_the_hubs_sessions_and_the_experts_they_serve(two_worker_swarm):
    sw = two_worker_swarm
    shown = kvasir("status", "--hub", sw.hub_grpc_address)
    assert shown.returncode == 0, shown.stderr
    assert f"hub {sw.hub_grpc_address}: 2 live sessions" in shown.stdout
    for s in sw.list_sessions():
        line = next(x for x in shown.stdout.splitlines() if s.session_id in x)
        assert s.wallet[:16] in line and "4 experts in 4 layers" not in line and "16 experts in 4 layers" in line
        assert " direct " in line and " rows)" in line and "credited 0.000000000 KVR" in line  # no ledger here
    assert [x.strip() for x in shown.stdout.splitlines() if x.strip().startswith("layer")] == \
           [f"layer {i}: experts 0-7 served" for i in range(4)]
    as_json = json.loads(kvasir("status", "--hub", sw.hub_grpc_address, "--json").stdout)
    assert sorted(s["session_id"] for s in as_json["sessions"]) == sorted(s.session_id for s in sw.list_sessions())


def test_balance_shows_what_the_ledger_credited_and_bad_input_gets_one_line(ledger: LedgerProcess, tmp_path):
    ledger.keys = [HUB.address]
    ledger.start()
    try:
        wallet_file = tmp_path / "w.key"
        wallet = Wallet.load_or_create(wallet_file)
        with grpc.insecure_channel(ledger.address) as ch:
            resp = ledger_pb2_grpc.LedgerServiceStub(ch).SubmitReceipts(ledger_pb2.SubmitReceiptsRequest(
                receipts=[receipt(HUB, "s1", wallet.address, 1, 1_277_952)]), timeout=10)
        assert resp.results[0].status == CREDITED
        by_file = kvasir("balance", "--ledger", ledger.address, "--wallet-file", str(wallet_file))
        assert by_file.returncode == 0, by_file.stderr
        assert by_file.stdout.strip() == (f"wallet {wallet.address}: 0.008945664 KVR pending (8,945,664 nano-KVR) "
                                          "for 1,277,952 bytes of work (1.277952 units) in 1 credits")
        as_json = json.loads(kvasir("balance", "--ledger", ledger.address, "--wallet", wallet.address, "--json").stdout)
        assert as_json["pending_nano_kvr"] == 8_945_664 and as_json["credit_count"] == 1
        bad = kvasir("balance", "--ledger", ledger.address, "--wallet", "not-a-wallet")
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "64 hex characters" in bad.stderr
        missing = kvasir("balance", "--ledger", ledger.address, "--wallet-file", str(tmp_path / "nope.key"))
        assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no such wallet file" in missing.stderr
    finally:
        ledger.stop()
    nobody = f"127.0.0.1:{free_port()}"
    for args, what in ((("balance", "--ledger", nobody, "--wallet", wallet.address), "the ledger"),
                       (("status", "--hub", nobody), "the hub")):
        out = kvasir(*args, "--timeout", "2")
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert f"cannot reach {what} at {nobody}" in out.stderr
