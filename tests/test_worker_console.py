"""What a worker shows its owner, from real processes (a ledger, a hub, two workers, a decode).

* On a terminal (stderr a pseudo-terminal here): the loading bar with its bytes, then the live
  panel: "connected" with the session, the calls served once a decode went through, and the
  KVR the ledger credited to the wallet (--ledger).
* Without a terminal: log lines in order ("loading experts" before the loading progress,
  before "experts loaded"), and a "serving" line with the calls, bytes and credited KVR.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading

import pytest
from helpers import ROOT, wait_until

from kvasir.swarm import LocalSwarm

pytestmark = pytest.mark.integration

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


class Terminal:
    """A pseudo-terminal whose master side is read in a thread (so the child never blocks)."""

    def __init__(self, rows: int = 50, cols: int = 140) -> None:
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self._data = bytearray()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every slave end is closed (the child exited)
                return
            if not chunk:
                return
            with self._lock:
                self._data += chunk

    def text(self) -> str:
        """Everything shown so far, without the escape sequences."""
        with self._lock:
            return ANSI.sub("", self._data.decode(errors="replace"))

    def close(self) -> None:
        self._thread.join(timeout=10)
        os.close(self.master)


def last_number(pattern: str, text: str) -> float:
    found = re.findall(pattern, text)
    return float(found[-1].replace(",", "")) if found else 0.0


def test_the_worker_shows_its_owner_progress_state_work_and_credit(tiny_models, tmp_path):
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path) as sw:
        sw.start_ledger()
        sw.start_hub()
        # The second worker logs (stderr a file): the log lines are checked below.
        sw.start_worker("logged", model, "*:4-7", extra=["--ledger", sw.ledger_address, "--status-interval", "1"])
        term = Terminal()
        env = dict(sw.env, PYTHONPATH=str(ROOT), TERM="xterm-256color", COLUMNS="140", LINES="50")
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker", "--hub", sw.hub_ws_url, "--hub-key", sw.hub_key, "--model", str(model),
             "--experts", "*:0-3", "--wallet", str(tmp_path / "tty.wallet"), "--ledger", sw.ledger_address],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=term.slave, env=env, cwd=tmp_path)
        os.close(term.slave)
        try:
            wait_until(lambda: re.search(r"connected\s+session s\d+", term.text()) is not None, 120,
                       "the console's 'connected'")
            shown = term.text()
            assert "loading experts 16/16" in shown and "393.2/393.2 kB" in shown, shown[-3000:]
            assert "not encrypted" in shown and sw.hub_ws_url in shown
            assert "credit for work accepted" in shown  # what KVR is, where the owner looks
            sw.wait_sessions(2, watch=["logged"])
            result = sw.run_backbone(["--model", str(model), "--prompt", "a console for the owner",
                                      "--max-new-tokens", "4", "--wait-sessions", "2"], timeout=300)
            assert result["backbone_exit_code"] == 0
            wait_until(lambda: last_number(r"calls\s+([\d,]+)\s+rows", term.text()) > 0, 30, "calls on the panel")
            wait_until(lambda: last_number(r"credited\s+(\d+\.\d+) KVR", term.text()) > 0, 60,
                       "the credited KVR on the panel")
            assert re.search(r"bytes\s+in [\d.]+ kB\s+out [\d.]+ kB", term.text()), term.text()[-2000:]
            # SIGTERM still drains and exits 0.
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            term.close()
        assert "Traceback" not in term.text()

        # The logged worker: its lines in order, then a "serving" line with work and credit.
        def records() -> list[dict]:  # type: ignore[type-arg]
            lines = (sw.logs / "logged.log").read_text().splitlines()
            return [json.loads(line) for line in lines if line.startswith("{")]

        def credited(r: dict) -> bool:  # type: ignore[type-arg]
            return r["event"] == "serving" and r["calls"] > 0 and float(r.get("credited_kvr", 0)) > 0

        wait_until(lambda: any(credited(r) for r in records()), 60, "a 'serving' line with calls and credit")
        events = [r["event"] for r in records()]
        first = {e: events.index(e) for e in ("loading experts", "loading", "experts loaded", "session established")}
        assert first["loading experts"] < first["loading"] < first["experts loaded"] < first["session established"]
        loading = [r for r in records() if r["event"] == "loading"]
        assert [r["percent"] for r in loading] == [25, 50, 75, 100], loading
        assert records()[events.index("loading experts")]["model"] == str(model)
        kvr = [r["event"] for r in records() if r["event"].startswith("KVR is the credit")]
        assert len(kvr) == 1 and f"kvasir balance --ledger {sw.ledger_address} --wallet" in kvr[0], kvr
        serving = next(r for r in records() if credited(r))
        assert serving["bytes_in"] > 0 and serving["bytes_out"] > 0 and serving["rows"] > 0, serving
