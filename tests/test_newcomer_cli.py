"""The ``kvasir`` command's first-day mistakes: ``| head`` (a closed stdout) ends quietly,
``kvasir balance`` works with no flags from a worker's folder and says what KVR is, and
``kvasir key new``/``show`` default to the hub's key so a ledger can trust it before the hub
first runs."""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvasir.cli import build_parser, main
from kvasir_rpc import HUB_KEY_FILE, WALLET_FILE, Wallet, run_main

ROOT = pathlib.Path(__file__).resolve().parent.parent


# -- a closed stdout (kvasir status --hub ... | head) ---------------------------------------


@contextlib.contextmanager
def _closed_stdout() -> Iterator[None]:
    """sys.stdout a pipe whose reader has gone, as ``| head`` leaves it once it has its lines.
    Set in the test's body: pytest's capture sets sys.stdout again as each phase starts."""
    read, write = os.pipe()
    os.close(read)
    saved = sys.stdout
    sys.stdout = out = open(write, "w", encoding="utf-8")  # noqa: SIM115  # closed below
    try:
        yield
    finally:
        sys.stdout = saved
        with contextlib.suppress(OSError):
            out.close()


def test_a_closed_stdout_ends_quietly_with_141(capsys: pytest.CaptureFixture[str]) -> None:
    def prints_a_lot() -> int:
        for i in range(10_000):
            print(f"session {i}: a line as kvasir status prints it")
        return 0

    with _closed_stdout(), pytest.raises(SystemExit) as exited:
        run_main("kvasir status", prints_a_lot)
    assert exited.value.code == 141
    assert capsys.readouterr().err == ""  # no traceback, no "Exception ignored"


def test_a_short_answer_to_a_closed_stdout_ends_quietly_too() -> None:
    """Under a pipe's buffer the write succeeds and the flush fails: still no traceback."""
    with _closed_stdout(), pytest.raises(SystemExit) as exited:
        run_main("kvasir key show", lambda: print("ab" * 32) or 0)  # type: ignore[func-returns-value]
    assert exited.value.code == 141


def test_help_or_a_failure_to_a_closed_stdout_ends_quietly_with_its_own_status(
        capsys: pytest.CaptureFixture[str]) -> None:
    """argparse ignores the failed write of --help; its text meets the closed pipe on the flush,
    and the status is the command's own (0 for --help, 2 for a mistake)."""
    with _closed_stdout(), pytest.raises(SystemExit) as exited:
        run_main("kvasir", lambda: main(["balance", "--help"]))
    assert exited.value.code == 0

    def prints_then_fails() -> int:
        print("partial output")
        raise SystemExit(2)

    with _closed_stdout(), pytest.raises(SystemExit) as exited:
        run_main("kvasir", prints_then_fails)
    assert exited.value.code == 2 and capsys.readouterr().err == ""


def test_a_broken_pipe_elsewhere_keeps_its_traceback() -> None:
    """A socket's BrokenPipeError is a real failure, not a reader that left: it is not hidden."""
    read, write = os.pipe()
    saved = sys.stdout
    with open(read, "rb"), open(write, "w", encoding="utf-8") as out:
        sys.stdout = out
        try:
            with pytest.raises(BrokenPipeError):
                run_main("kvasir status", _raises_broken_pipe)
        finally:
            sys.stdout = saved


def _raises_broken_pipe() -> int:
    raise BrokenPipeError(32, "Broken pipe")


