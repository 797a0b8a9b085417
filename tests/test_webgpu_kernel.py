"""The WebGPU expert kernel (clients/ts/src/webgpu) in a web page of headless Chromium with WebGPU.

Chromium gives a headless page WebGPU with ``--enable-unsafe-webgpu``: SwiftShader's Vulkan on
the CPU where there is no GPU (the adapter ``google / swiftshader``), the same WGSL a GPU runs.
The page's checks (clients/ts/test/webgpu_page.ts) are bundled now with esbuild, served by
tests/web_static.py and called over the DevTools protocol; each returns its failures:

* against the JS kernel (jsExpertForward) for every gate and activation it computes, float32,
  bfloat16 and float16, biases on and off, odd sizes ([H 72, I 40], [H 131, I 33]) and 1, 5, 8,
  9, 64 and 300 rows (up to 8 the small-batch shader, from 9 the tiled one): projections and
  outputs within the first-order bound of the WASM kernel's tests (for one float32 sum per
  output) and outputs within PROTOCOL.md 11's audit bound;
* the small-batch shader's 2-D grid (more outputs than a dimension of workgroups allows), and
  the tiled shader at 1 row;
* tests/vectors/expert_compute.json: projections exact, outputs within 2 units in the last place
  and the audit bound, and the 'dispatch' calls through computeDispatch with the kernel in use;
* two experts placed and called in turn (and concurrently): each gives its own results, bit for
  bit the same each time, uploaded once;
* the clear errors: an expert larger than the largest buffer, a lost device, no adapter;
* the measurement hook (measureKernels): rows/s of the JS, WASM and WebGPU kernels.

Node, clients/ts's node_modules (``make node-deps``) and Debian's chromium are needed."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parent.parent
TS = ROOT / "clients" / "ts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
BUILD_TIMEOUT_S = 120
# SwiftShader computes on the CPU: the whole comparison takes some seconds on two cores.
EVAL_TIMEOUT_S = 150.0


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One Chromium with WebGPU on a page that serves the checks' bundle (and kernel.wasm beside it)."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("needs chromium (make system-deps): the WebGPU kernel runs in a web page")
    esbuild = TS / "node_modules" / ".bin" / "esbuild"
    if not esbuild.exists():
        pytest.fail("clients/ts/node_modules is missing: run `make node-deps` (npm ci in clients/ts)")
    from test_status_page import _Chromium
    from web_static import StaticServer

    tmp = tmp_path_factory.mktemp("webgpu")
    out_dir = tmp / "page"
    out_dir.mkdir()
    out = subprocess.run([str(esbuild), "test/webgpu_page.ts", "--bundle", "--format=esm", "--platform=browser",
                          "--target=es2022", f"--outfile={out_dir / 'webgpu_page.js'}", "--log-level=warning"],
                         capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, cwd=TS, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr
    js = (out_dir / "webgpu_page.js").read_text()
    for node_only in ("node:", 'require("'):
        assert node_only not in js, f"the page's bundle imports {node_only}"
    shutil.copy(TS / "src" / "wasm" / "kernel.wasm", out_dir / "kernel.wasm")
    (out_dir / "index.html").write_text('<!doctype html><meta charset="utf-8"><title>WebGPU kernel</title>\n')
    server = StaticServer({"webgpu": out_dir})
    browser = _Chromium(tmp, 800, 600, flags=("--enable-unsafe-webgpu",))
    try:
        # localhost is a secure context: the page has navigator.gpu.
        browser.goto(f"{server.base}/webgpu/index.html")
        module = "import('/webgpu/webgpu_page.js')"
        adapter = browser.eval(f"{module}.then(m => m.adapter()).catch(e => 'ERROR ' + e)", timeout=60)
        assert not str(adapter).startswith("ERROR"), (
            f"no WebGPU in headless Chromium with --enable-unsafe-webgpu: {adapter}")
        print(f"\nWebGPU adapter: {adapter}")
        yield browser, module
    finally:
        browser.close()
        server.close()


def _run(page, call: str, timeout: float = EVAL_TIMEOUT_S) -> dict:  # type: ignore[no-untyped-def]
    browser, module = page
    return browser.eval(f"{module}.then(m => m.{call})", timeout=timeout)


def test_webgpu_kernel_agrees_with_the_js_kernel(page):
    """Every function, dtype, biases on and off, odd sizes, 1 to 300 rows (both shaders): within the bounds."""
    res = _run(page, "agreesWithJs()")
    assert res["failures"] == [], "\n".join(res["failures"])
    assert res["cases"] == 3 * 2 * 8 * 2 * 6, res
    print(f"\n{res['cases']} cases in {res['seconds']:.1f} s: largest |WebGPU - JS| / first-order bound "
          f"{res['largestRatioToTolerance']:.4f}, / audit bound {res['largestRatioToAuditBound']:.5f}; "
          f"{100 * res['outputsEqualToJs']:.1f}% of outputs equal to JS's")


def test_webgpu_kernel_small_batch_grid_and_tiled_at_one_row(page):
    """2I = 65 602 outputs (past 65 535 workgroups a dimension) at 1, 8 and 9 rows, float32 and
    bfloat16 weights; the tiled shader alone at 1 row: within the bounds."""
    res = _run(page, "wideExpert()")
    assert res["failures"] == [], "\n".join(res["failures"])
    assert res["cases"] == 8, res


def test_webgpu_kernel_on_the_vectors(page):
    """tests/vectors/expert_compute.json, and its Dispatch calls through computeDispatch (async)."""
    vectors = json.loads((ROOT / "tests" / "vectors" / "expert_compute.json").read_text())
    res = _run(page, f"vectors({json.dumps(vectors)})")
    assert res["failures"] == [], "\n".join(res["failures"])
    assert res["functionsChecked"] == len(vectors["functions"]) and res["dispatchCalls"] == len(vectors["dispatch"])


def test_webgpu_kernel_two_experts_alternating(page):
    """Two experts placed once; calls in turn and concurrent ones give each expert's own results."""
    res = _run(page, "twoExperts()")
    assert res["failures"] == [], "\n".join(res["failures"])


