"""The TypeScript clients (clients/ts) against the real Python servers.

The generated TypeScript must equal what ``buf generate`` makes from proto/ now. Then, per
server group, this module starts the real servers on port 0 (a ledger holding credited
receipts; a hub; a backbone service on the tiny checkpoint) and runs the Node tests of that
group (``clients/ts/test/*.test.ts``, Node's test runner with tsx) against them, passing
addresses and what it put there in ``KVASIR_TS_*`` variables. Node and clients/ts's
node_modules are needed: ``make node-deps`` installs them from the lock file."""

from __future__ import annotations

import filecmp
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import grpc
import pytest
from helpers import LedgerProcess

from kvasir.swarm import LocalSwarm
from kvasir_rpc import Wallet, format_kvr, format_units, ledger_pb2, ledger_pb2_grpc, sign_receipt

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parent.parent
TS = ROOT / "clients" / "ts"
GEN = pathlib.Path("clients/ts/src/gen")
BUF = pathlib.Path(sys.executable).parent / "buf"
# A Node test file's whole run, servers already up; the watch test starts a worker (torch).
NODE_TIMEOUT_S = 180
SERVER_START_TIMEOUT_S = 120.0
# Receipts the ledger credits before Node reads the balance: 1,277,952 bytes in two receipts
# of one session, at the default 7 nano-KVR per byte (0.008945664 KVR, ARCHITECTURE.md).
RECEIPT_COUNTS = (1_000_000, 1_277_952)
RATE_NANO_PER_BYTE = 7


def _need_node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not on PATH: the TypeScript clients' tests need Node.js 20 or later")
    if not (TS / "node_modules" / ".bin" / "protoc-gen-es").exists():
        pytest.fail("clients/ts/node_modules is missing: run `make node-deps` (npm ci in clients/ts)")
    return node


def _files(top: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p.relative_to(top) for p in top.rglob("*") if p.is_file())


