"""Startup is honest: no two servers share a port, secrets are written 0600, loose ones are named.

* A second ledger, hub (either port) or gateway on a taken address exits 2 within seconds with
  one line naming the flag, the address and the fix, before touching its database, and the
  first keeps answering (grpcio shares ports through SO_REUSEPORT unless told not to; then
  clients hit one or the other at random). A worker's --direct-grpc too.
* ``write_secret`` leaves mode 0600 on new and overwritten files whatever the umask, and no
  observer ever sees the new secret in a file others may read, nor half of it.
* Wallets, hub keys and tokens that others may read are still loaded, with a warning that
  names the file and ``chmod 600``; ``kvasir certs`` over old 0644 keys leaves them 0600.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import structlog
from helpers import ROOT, LedgerProcess, taken_port

from kvasir.swarm import LocalSwarm
from kvasir_rpc import (
    NO_PORT_SHARING,
    ListenError,
    Wallet,
    as_listen_error,
    bind_grpc,
    check_listen,
    check_secret_mode,
    ledger_pb2,
    ledger_pb2_grpc,
    load_or_create_token,
    load_token,
    session_pb2,
    session_pb2_grpc,
    write_secret,
)

EXIT_WITHIN_S = 15.0  # a cold interpreter importing grpc on a busy 2-core machine, with room


def _mode(path: pathlib.Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


# -- listening addresses -----------------------------------------------------------------------


def test_check_listen_names_a_taken_address_and_passes_free_ones() -> None:
    with taken_port() as port:
        with pytest.raises(ListenError) as info:
            check_listen(f"127.0.0.1:{port}")
        assert str(info.value) == f"cannot listen on 127.0.0.1:{port}: address in use"
        assert info.value.address == f"127.0.0.1:{port}"
    check_listen("127.0.0.1:0")
    check_listen("unix:/nonexistent/dir/sock")  # other forms are the real bind's to judge
    with pytest.raises(ListenError, match="cannot resolve"):
        check_listen("no-such-host.invalid:5000")


def test_as_listen_error_unwraps_groups_and_ignores_other_errors() -> None:
    in_use = OSError(98, "Address already in use")
    nested = BaseExceptionGroup("outer", [ExceptionGroup("inner", [in_use])])
    err = as_listen_error("127.0.0.1:9", nested)
    assert err is not None and str(err) == "cannot listen on 127.0.0.1:9: address in use"
    assert as_listen_error("127.0.0.1:9", ValueError("not a bind")) is None
    assert as_listen_error("127.0.0.1:9", ExceptionGroup("two", [in_use, ValueError()])) is None


def _grpc_server(options: list[tuple[str, int]]) -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=options)


def test_grpc_servers_without_the_option_share_a_port_and_with_it_refuse() -> None:
    # Why NO_PORT_SHARING exists: grpcio's default lets a second server bind the same port.
    first, second = _grpc_server([]), _grpc_server([])
    try:
        port = first.add_insecure_port("127.0.0.1:0")
        assert second.add_insecure_port(f"127.0.0.1:{port}") == port
    finally:
        first.stop(None)
        second.stop(None)
    first, second = _grpc_server([NO_PORT_SHARING]), _grpc_server([NO_PORT_SHARING])
    try:
        port = bind_grpc(first, "127.0.0.1:0")
        with pytest.raises(ListenError, match=f"127.0.0.1:{port}: address in use"):
            bind_grpc(second, f"127.0.0.1:{port}")
        # Past our own check too (a race lost): gRPC's own bind fails, and says so.
        try:
            got = second.add_insecure_port(f"127.0.0.1:{port}")
        except RuntimeError:
            got = 0
        assert got == 0
    finally:
        first.stop(None)
        second.stop(None)


def _run_second(args: list[str]) -> subprocess.CompletedProcess[str]:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert time.monotonic() - t0 < EXIT_WITHIN_S, f"took {time.monotonic() - t0:.1f}s to give up"
    return out


def _assert_flag_named(out: subprocess.CompletedProcess[str], component: str, flag: str, address: str) -> None:
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert text.strip().splitlines() == [f"{component}: {flag} {address} is in use by another program: stop it or "
                                         "choose another port (port 0 picks a free one)"], text
    assert "Traceback" not in text and "listening" not in text


@pytest.mark.integration
def test_a_second_ledger_on_a_taken_port_exits_and_the_first_answers_every_call(tmp_path: pathlib.Path) -> None:
    hub = Wallet.generate().address
    first = LedgerProcess(tmp_path, f"sqlite:///{tmp_path / 'ledger.sqlite'}", [hub])
    port = first.start()
    try:
        second_db = tmp_path / "second.sqlite"
        out = _run_second(["-m", "ledger", "serve", "--listen", f"127.0.0.1:{port}", "--db", f"sqlite:///{second_db}",
                           "--trust-key", hub])
        _assert_flag_named(out, "ledger", "--listen", f"127.0.0.1:{port}")
        assert not second_db.exists()  # refused before it opened anything
        for _ in range(8):  # a fresh connection each: with a shared port the kernel would spread them
            with grpc.insecure_channel(first.address) as ch:
                got = ledger_pb2_grpc.LedgerServiceStub(ch).GetBalance(ledger_pb2.GetBalanceRequest(wallet=hub),
                                                                        timeout=10)
                assert got.wallet == hub
        assert first.proc is not None and first.proc.poll() is None
    finally:
        assert first.stop() == 0, first.log()


@pytest.mark.integration
def test_a_second_hub_on_either_taken_port_exits_and_the_first_answers_every_call(tmp_path: pathlib.Path) -> None:
    with LocalSwarm(tmp_path) as sw:
        sw.start_hub()
        contrib = tmp_path / "hub-contrib.sqlite"
        before = contrib.stat().st_mtime_ns
        common = ["-m", "relay", "hub", "--key", str(sw.hub_key_file), "--backbone-token-file",
                  str(sw.backbone_token_file), "--contrib-db", str(contrib)]
        grpc_taken = f"127.0.0.1:{sw.hub_grpc_port}"
        ws_taken = f"127.0.0.1:{sw.hub_ws_port}"
        _assert_flag_named(_run_second([*common, "--listen", "127.0.0.1:0", "--grpc", grpc_taken]), "hub", "--grpc",
                           grpc_taken)
        _assert_flag_named(_run_second([*common, "--listen", ws_taken, "--grpc", "127.0.0.1:0"]), "hub", "--listen",
                           ws_taken)
        assert contrib.stat().st_mtime_ns == before  # the first hub's sessions were left alone
        for _ in range(8):
            with grpc.insecure_channel(sw.hub_grpc_address) as ch:
                stub = session_pb2_grpc.SessionServiceStub(ch)
                assert list(stub.ListSessions(session_pb2.ListSessionsRequest(), timeout=10).sessions) == []
        sw._check_alive("hub")


@pytest.mark.integration
def test_a_second_gateway_on_a_taken_port_exits_at_once(tmp_path: pathlib.Path) -> None:
    with LocalSwarm(tmp_path) as sw:
        sw.start_gateway(tls=False)
        taken = f"127.0.0.1:{sw.gateway_port}"
        out = _run_second(["-m", "relay", "gateway", "--listen", taken, "--insecure-plain-ws",
                           "--hub-token-file", str(sw.token_file)])
        _assert_flag_named(out, "gateway", "--listen", taken)
        sw._check_alive("gateway")
        with socket.create_connection(("127.0.0.1", sw.gateway_port), timeout=10):
            pass


@pytest.mark.integration
def test_a_worker_whose_direct_grpc_port_is_taken_exits_before_loading(tmp_path: pathlib.Path) -> None:
    with taken_port() as port:
        # No model there: the address is checked first, not after minutes of loading.
        out = _run_second(["-m", "worker", "--hub", "ws://127.0.0.1:9", "--model", str(tmp_path / "none"),
                           "--wallet", str(tmp_path / "w.key"), "--direct-grpc", f"127.0.0.1:{port}"])
        _assert_flag_named(out, "worker", "--direct-grpc", f"127.0.0.1:{port}")


# -- secret files ------------------------------------------------------------------------------


@pytest.mark.parametrize("mask", [0o000, 0o022, 0o077])
def test_write_secret_makes_new_and_overwritten_files_0600_whatever_the_umask(tmp_path: pathlib.Path,
                                                                               mask: int) -> None:
    new, old = tmp_path / "sub" / "new.key", tmp_path / "old.key"
    old.write_text("old secret\n")
    old.chmod(0o644)
    with _umask(mask):
        write_secret(new, "fresh\n")
        write_secret(old, b"replaced\n")
    assert (new.read_text(), _mode(new)) == ("fresh\n", 0o600)
    assert (old.read_text(), _mode(old)) == ("replaced\n", 0o600)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["new.key", "old.key", "sub"]  # no temp file left


def test_write_secret_without_replace_never_clobbers(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "w.key"
    write_secret(path, "first\n", replace=False)
    with pytest.raises(FileExistsError):
        write_secret(path, "second\n", replace=False)
    assert path.read_text() == "first\n" and [p.name for p in tmp_path.iterdir()] == ["w.key"]


def test_no_observer_sees_the_secret_readable_by_others_or_half_written(tmp_path: pathlib.Path) -> None:
    """A watcher opens every file in the folder as fast as it can while the target, first a
    0644 file, is rewritten 200 times. Each look is one inode (fstat and read on the same
    descriptor): any file holding a secret is 0600, and holds a whole one."""
    target = tmp_path / "gateway.key"
    target.write_text("old, public\n")
    target.chmod(0o644)
    secrets_written = [f"secret {i:04d} ".encode() * 512 for i in range(200)]  # 6 KiB: several writes' worth
    seen: list[tuple[int, bytes]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for entry in os.scandir(tmp_path):
                try:
                    fd = os.open(entry.path, os.O_RDONLY)
                except FileNotFoundError:
                    continue
                try:
                    mode = stat.S_IMODE(os.fstat(fd).st_mode)
                    data = b""
                    while chunk := os.read(fd, 1 << 16):
                        data += chunk
                finally:
                    os.close(fd)
                seen.append((mode, data))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with _umask(0):
            for blob in secrets_written:
                write_secret(target, blob)
    finally:
        done.set()
        watcher.join(10)
    assert not watcher.is_alive()
    assert len(seen) > 50, "the watcher hardly looked"
    assert any(data in set(secrets_written) for _, data in seen), "the watcher never saw a secret"
    whole = set(secrets_written)
    for mode, data in seen:
        if data == b"old, public\n":
            continue
        assert mode == 0o600, f"a file with {data[:12]!r} was {mode:04o}"
        # A temp file may be seen before it is filled; the target only ever whole.
        assert data in whole or any(s.startswith(data) for s in whole), data[:40]
    assert target.read_bytes() == secrets_written[-1] and _mode(target) == 0o600


def _warnings(logs: list[dict[str, object]]) -> list[dict[str, object]]:
    return [e for e in logs if e.get("log_level") == "warning"]


@pytest.mark.parametrize("mode", [0o644, 0o666, 0o640])
def test_a_wallet_or_token_others_can_read_is_loaded_with_a_warning(tmp_path: pathlib.Path, mode: int) -> None:
    wallet_path, token_path = tmp_path / "worker.wallet", tmp_path / "backbone.token"
    address = Wallet.load_or_create(wallet_path).address
    token = load_or_create_token(token_path)
    wallet_path.chmod(mode)
    token_path.chmod(mode)
    with structlog.testing.capture_logs() as logs:
        assert Wallet.load(wallet_path).address == address
        assert Wallet.load_or_create(wallet_path).address == address
        assert load_token(token_path) == token
    warned = _warnings(logs)
    assert [w["file"] for w in warned] == [str(wallet_path)] * 2 + [str(token_path)]
    for w in warned:
        assert w["mode"] == f"{mode:04o}" and w["fix"] == f"chmod 600 {w['file']}"
    assert "key file" in str(warned[0]["event"]) and "token file" in str(warned[2]["event"])


def test_private_and_freshly_made_secrets_load_without_a_word(tmp_path: pathlib.Path) -> None:
    with _umask(0), structlog.testing.capture_logs() as logs:
        Wallet.load_or_create(tmp_path / "a.wallet")
        Wallet.load(tmp_path / "a.wallet")
        load_or_create_token(tmp_path / "t.token")
        assert check_secret_mode(tmp_path / "missing")  # nothing to say about a file that is not there
    assert _warnings(logs) == []
    assert _mode(tmp_path / "a.wallet") == 0o600 and _mode(tmp_path / "t.token") == 0o600


def test_concurrent_creators_agree_on_one_wallet(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "hub.key"
    with futures.ThreadPoolExecutor(8) as pool:
        addresses = set(pool.map(lambda _: Wallet.load_or_create(path).address, range(16)))
    assert addresses == {Wallet.load(path).address}


def test_kvasir_certs_over_old_0644_keys_leaves_them_0600(tmp_path: pathlib.Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from kvasir.cli import main

    for name in ("ca.key", "gateway.key", "ca.pem"):
        (tmp_path / name).write_text("stale\n")
        (tmp_path / name).chmod(0o644)
    assert main(["certs", str(tmp_path)]) == 0
    capsys.readouterr()
    assert _mode(tmp_path / "ca.key") == 0o600 and _mode(tmp_path / "gateway.key") == 0o600
    assert _mode(tmp_path / "ca.pem") == 0o644 and _mode(tmp_path / "gateway.pem") == 0o644
    assert (tmp_path / "gateway.key").read_text().startswith("-----BEGIN PRIVATE KEY-----")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.key", "ca.pem", "gateway.key", "gateway.pem"]


def test_key_show_warns_on_stderr_and_keeps_stdout_the_address(tmp_path: pathlib.Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from kvasir.cli import main

    path = tmp_path / "hub.key"
    address = Wallet.load_or_create(path).address
    path.chmod(0o644)
    assert main(["key", "show", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.out == address + "\n"
    assert f"chmod 600 {path}" in captured.err
