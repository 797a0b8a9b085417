"""The TypeScript worker (clients/ts/src/worker, written from docs/PROTOCOL.md alone) against
``kvasir conformance``, as real processes: the check serves a hub on a port, starts the worker
under Node with the hub's URL, and drives it through every step. It must pass every one, on a
float32 checkpoint (a clear session, and an encrypted one sealed with ChaCha20-Poly1305), on a
bfloat16 one (encrypted, AES-256-GCM), on a gpt-oss one (the clamped SwiGLU over
interleaved, transposed weights with biases: PROTOCOL.md 11.2) and on a DeepSeek-V4 one (the
clamped GLU). Its unit tests against
tests/vectors (clients/ts/test/worker.test.ts, no server) run here too. Node and clients/ts's
node_modules are needed: ``make node-deps`` installs them from the lock file."""

from __future__ import annotations

import json
import pathlib
import shlex
import shutil
import subprocess
import sys

import pytest

from kvasir.conformance import PASS, STEPS

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parent.parent
TS = ROOT / "clients" / "ts"
WORKER = TS / "src" / "worker" / "main.ts"
# tsx's loader by path: `--import tsx` resolves the package from the working directory, and
# the check starts the worker from the repository root.
TSX = TS / "node_modules" / "tsx" / "dist" / "loader.mjs"
# One conformance run: the worker starts in about a second, the steps take a few more.
RUN_TIMEOUT_S = 90
TINY_TIMEOUT_S = 120


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not on PATH: the TypeScript worker needs Node.js 20 or later")
    if not TSX.exists():
        pytest.fail("clients/ts/node_modules is missing: run `make node-deps` (npm ci in clients/ts)")
    return node


