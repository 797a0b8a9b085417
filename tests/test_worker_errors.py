"""The worker's errors a person can act on: real ``python -m worker`` processes, each case
checked for its exit status and its last stderr line (one line, the flag and the fix, no
traceback).

* Wrong --hub/--gateway forms and a --model that is not a checkpoint fail with exit 2 before
  anything slow (the model is not even opened for a bad URL; no wallet is made).
* What retrying cannot change fails with exit 2: a gateway certificate the system does not
  trust (--ca-file), an HTTP 4xx answer (--hub pointing at a gateway), a hub other than the
  pinned one (--hub-key), a hello the hub refuses for the model it serves (--model/--experts).
* Nothing listening at --hub: the worker warns once per attempt, saying what and where, and
  connects when the hub comes up; Ctrl-C then stops it with one line and exit 130.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import threading

import pytest
from helpers import ROOT, wait_until

from kvasir.swarm import LocalSwarm, free_port
from kvasir_rpc import Wallet

pytestmark = pytest.mark.integration

EXIT_WITHIN_S = 60.0  # a cold interpreter importing torch on a busy 2-core machine, with room


def run_worker(args: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", KVASIR_THREADS="1")
    return subprocess.run([sys.executable, "-m", "worker", *args], capture_output=True, text=True,
                          timeout=EXIT_WITHIN_S, cwd=cwd, stdin=subprocess.DEVNULL, env=env)


def last_line(out: subprocess.CompletedProcess[str], status: int = 2) -> str:
    """The one line the worker ended with (asserting the exit status and no traceback)."""
    text = out.stdout + out.stderr
    assert out.returncode == status, text
    assert "Traceback" not in text and "ExceptionGroup" not in text, text
    return out.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--hub", "http://127.0.0.1:8765", "a hub's address is ws://HOST:PORT (for a gateway use --gateway wss://"),
        ("--hub", "127.0.0.1:8765", "a hub's address is ws://HOST:PORT"),
        ("--hub", "wss://gateway.example:443", "for a gateway use --gateway wss://HOST:PORT"),
        ("--gateway", "https://gateway.example", "a gateway's address is wss://HOST[:PORT]"),
        ("--gateway", "gateway.example:443", "a gateway's address is wss://HOST[:PORT]"),
    ],
)
def test_a_wrong_address_form_fails_before_anything_else(flag, value, says, tmp_path):
    # No model there: the address is checked first, and nothing is written.
    out = run_worker([flag, value, "--model", str(tmp_path / "none")], tmp_path)
    assert out.stderr.strip().splitlines() == [last_line(out)], out.stderr
    assert last_line(out).startswith(f"worker: {flag} {value}: ") and says in last_line(out)
    assert not (tmp_path / ".kvasir").exists()


@pytest.mark.parametrize("what", ["empty folder", "dense config", "missing folder"])
def test_a_model_that_is_not_a_checkpoint_fails_naming_model(what, tmp_path):
    model = tmp_path / "model"
    if what != "missing folder":
        model.mkdir()
    if what == "dense config":
        (model / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8}')
    out = run_worker(["--hub", "ws://127.0.0.1:9", "--model", str(model)], tmp_path)
    line = last_line(out)
    assert out.stderr.strip().splitlines() == [line], out.stderr
    assert line.startswith("worker: --model") and "checkpoint folder" in line, line
    assert "sentencepiece" not in out.stderr
    assert not (tmp_path / ".kvasir").exists()  # refused before the wallet is made


def test_an_untrusted_gateway_certificate_fails_naming_ca_file(tiny_models, tmp_path):
    with LocalSwarm(tmp_path) as sw:
        sw.start_gateway()  # its certificate is signed by a development CA the system does not trust
        out = run_worker(["--gateway", sw.gateway_url, "--hub-key", Wallet.generate().address,
                          "--model", str(tiny_models("qwen3_moe")), "--log-level", "warning"], tmp_path)
    line = last_line(out)
    assert out.stderr.strip().splitlines() == [line], out.stderr
    assert line.startswith(f"worker: --gateway {sw.gateway_url}: the gateway's TLS certificate is not trusted"), line
    assert "--ca-file" in line and "kvasir certs" in line


def test_a_hub_address_that_is_a_gateway_gets_its_http_answer_and_the_right_flag(tiny_models, tmp_path):
    with LocalSwarm(tmp_path) as sw:
        sw.start_gateway(tls=False)  # plain ws://, as behind a TLS edge: it answers the upgrade with 404
        url = f"ws://127.0.0.1:{sw.gateway_port}"
        out = run_worker(["--hub", url, "--model", str(tiny_models("qwen3_moe")), "--log-level", "warning"], tmp_path)
    line = last_line(out)
    assert out.stderr.strip().splitlines() == [line], out.stderr
    assert line.startswith(f"worker: --hub {url}: the hub refused this worker with HTTP 404"), line
    assert line.endswith("check --hub (is it a gateway? then use --gateway wss://HOST:PORT)"), line


def test_a_refusal_that_retrying_cannot_change_fails_naming_the_flag(tiny_models, tmp_path):
    model = tiny_models("qwen3_moe")  # 4 layers of 8 experts
    with LocalSwarm(tmp_path) as sw:
        sw.start_hub(extra=["--layers", "2", "--experts", "4"])
        # Another hub key pinned: the worker refuses the hub's challenge.
        out = run_worker(["--hub", sw.hub_ws_url, "--hub-key", Wallet.generate().address, "--model", str(model),
                          "--log-level", "warning"], tmp_path)
        line = last_line(out)
        assert line.startswith(f"worker: this worker refused the hub at {sw.hub_ws_url}: unexpected hub key"), line
        assert "(--hub-key)" in line and line.endswith("would get the same answer (close code 4104)"), line
        # Experts outside the model the hub serves: the hub refuses the hello.
        out = run_worker(["--hub", sw.hub_ws_url, "--hub-key", sw.hub_key, "--model", str(model),
                          "--log-level", "warning"], tmp_path)
        line = last_line(out)
        assert line.startswith(f"worker: the hub refused this worker at {sw.hub_ws_url}: hello: "), line
        assert "is not in the model served" in line and line.endswith("would get the same answer (close code 4102)"), line
        sw._check_alive("hub")


class StderrLines:
    """A process's stderr, read line by line in a thread (so the pipe never fills)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        assert proc.stderr is not None
        stream = proc.stderr
        self._thread = threading.Thread(target=lambda: self.lines.extend(iter(stream.readline, "")), daemon=True)
        self._thread.start()

    def join(self, timeout: float = 10.0) -> None:
        """Wait for the end of the stream (the process exited)."""
        self._thread.join(timeout)

    def matching(self, pattern: str) -> list[str]:
        return [line for line in list(self.lines) if re.search(pattern, line)]