def test_webgpu_kernel_clear_errors(page):
    """Too big for the largest buffer (WebGpuMemoryError), a lost device, no adapter: clear errors."""
    res = _run(page, "errors()")
    assert res["failures"] == [], "\n".join(res["failures"])
    assert "larger than the device's largest buffer" in res["messages"]["tooBig"], res["messages"]
    assert "WebGPU device was lost" in res["messages"]["lost"], res["messages"]
    print("\n" + "\n".join(f"{k}: {v}" for k, v in res["messages"].items()))


def test_webgpu_kernel_measurement_hook(page):
    """measureKernels gives rows/s of the JS, WASM and WebGPU kernels on one expert (short windows here)."""
    res = _run(page, "measureKernels({ H: 64, I: 32, n: 64, seconds: 0.1 })")
    assert res["errors"] == {}, res
    rates = res["rowsPerSecond"]
    assert all(rates[k] > 0 for k in ("js", "wasm", "webgpu")), res
    print(f"\nrows/s at n 64, H 64, I 32 ({res['adapter']}): " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()))


def test_webgpu_kernel_where_there_is_no_webgpu():
    """clients/ts/test/webgpu.test.ts (Node's test runner, no GPU): no navigator.gpu, no adapter,
    a device refused: each a WebGpuUnavailableError saying which (the page then uses WebAssembly)."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not on PATH")
    if not (TS / "node_modules" / "tsx").exists():
        pytest.fail("clients/ts/node_modules is missing: run `make node-deps` (npm ci in clients/ts)")
    try:
        out = subprocess.run([node, "--import", "tsx", "--test", "test/webgpu.test.ts"], cwd=TS, capture_output=True,
                             text=True, timeout=BUILD_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"node --test test/webgpu.test.ts did not finish within {BUILD_TIMEOUT_S} s")
    assert out.returncode == 0 and "# fail 0" in out.stdout, out.stdout[-6000:] + out.stderr[-3000:]
