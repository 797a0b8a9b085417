"""What a person sees from `python -m backbone` and `kvasir demo`: the text of a decode as it
comes, and for each mistake they can fix (a dead --hub, a --model that is not a checkpoint,
Ctrl-C) one line on stderr naming the flag and the fix, with its exit status, never a
traceback.

Integration: real processes (the backbone CLI, a hub, the demo's swarm), each bounded."""

from __future__ import annotations

import json
import os
import pathlib
import select
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import ROOT, wait_until

pytestmark = pytest.mark.integration

# A one-line failure comes before torch loads; this bounds it on a loaded CI machine.
FAIL_FAST_S = 30.0
CHECKPOINT_FIX = "point --model at a Hugging Face checkpoint folder"


def _env() -> dict[str, str]:
    return {**os.environ, "KVASIR_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(args: list[str], timeout: float = 120.0, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          stdin=subprocess.DEVNULL, env=_env())


def _one_line(out: subprocess.CompletedProcess[str], status: int, *needles: str) -> str:
    """The single stderr line of a failed command, checked for its status and words."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == status, out.stderr
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _dead_address() -> str:
    """HOST:PORT where nothing listens (a port the kernel just handed out, closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _read_until(proc: subprocess.Popen[bytes], pred, timeout: float) -> bytes:  # type: ignore[no-untyped-def]
    """Read the process's stdout as it comes until ``pred(data)`` holds or it ends."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    data = b""
    deadline = time.monotonic() + timeout
    while not pred(data):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out after {timeout}s; stdout so far: {data[-500:]!r}"
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break  # the process closed its stdout
            data += chunk
    return data


# -- tokens as they come ----------------------------------------------------------------------


def test_generate_prints_the_text_while_it_decodes(tiny_models, tmp_path: pathlib.Path) -> None:
    err = open(tmp_path / "err.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "backbone", "generate", "--model", str(tiny_models("qwen3_moe")),
                             "--prompt", "stream", "--max-new-tokens", "100000", "--log-level", "info"],
                            stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=_env(), cwd=ROOT)
    try:
        first = _read_until(proc, lambda d: d.strip() != b"", 180)
        assert proc.poll() is None, "stdout came only when the process ended"
        assert first.strip(), (tmp_path / "err.log").read_text()
        proc.send_signal(signal.SIGINT)  # ends the decode after this step; the result follows
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        err.close()
    assert proc.returncode == 0, (tmp_path / "err.log").read_text()
    lines = (first + rest).decode().splitlines()
    assert lines[-1].split()[1] == "tokens" and "remote calls 0" in lines[-1], lines
    assert int(lines[-1].split()[0]) >= 1


def test_the_stream_prints_what_the_decode_says_and_starts_again_on_a_replay(
        tiny_models, capsys: pytest.CaptureFixture[str]) -> None:
    import io

    import torch
    from transformers import AutoTokenizer

    from backbone.cli._generate import _TextStream

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models("qwen3_moe")))
    ids = tokenizer("a stream of text\nover two lines, déjà vu", add_special_tokens=False)["input_ids"]

    def steps(stream: _TextStream, n: int) -> None:
        for i in range(1, n + 1):
            stream.step(range(0, 4, 2), torch.tensor([ids[:i], ids[:i]]))
            stream.step(range(1, 4, 2), torch.tensor([ids[:i]]))  # another group: not shown

    out = io.StringIO()
    with _TextStream(tokenizer, out) as stream:
        steps(stream, len(ids))
    def text(n: int) -> str:
        return str(tokenizer.decode(ids[:n]))

    assert out.getvalue() == text(len(ids)) + "\n"
    out = io.StringIO()
    with _TextStream(tokenizer, out) as stream:
        steps(stream, 3)
        steps(stream, len(ids))  # replayed from the prompt
    assert out.getvalue() == text(3) + "\n" + text(len(ids)) + "\n"
    assert "the text above is void" in capsys.readouterr().err


def test_generate_json_keeps_stdout_one_object(tiny_models) -> None:
    out = _run(["-m", "backbone", "generate", "--model", str(tiny_models("qwen3_moe")), "--prompt", "json",
                "--max-new-tokens", "3", "--batch", "3", "--groups", "2", "--json"], timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout
    result = json.loads(lines[0])
    assert result["n_tokens"] == 9 and len(result["texts"]) == 3
    assert "decoding" not in out.stderr  # no progress bar where stderr is not a terminal


# -- the hub ------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_dead_hub_fails_at_once_in_one_line(tiny_models, tmp_path: pathlib.Path, command: str) -> None:
    token = tmp_path / "backbone.token"
    token.write_text("a" * 64 + "\n")
    token.chmod(0o600)
    address = _dead_address()
    extra = ["--prompt", "x"] if command == "generate" else ["--listen", "127.0.0.1:0"]
    t0 = time.monotonic()
    out = _run(["-m", "backbone", command, "--model", str(tiny_models("qwen3_moe")), "--hub", address,
                "--hub-token-file", str(token), *extra])
    assert time.monotonic() - t0 < FAIL_FAST_S
    line = _one_line(out, 2, f"cannot reach the hub at {address} (--hub): connection refused",
                     "is this its --grpc address?")
    assert line.startswith("backbone: ")


@pytest.mark.parametrize("hub", ["ws://127.0.0.1:8765", "http://127.0.0.1:8766", "127.0.0.1"])
def test_a_hub_address_that_is_no_host_port_fails_in_one_line(tiny_models, tmp_path: pathlib.Path, hub: str) -> None:
    token = tmp_path / "backbone.token"
    token.write_text("a" * 64 + "\n")
    token.chmod(0o600)
    out = _run(["-m", "backbone", "generate", "--model", str(tiny_models("qwen3_moe")), "--hub", hub,
                "--hub-token-file", str(token), "--prompt", "x"])
    _one_line(out, 2, f"--hub {hub}:", "--grpc address")


def test_too_few_sessions_waits_saying_so_then_names_the_flags(tiny_models, tmp_path: pathlib.Path) -> None:
    from kvasir.swarm import LocalSwarm

    with LocalSwarm(tmp_path) as sw:
        sw.start_hub()
        out = _run(["-m", "backbone", "generate", "--model", str(tiny_models("qwen3_moe")),
                    "--hub", sw.hub_grpc_address, "--hub-token-file", str(sw.backbone_token_file),
                    "--prompt", "x", "--wait-sessions", "1", "--wait-timeout", "7"], timeout=300)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 3 and "Traceback" not in out.stderr, out.stderr
    assert any("waiting for the hub" in x and "0 so far" in x for x in lines[:-1]), out.stderr
    assert "--wait-sessions" in lines[-1] and "--wait-timeout" in lines[-1] and "0 of the 1" in lines[-1], lines[-1]


# -- --model ----------------------------------------------------------------------------------


def _not_checkpoints(tiny: pathlib.Path, base: pathlib.Path) -> dict[str, tuple[pathlib.Path, str]]:
    """Folders that are not checkpoints, each with the words its error must say."""
    empty = base / "empty"
    empty.mkdir()
    dense = base / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8,
                                                   "num_hidden_layers": 2, "intermediate_size": 16}))
    no_tokenizer = base / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny / name, no_tokenizer / name)
    unknown = base / "unknown-type"
    shutil.copytree(tiny, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "no_such_moe"}))
    return {
        "missing": (base / "nowhere", "does not exist"),
        "unknown-type": (unknown, "model_type 'no_such_moe' is not one transformers"),
        "no-config": (empty, "has no config.json"),
        "not-moe": (dense, "not a Mixture-of-Experts checkpoint"),
        "no-tokenizer": (no_tokenizer, "has no tokenizer"),
    }


@pytest.mark.parametrize("case", ["missing", "no-config", "not-moe", "no-tokenizer", "unknown-type"])
def test_a_model_that_is_no_checkpoint_fails_in_one_line(tiny_models, tmp_path: pathlib.Path, case: str) -> None:
    model, says = _not_checkpoints(tiny_models("qwen3_moe"), tmp_path)[case]
    out = _run(["-m", "backbone", "generate", "--model", str(model), "--prompt", "x"])
    line = _one_line(out, 2, f"backbone: --model {model}:", says, CHECKPOINT_FIX, "kvasir model tiny DIR")
    assert "sentencepiece" not in line


def test_serve_and_demo_check_the_model_too(tiny_models, tmp_path: pathlib.Path) -> None:
    model, says = _not_checkpoints(tiny_models("qwen3_moe"), tmp_path)["no-tokenizer"]
    serve = _run(["-m", "backbone", "serve", "--model", str(model), "--listen", "127.0.0.1:0"])
    _one_line(serve, 2, f"backbone: --model {model}:", says, CHECKPOINT_FIX)
    demo = _run(["-m", "kvasir", "demo", "--model", str(tmp_path / "empty")])
    _one_line(demo, 2, f"kvasir demo: --model {tmp_path / 'empty'}:", "has no config.json", CHECKPOINT_FIX)
    assert list((tmp_path / "empty").iterdir()) == []  # nothing written into a folder that is no checkpoint


# -- Ctrl-C -------------------------------------------------------------------------------------


def test_ctrl_c_twice_interrupts_generate_in_one_line(tiny_models, tmp_path: pathlib.Path) -> None:
    err_path = tmp_path / "err.log"
    err = open(err_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "backbone", "generate", "--model", str(tiny_models("qwen3_moe")),
                             "--prompt", "stop", "--max-new-tokens", "100000", "--compare-local"],
                            stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=_env(), cwd=ROOT)
    try:
        # Decoding a while (text on stdout): --compare-local then decodes as many tokens again,
        # and the second Ctrl-C must land in that, not after the process has finished.
        _read_until(proc, lambda d: len(d.strip()) >= 2000, 180)
        proc.send_signal(signal.SIGINT)  # the first ends the decode after its step ...
        wait_until(lambda: b"Ctrl-C again" in err_path.read_bytes(), 30, "the first Ctrl-C's line")
        proc.send_signal(signal.SIGINT)  # ... the second interrupts
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        err.close()
    text = err_path.read_text()
    assert proc.returncode == 130, text
    assert "Traceback" not in text and text.strip().splitlines()[-1] == "backbone: interrupted", text


def test_ctrl_c_stops_the_demo_and_its_processes_in_one_line(tiny_models, tmp_path: pathlib.Path) -> None:
    import psutil

    err_path = tmp_path / "err.log"
    err = open(err_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvasir", "demo", "--path", "hub",
                             "--model", str(tiny_models("qwen3_moe"))],
                            stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=_env(), cwd=tmp_path)
    children: list[psutil.Process] = []
    try:
        said = _read_until(proc, lambda d: b"starting two backbone services" in d, 300)
        assert b"workers joined" in said, said
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 4  # ledger, hub, two workers (and the backbone loading)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        err.close()
        alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        for c in alive:
            c.kill()
    text = err_path.read_text()
    assert proc.returncode == 130, text
    assert text.strip().splitlines() == ["kvasir demo: interrupted"], text
    assert not alive, f"children left running: {[c.cmdline() for c in alive]}"