def test_nothing_listening_warns_each_try_then_connects_and_ctrl_c_exits_130(tiny_models, tmp_path):
    port = free_port()
    url = f"ws://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", KVASIR_THREADS="1")
    with LocalSwarm(tmp_path) as sw:
        proc = subprocess.Popen([sys.executable, "-m", "worker", "--hub", url, "--model", str(tiny_models("qwen3_moe")),
                                 "--experts", "*:0-3"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stdin=subprocess.DEVNULL, text=True, cwd=tmp_path, env=env)
        try:
            err = StderrLines(proc)
            refused = re.escape(f"cannot reach the hub at {url}: connection refused; retrying in ")
            wait_until(lambda: len(err.matching(refused)) >= 2, 90, "two warnings")
            warnings = err.matching(refused)
            assert all('"level": "warning"' in w for w in warnings), warnings
            assert all("is the hub running, and is --hub its --listen address?" in w for w in warnings), warnings
            assert not err.matching("HandshakeError|Traceback")
            # The hub comes up on that port: the worker connects at its next try (backoff at most 30 s).
            sw.start_hub(listen_port=port)
            sw.wait_sessions(1, timeout=60)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 130
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        err.join()
        assert err.lines[-1].strip() == "worker: interrupted", err.lines[-5:]
        assert not err.matching("Traceback|KeyboardInterrupt")