def _piped_into_a_reader_that_left(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    proc = subprocess.Popen([sys.executable, "-m", "kvasir", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=ROOT, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # long before the child's Python has started and printed
    err = proc.stderr.read().decode()
    return proc.wait(timeout=60), err


@pytest.mark.integration
@pytest.mark.parametrize("unbuffered", [False, True])
def test_the_kvasir_command_piped_into_a_reader_that_left(tmp_path: pathlib.Path, unbuffered: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"  # print itself meets the closed pipe, not the flush at the end
    key = tmp_path / "hub.key"
    Wallet.load_or_create(key)
    status, err = _piped_into_a_reader_that_left(["key", "show", str(key)], env)
    assert (status, err) == (141, "")
    status, err = _piped_into_a_reader_that_left(["balance", "--help"], env)
    assert status in (0, 141) and err == ""  # argparse ignores a failed write of --help itself


# -- kvasir balance with no flags ----------------------------------------------------------


def test_balance_asks_the_ledgers_default_address_for_the_workers_default_wallet() -> None:
    args = build_parser().parse_args(["balance"])
    assert args.ledger == "127.0.0.1:8767" and args.wallet is None and args.wallet_file == WALLET_FILE
    assert str(WALLET_FILE) == ".kvasir/wallet.key"
    args = build_parser().parse_args(["balance", "--wallet", "ab" * 32])
    assert args.wallet == "ab" * 32  # --wallet wins over the default file
    with pytest.raises(SystemExit):
        build_parser().parse_args(["balance", "--wallet", "ab" * 32, "--wallet-file", "w.key"])


def test_the_defaults_are_the_workers_and_the_ledgers_own() -> None:
    from ledger.__main__ import build_parser as ledger_parser
    from relay.__main__ import build_parser as relay_parser
    from worker.__main__ import DEFAULT_WALLET

    assert DEFAULT_WALLET == WALLET_FILE
    assert ledger_parser().parse_args(["serve", "--trust-key", "ab" * 32]).listen == "127.0.0.1:8767"
    assert relay_parser().parse_args(["hub", "--model", "m"]).key == HUB_KEY_FILE


def test_balance_without_a_wallet_here_says_how_to_get_one(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["balance"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no wallet file at .kvasir/wallet.key" in err
    assert "a worker run in this folder creates it" in err and "--wallet-file PATH or --wallet HEX" in err


def test_balance_says_what_kvr_is(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kvasir_rpc import ledger_pb2

    class _Ledger:
        def __init__(self, channel: object) -> None:
            pass

        def GetBalance(self, request, timeout):  # type: ignore[no-untyped-def]
            return ledger_pb2.GetBalanceResponse(pending_kvr="0.007", pending_nano_kvr=7_000_000,
                                                 bytes_credited=1_000_000, units="1.000000", credit_count=1)

    monkeypatch.setattr("kvasir_rpc.ledger_pb2_grpc.LedgerServiceStub", _Ledger)
    assert main(["balance", "--wallet", "ab" * 32]) == 0
    captured = capsys.readouterr()
    assert "0.007 KVR pending" in captured.out and captured.out.count("\n") == 1  # a script's one line
    assert "KVR: credits for expert work the backbones accepted, 1 KVR = 10^9 nano-KVR" in captured.err
    assert "the ledger credits a worker's wallet from its hub's signed byte receipts" in captured.err


def test_balance_waits_for_a_first_credit_and_says_why_none_came(tmp_path: pathlib.Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``--wait-credited`` against a real ledger (in process, on SQLite): with nothing credited
    it answers after the wait with exit status 3 and a line naming what to check; with a
    receipt credited meanwhile it prints the credit and exits 0."""
    import threading

    import grpc

    from kvasir_rpc import Wallet, ledger_pb2, ledger_pb2_grpc, sign_receipt
    from ledger import create_server, open_store

    hub, wallet = Wallet.generate(), Wallet.generate().address
    with open_store(f"sqlite:///{tmp_path / 'ledger.db'}") as store:
        server, port = create_server("127.0.0.1:0", store, [hub.address], 7)
        try:
            args = ["balance", "--ledger", f"127.0.0.1:{port}", "--wallet", wallet]
            assert main([*args, "--wait-credited", "0.6"]) == 3
            err = capsys.readouterr().err
            assert "nothing credited to this wallet after 0.6 s (--wait-credited)" in err and "--trust-key" in err

            def credit() -> None:
                signed = sign_receipt(hub, ledger_pb2.ByteReceipt(
                    hub_key=hub.address, session_id="s1", wallet=wallet, seq=1, cumulative_bytes=1000,
                    issued_at_unix_ms=1_700_000_000_000))
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    ledger_pb2_grpc.LedgerServiceStub(channel).SubmitReceipts(
                        ledger_pb2.SubmitReceiptsRequest(receipts=[signed]), timeout=10)

            later = threading.Timer(0.5, credit)
            later.start()
            try:
                assert main([*args, "--wait-credited", "20"]) == 0
            finally:
                later.join(10)
            assert "0.000007000 KVR pending (7,000 nano-KVR) for 1,000 bytes" in capsys.readouterr().out
        finally:
            server.stop(None)


# -- kvasir key new / show -----------------------------------------------------------------


def test_key_new_makes_the_hubs_key_by_default(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    old = os.umask(0o022)
    try:
        assert main(["key", "new"]) == 0
    finally:
        os.umask(old)
    captured = capsys.readouterr()
    path = tmp_path / HUB_KEY_FILE
    address = Wallet.load(path).address  # the format the hub reads with --key
    assert captured.out == address + "\n"
    assert "--trust-key" in captured.err and "--key" in captured.err and captured.err.count("\n") == 1
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert path.read_text().strip() not in captured.out + captured.err  # the seed stays in the file

    assert main(["key", "show"]) == 0  # the hub's key by default too
    assert capsys.readouterr().out == address + "\n"


def test_key_new_never_overwrites_and_prints_the_existing_key(tmp_path: pathlib.Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "hub.key"
    address = Wallet.load_or_create(path).address
    seed = path.read_text()
    assert main(["key", "new", str(path)]) == 2
    captured = capsys.readouterr()
    assert path.read_text() == seed
    assert captured.out == address + "\n"
    assert captured.err.count("\n") == 1 and "exists already and is never overwritten" in captured.err
    assert address in captured.err


def test_key_new_over_a_file_that_is_no_key_says_both(tmp_path: pathlib.Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "hub.key"
    path.write_text("my notes\n")
    assert main(["key", "new", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and path.read_text() == "my notes\n"
    assert "exists already and is never overwritten" in captured.err and "64 lowercase hex" in captured.err


def test_key_show_without_the_hubs_key_names_the_default_and_key_new(tmp_path: pathlib.Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["key", "show"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ".kvasir/hub.key" in err and "kvasir key new" in err