def _tiny(folder: pathlib.Path, *args: str) -> pathlib.Path:
    out = subprocess.run([sys.executable, "-m", "kvasir", "model", "tiny", str(folder), *args],
                         capture_output=True, text=True, timeout=TINY_TIMEOUT_S, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr
    return folder


@pytest.fixture(scope="module")
def bf16_mixtral(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny Mixtral checkpoint stored in bfloat16 (per-expert w1/w3/w2, in shards)."""
    return _tiny(tmp_path_factory.mktemp("models") / "mixtral-bf16", "--arch", "mixtral", "--dtype", "bfloat16")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny gpt-oss checkpoint (transformers' save_pretrained): fused experts stored transposed
    ([E, H, 2I], [E, I, H]) with biases, gate and up interleaved, swiglu_limit in its config."""
    return _tiny(tmp_path_factory.mktemp("models") / "gpt-oss", "--arch", "gpt_oss")


@pytest.fixture(scope="module")
def deepseek_v4(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny DeepSeek-V4 checkpoint in bfloat16: per-expert ffn.experts.E.w1/w3/w2 tensors and the
    clamped GLU (swiglu_limit without swiglu_alpha in its config)."""
    return _tiny(tmp_path_factory.mktemp("models") / "deepseek-v4", "--arch", "deepseek_v4", "--dtype", "bfloat16")


def test_ts_worker_unit_tests_against_the_vectors():
    node = _node()
    try:
        out = subprocess.run([node, "--import", "tsx", "--test", "test/worker.test.ts"], cwd=TS, capture_output=True,
                             text=True, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"node --test test/worker.test.ts did not finish within {RUN_TIMEOUT_S} s")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]


def _conformance(model: pathlib.Path, tmp_path: pathlib.Path, *worker_args: str) -> dict:
    node = _node()
    cmd = shlex.join([node, "--import", TSX.as_uri(), str(WORKER), "--hub", "{url}", "--model", str(model),
                      "--wallet", str(tmp_path / "w.key"), *worker_args])
    log = tmp_path / "worker.log"
    try:
        out = subprocess.run([sys.executable, "-m", "kvasir", "conformance", "--model", str(model), "--json",
                              "--timeout", "60", "--worker-cmd", cmd, "--worker-log", str(log)],
                             capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvasir conformance did not finish within {RUN_TIMEOUT_S} s; the worker's log:\n"
                    f"{log.read_text(errors='replace') if log.exists() else '(none)'}")
    worker_log = log.read_text(errors="replace") if log.exists() else "(no worker log)"
    assert out.stdout.strip(), f"no report (exit {out.returncode}):\n{out.stderr}\n--- worker:\n{worker_log}"
    report = json.loads(out.stdout.splitlines()[-1])
    failed = [(s["step"], s["status"], s["detail"]) for s in report["steps"] if s["status"] != PASS]
    assert out.returncode == 0 and report["passed"] is True and not failed, (
        f"exit {out.returncode}; not passed: {failed}\n{out.stderr}\n--- worker:\n{worker_log}")
    assert [(s["step"], s["status"]) for s in report["steps"]] == [(name, PASS) for name in STEPS]
    assert report["worker"]["worker_version"].startswith("kvasir-ts-worker")
    return {s["step"]: s for s in report["steps"]}


def test_ts_worker_float32_clear_session(tiny_models, tmp_path):
    steps = _conformance(tiny_models("qwen3_moe"), tmp_path)
    # A clear session's liveness is the WebSocket ping; the row checks ran on every call.
    assert "sealed heartbeat" not in steps["keepalive"]["detail"], steps["keepalive"]
    assert "its projections pass the row checks" in steps["dispatch"]["detail"], steps["dispatch"]
    assert "INVALID_ARGUMENT" in steps["errors"]["detail"] and "FAILED_PRECONDITION" in steps["errors"]["detail"]


def test_ts_worker_float32_encrypted_chacha20(tiny_models, tmp_path):
    steps = _conformance(tiny_models("qwen3_moe"), tmp_path, "--e2e", "require", "--aead", "chacha20-poly1305")
    assert "sealed heartbeat acknowledged after" in steps["keepalive"]["detail"], steps["keepalive"]
    log = (tmp_path / "worker.log").read_text(errors="replace")
    assert "encrypted end to end (ChaCha20-Poly1305)" in log, log


def test_ts_worker_bfloat16_encrypted_aes(bf16_mixtral, tmp_path):
    steps = _conformance(bf16_mixtral, tmp_path, "--e2e", "require", "--aead", "aes-256-gcm")
    assert "torch.bfloat16" in steps["describe"]["detail"], steps["describe"]
    assert "sealed heartbeat acknowledged after" in steps["keepalive"]["detail"], steps["keepalive"]
    log = (tmp_path / "worker.log").read_text(errors="replace")
    assert "encrypted end to end (AES-256-GCM)" in log, log


def test_ts_worker_gpt_oss_function(gpt_oss, tmp_path):
    steps = _conformance(gpt_oss, tmp_path)
    # The digest step also checks that the hello announces the checkpoint's expert function.
    assert steps["digest"]["status"] == PASS, steps["digest"]
    log = (tmp_path / "worker.log").read_text(errors="replace")
    assert "clamped SwiGLU (alpha 1.702, limit 7), interleaved, transposed, biases" in log, log


def test_ts_worker_deepseek_v4_function(deepseek_v4, tmp_path):
    steps = _conformance(deepseek_v4, tmp_path)
    assert steps["digest"]["status"] == PASS, steps["digest"]
    log = (tmp_path / "worker.log").read_text(errors="replace")
    assert "clamped GLU with silu (limit 10)" in log, log


def test_ts_wasm_kernel_unit_tests():
    """The WASM-SIMD kernel (clients/ts/src/wasm) against the JS kernel and the vectors, kernel.wasm
    against its source, and the kernel in a page of headless Chromium (clients/ts/test/wasm*.test.ts)."""
    node = _node()
    tests = ["test/wasm.test.ts", "test/wasm_browser.test.ts"]
    try:
        out = subprocess.run([node, "--import", "tsx", "--test", *tests], cwd=TS, capture_output=True,
                             text=True, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"node --test {' '.join(tests)} did not finish within {RUN_TIMEOUT_S} s")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]


@pytest.mark.parametrize("model", ["qwen3_moe", "bf16_mixtral", "gpt_oss", "deepseek_v4"])
def test_ts_worker_wasm_kernel(model, tiny_models, request, tmp_path):
    """The worker computing with the WebAssembly SIMD kernel (--kernel wasm) passes conformance on
    every expert function: float32 GLU, bfloat16 GLU, gpt-oss's clamped SwiGLU, the clamped GLU."""
    folder = tiny_models("qwen3_moe") if model == "qwen3_moe" else request.getfixturevalue(model)
    steps = _conformance(folder, tmp_path, "--kernel", "wasm")
    assert "its projections pass the row checks" in steps["dispatch"]["detail"], steps["dispatch"]
    log = (tmp_path / "worker.log").read_text(errors="replace")
    assert "kernel: WebAssembly SIMD" in log, log


def test_ts_h2_unit_and_interop_tests():
    """clients/ts/src/h2 (the sans-IO HTTP/2, HPACK and gRPC server): HPACK against RFC 7541
    Appendix C, the connection fed frames built by hand, a node:http2 client calling it, and a
    recorded client played into it in headless Chromium (skipped there without Chromium)."""
    node = _node()
    files = ["test/h2hpack.test.ts", "test/h2connection.test.ts", "test/h2grpc.test.ts", "test/h2browser.test.ts"]
    try:
        out = subprocess.run([node, "--import", "tsx", "--test", *files], cwd=TS, capture_output=True, text=True,
                             timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"node --test {' '.join(files)} did not finish within {RUN_TIMEOUT_S} s")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]


@pytest.mark.parametrize("case", ["float32-clear", "float32-chacha20", "bfloat16-aes"])
def test_ts_worker_sans_io_http2(case, tiny_models, request, tmp_path):
    """The worker serving ExpertService with the sans-IO HTTP/2 + gRPC server of clients/ts/src/h2
    (--http2 sans-io, what a web page would run) instead of node:http2: grpcio, the backbone's
    client, drives the same conformance through the tunnel, clear and sealed end to end."""
    args = {"float32-clear": (), "float32-chacha20": ("--e2e", "require", "--aead", "chacha20-poly1305"),
            "bfloat16-aes": ("--e2e", "require", "--aead", "aes-256-gcm")}[case]
    folder = request.getfixturevalue("bf16_mixtral") if case.startswith("bfloat16") else tiny_models("qwen3_moe")
    steps = _conformance(folder, tmp_path, "--http2", "sans-io", *args)
    assert "its projections pass the row checks" in steps["dispatch"]["detail"], steps["dispatch"]
    assert "INVALID_ARGUMENT" in steps["errors"]["detail"] and "FAILED_PRECONDITION" in steps["errors"]["detail"]
    log = (tmp_path / "worker.log").read_text(errors="replace")
    assert "sans-IO HTTP/2 server" in log, log
    if case.startswith("bfloat16"):
        assert "torch.bfloat16" in steps["describe"]["detail"], steps["describe"]
        assert "encrypted end to end (AES-256-GCM)" in log, log
    elif "chacha20" in case:
        assert "encrypted end to end (ChaCha20-Poly1305)" in log, log