def test_generated_typescript_is_fresh(tmp_path: pathlib.Path) -> None:
    _need_node()
    out = subprocess.run([str(BUF), "generate", "--template", "buf.gen.yaml", "-o", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, f"buf generate failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    fresh, committed = tmp_path / GEN, ROOT / GEN
    assert _files(fresh) == _files(committed), "generated TypeScript files differ: run `make proto`"
    stale = [str(p) for p in _files(fresh) if not filecmp.cmp(fresh / p, committed / p, shallow=False)]
    assert not stale, f"stale generated TypeScript {stale}: run `make proto`"


def _run_node(name: str, env: dict[str, str], logs: Sequence[pathlib.Path] = ()) -> None:
    """Run clients/ts/test/NAME.test.ts with ``env`` added; fail with Node's output (and the
    tails of ``logs``) when a test fails or the run passes NODE_TIMEOUT_S."""
    node = _need_node()
    proc = subprocess.Popen([node, "--import", "tsx", "--test", "--test-reporter=spec", f"test/{name}.test.ts"],
                            cwd=TS, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=NODE_TIMEOUT_S)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # Node and anything it started (a worker)
        output, _ = proc.communicate(timeout=10)
        timed_out = True
    text = output.decode(errors="replace")
    if timed_out or proc.returncode != 0:
        tails = "".join(f"\n--- {p} ---\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
        why = f"timed out after {NODE_TIMEOUT_S}s" if timed_out else f"exited with code {proc.returncode}"
        pytest.fail(f"node --test test/{name}.test.ts {why}:\n{text[-8000:]}{tails}", pytrace=False)
    print(text)


# -- LedgerService.GetBalance ------------------------------------------------------------


@pytest.fixture
def credited_ledger(tmp_path: pathlib.Path) -> Iterator[tuple[LedgerProcess, str]]:
    """A ledger process trusting one hub key, with RECEIPT_COUNTS credited to one wallet."""
    work = tmp_path
    hub, wallet = Wallet.generate(), Wallet.generate().address
    ledger = LedgerProcess(work, f"sqlite:///{work / 'ledger.sqlite'}", [hub.address])
    ledger.start(SERVER_START_TIMEOUT_S)
    try:
        receipts = [sign_receipt(hub, ledger_pb2.ByteReceipt(
            hub_key=hub.address, session_id="ts-clients-1", wallet=wallet, seq=seq, cumulative_bytes=count,
            issued_at_unix_ms=int(time.time() * 1000))) for seq, count in enumerate(RECEIPT_COUNTS, start=1)]
        with grpc.insecure_channel(ledger.address) as ch:
            got = ledger_pb2_grpc.LedgerServiceStub(ch).SubmitReceipts(
                ledger_pb2.SubmitReceiptsRequest(receipts=receipts), timeout=30)
        assert [r.status for r in got.results] == [ledger_pb2.RECEIPT_STATUS_CREDITED] * len(receipts), got
        yield ledger, wallet
    finally:
        ledger.stop()


def test_node_reads_a_balance(credited_ledger: tuple[LedgerProcess, str]) -> None:
    ledger, wallet = credited_ledger
    total = RECEIPT_COUNTS[-1]
    nano = total * RATE_NANO_PER_BYTE
    _run_node("ledger", {
        "KVASIR_TS_LEDGER": ledger.address,
        "KVASIR_TS_WALLET": wallet,
        "KVASIR_TS_WALLET_NANO_KVR": str(nano),
        "KVASIR_TS_WALLET_KVR": format_kvr(nano),
        "KVASIR_TS_WALLET_BYTES": str(total),
        "KVASIR_TS_WALLET_UNITS": format_units(total),
        "KVASIR_TS_WALLET_CREDITS": str(len(RECEIPT_COUNTS)),
    }, [ledger.workdir / f"ledger{ledger.starts}.log"])


# -- SessionService.WatchSessions ----------------------------------------------------------


def test_node_watches_a_worker_come_and_go(tmp_path: pathlib.Path, tiny_models) -> None:  # type: ignore[no-untyped-def]
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path) as sw:
        sw.start_hub(timeout=SERVER_START_TIMEOUT_S)
        wallet_file = tmp_path / "ts-worker.wallet"
        wallet = Wallet.load_or_create(wallet_file).address
        # Node starts this worker once its watch is open, and stops it (SIGTERM).
        argv = [sys.executable, "-m", "worker", "--hub", sw.hub_ws_url, "--hub-key", sw.hub_key,
                "--model", str(model), "--experts", "*:0-3", "--wallet", str(wallet_file)]
        worker_log = sw.logs / "ts-worker.log"
        _run_node("sessions", {
            **sw.env,
            "KVASIR_TS_HUB": sw.hub_grpc_address,
            "KVASIR_TS_BACKBONE_TOKEN": sw.backbone_token,
            "KVASIR_TS_WORKER_ARGV": json.dumps(argv),
            "KVASIR_TS_WORKER_LOG": str(worker_log),
            "KVASIR_TS_WORKER_WALLET": wallet,
            "KVASIR_TS_MODEL_TYPE": "qwen3_moe",
            "KVASIR_TS_REPO": str(ROOT),
        }, [worker_log, sw.logs / "hub.log"])
        assert not sw.list_sessions(), "the worker Node started is still connected"


# -- BackboneService.Generate ---------------------------------------------------------------


def test_node_streams_generate(tmp_path: pathlib.Path, tiny_models) -> None:  # type: ignore[no-untyped-def]
    with LocalSwarm(tmp_path) as sw:
        info = sw.start_backbone_service("backbone", tiny_models("qwen3_moe"), hub=False,
                                         timeout=SERVER_START_TIMEOUT_S)
        _run_node("backbone", {"KVASIR_TS_BACKBONE": f"127.0.0.1:{info['grpc_port']}",
                               "KVASIR_TS_BACKBONE_MODEL": str(info["model"])}, [sw.logs / "backbone.log"])
        assert sw.stop_process("backbone") == 0, "backbone serve did not stop cleanly on SIGTERM"
