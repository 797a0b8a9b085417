"""The worker in a web page (clients/web) in headless Chromium, against real processes.

The page's bundle is built first with esbuild (``npm run --prefix clients/ts build:web``, as
``make node-deps`` builds it), and a static server (tests/web_static.py) serves the page and the
tiny checkpoint from one origin, answering Range requests as a checkpoint host does. Then:

* the page's WebCrypto handshake and channel give the bytes of tests/vectors (handshake, channel);
  the page runs its worker in a dedicated worker thread, or (thread=main, as where no module
  worker starts) on its main thread and says so;
* the session core's send bound (clients/ts/test/session_backpressure.test.ts, in Node);
* ``kvasir conformance`` starts Chromium itself as the worker (``--worker-cmd``): the page
  fetches its slice by the byte, joins the check's hub and passes every step, in a clear session
  and in one sealed end to end;
* a live swarm (ledger, TLS gateway, hub, a Python worker holding half the experts): the page,
  loaded through the DevTools protocol with the gateway's wss:// URL and the model's URL as
  query parameters, joins through the gateway (sealed end to end with AES-256-GCM) and serves the
  other half; ``python -m backbone generate --compare-local`` gives the local run's tokens with
  every answer's row checks and audits passed, the ledger credits the page's wallet every byte
  the hub counted, the page shows the KVR credited as the ledger's HTTP read
  (``GET /v1/balance/WALLET``) gives it, and a screenshot of the page is kept (its path printed);
* every family the swarm serves (tests/test_families.py, bfloat16 as released), one Chromium and
  one static server for all: the tab is sent to the page with each ``kvasir conformance`` hub
  (run_check, in this process) and passes every step; FP8, MXFP4 and compressed-tensors releases
  are refused in the page's status from config.json alone;
* the page's Chromium killed (SIGKILL) mid-decode, once a receipt of its work was credited: the
  backbone computes its experts itself, the tokens are still the local run's, and the ledger
  credits its session every byte the hub counted (never less than before the kill).

Node, clients/ts's node_modules (``make node-deps``) and Debian's chromium are needed."""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse

import pytest
from helpers import wait_until

from kvasir.conformance import PASS, STEPS

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parent.parent
TS = ROOT / "clients" / "ts"
WEB = ROOT / "clients" / "web"
BUNDLE = WEB / "dist" / "kvasir-web-worker.js"
# The worker's own thread (a dedicated module Web Worker the page starts).
THREAD_BUNDLE = WEB / "dist" / "kvasir-web-thread.js"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
BUILD_TIMEOUT_S = 120
RUN_TIMEOUT_S = 120
DEADLINE_S = 120.0
# Chromium's own flags for a test machine: no sandbox (containers), no GPU, no first-run UI.
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage",
                  "--enable-logging=stderr", "--v=0")

needs_chromium = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs chromium (make system-deps)")


@pytest.fixture(scope="module")
def bundle() -> pathlib.Path:
    """The page's bundle, built now from the sources (never a stale one)."""
    if shutil.which("npm") is None:
        pytest.skip("npm is not on PATH: the web worker is built with esbuild from clients/ts's node_modules")
    if not (TS / "node_modules" / ".bin" / "esbuild").exists():
        pytest.fail("clients/ts/node_modules is missing: run `make node-deps` (npm ci in clients/ts)")
    out = subprocess.run(["npm", "run", "--prefix", str(TS), "--silent", "build:web"], capture_output=True, text=True,
                         timeout=BUILD_TIMEOUT_S, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr
    assert BUNDLE.exists() and THREAD_BUNDLE.exists() and (WEB / "dist" / "kernel.wasm").exists()
    return BUNDLE


@pytest.fixture(scope="module")
def static(tiny_models, bundle):  # type: ignore[no-untyped-def]
    from web_static import StaticServer

    model = tiny_models("qwen3_moe")
    server = StaticServer({"web": WEB, "model": model.parent})
    server.model = model  # type: ignore[attr-defined]
    server.model_url = f"{server.base}/model/{model.name}/"  # type: ignore[attr-defined]
    yield server
    server.close()


def _page_url(static, **params: str) -> str:  # type: ignore[no-untyped-def]
    q = urllib.parse.urlencode({**params, "model": static.model_url}, safe=":/{}")
    return f"{static.base}/web/index.html?{q}"


def test_the_page_bundle_builds_and_typechecks(bundle):
    """The bundles are one ES module each (the page's, its worker thread's); the page's sources
    typecheck for the browser (DOM, no Node types)."""
    out = subprocess.run(["npx", "--prefix", str(TS), "tsc", "--noEmit", "-p", str(TS / "tsconfig.web.json")],
                         capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, cwd=TS, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr
    for js in (bundle, THREAD_BUNDLE):
        text = js.read_text()
        # No Node API may reach the page: the shared modules are the pure *_core.ts ones.
        for node_only in ("node:crypto", "node:fs", "node:http2", "require(\"ws\")"):
            assert node_only not in text, (js.name, node_only)
    print(f"\npage weight: index.html {(WEB / 'index.html').stat().st_size} B, page bundle {bundle.stat().st_size} B, "
          f"thread bundle {THREAD_BUNDLE.stat().st_size} B, kernel.wasm {(WEB / 'dist' / 'kernel.wasm').stat().st_size} B")


def test_send_backpressure_holds_calls_while_the_websocket_is_behind():
    """The session core's send bound (clients/ts/test/session_backpressure.test.ts, Node's test
    runner): over 8 MiB of bufferedAmount no new call reaches the service, under 2 MiB they go
    on, and a queue not drained 30 s after passing the mark closes the session 1001. A browser's WebSocket.send never blocks:
    this is what keeps the page's replies from queueing without bound."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not on PATH")
    if not (TS / "node_modules" / "tsx").exists():
        pytest.fail("clients/ts/node_modules is missing: run `make node-deps` (npm ci in clients/ts)")
    try:
        out = subprocess.run([node, "--import", "tsx", "--test", "test/session_backpressure.test.ts"], cwd=TS,
                             capture_output=True, text=True, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"node --test test/session_backpressure.test.ts did not finish within {RUN_TIMEOUT_S} s")
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-4000:]
    assert "# pass 1" in out.stdout and "# fail 0" in out.stdout, out.stdout[-4000:]


@needs_chromium
@pytest.mark.parametrize("e2e", ["auto", "require"])
def test_the_page_passes_kvasir_conformance(static, tmp_path, e2e):
    """Chromium is the worker: kvasir conformance starts it on the page with its hub's URL, in a
    clear session (e2e auto: the hub's choice) and one sealed end to end with AES-256-GCM (the
    sealed heartbeat checked too). The page is given 1 MiB for weights: it takes the experts that
    fit, in order, and no more."""
    page = _page_url(static, hub="{url}", memory="1", e2e=e2e)
    cmd = shlex.join([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", page])
    log = tmp_path / "chromium.log"
    try:
        out = subprocess.run([sys.executable, "-m", "kvasir", "conformance", "--model", str(static.model), "--json",
                              "--timeout", "60", "--worker-cmd", cmd, "--worker-log", str(log)],
                             capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvasir conformance did not finish within {RUN_TIMEOUT_S} s; the page's log:\n"
                    f"{_console(log)}")
    assert out.stdout.strip(), f"no report (exit {out.returncode}):\n{out.stderr}\n--- page:\n{_console(log)}"
    report = json.loads(out.stdout.splitlines()[-1])
    failed = [(s["step"], s["status"], s["detail"]) for s in report["steps"] if s["status"] != PASS]
    assert out.returncode == 0 and report["passed"] is True and not failed, (
        f"exit {out.returncode}; not passed: {failed}\n{out.stderr}\n--- page:\n{_console(log)}")
    assert [(s["step"], s["status"]) for s in report["steps"]] == [(name, PASS) for name in STEPS]
    assert report["worker"]["worker_version"].startswith("kvasir-web-worker")
    assert report["worker"]["device"] == "browser"
    if e2e == "require":
        assert "sealed heartbeat" in report["steps"][-1]["detail"], report["steps"][-1]
    cfg = json.loads((static.model / "config.json").read_text())
    per_expert = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 4 * 2  # float32, and the WASM copy
    held = sum(len(e) for e in report["worker"]["slices"].values())
    assert held == min((1 << 20) // per_expert, cfg["num_hidden_layers"] * cfg["num_experts"]), report["worker"]
    # The page fetched the header and only expert tensors' bytes by Range, never a whole shard.
    shards = [(p, r) for p, r in static.requests if p.endswith(".safetensors")]
    assert shards and all(r.startswith("bytes=") for _, r in shards), shards


@needs_chromium
def test_the_page_crypto_against_the_vectors(static, tmp_path):
    """The page's WebCrypto handshake and channel (clients/web/test/vectors.ts, bundled now) give the
    bytes of tests/vectors/handshake.json and channel.json in Chromium: the wallet's address and key
    file, X25519, the hello's bytes and Ed25519 signature, HKDF's keys, every AES-256-GCM message each
    way; a ChaCha20-Poly1305 accept is refused 4103, a flipped bit or a replay 1008. Then, with no
    hub at its URL, the page says it is not connected and why, and dials again after a backoff."""
    from test_status_page import _Chromium

    out_dir = tmp_path / "bundle"
    esbuild = TS / "node_modules" / ".bin" / "esbuild"
    # The test module imports @bufbuild/protobuf from clients/web/test: resolved in clients/ts/node_modules.
    env = {**os.environ, "NODE_PATH": str(TS / "node_modules")}
    out = subprocess.run([str(esbuild), str(WEB / "test" / "vectors.ts"), "--bundle", "--format=esm",
                          f"--outfile={out_dir / 'vectors.js'}", "--log-level=warning"], capture_output=True,
                         text=True, timeout=BUILD_TIMEOUT_S, cwd=TS, env=env, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr
    static.mounts["webtest"] = out_dir.resolve()
    vectors = {name: json.loads((ROOT / "tests" / "vectors" / f"{name}.json").read_text())
               for name in ("handshake", "channel")}
    browser = _Chromium(tmp_path, 800, 600)
    try:
        browser.goto(_page_url(static, autostart="0"))
        failed = browser.eval(f"import('/webtest/vectors.js').then(m => m.run({json.dumps(vectors)}))", timeout=60)
        assert failed == [], failed
        # No hub at the URL: the page says why it is not connected, and dials again after a backoff.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = s.getsockname()[1]
        # And no ledger at the balance URL: the page says why it shows no KVR credited.
        browser.goto(_page_url(static, hub=f"ws://127.0.0.1:{dead}", balance=f"http://127.0.0.1:{dead}"))
        state = _wait_phase(browser, ("waiting",))
        assert "could not connect" in state["detail"] and "dialling again" in state["detail"], state
        credited_at = "document.getElementById('credited-at').textContent"
        wait_until(lambda: "network error" in browser.eval(credited_at), DEADLINE_S, "the page to say why no balance")
        assert "is the ledger serving --http there" in browser.eval(credited_at)
        assert browser.eval("window.kvasirWorker.credited()") is None
        browser.eval("window.kvasirWorker.stop()")
        # A server there that is not a ledger: its answer, status first.
        browser.goto(_page_url(static, autostart="0", balance=static.base))
        wait_until(lambda: "HTTP 404" in browser.eval(credited_at), DEADLINE_S, "the page to show the HTTP status")
        assert browser.eval("window.kvasirWorker.credited()") is None
        # A server that answers with another wallet's balance, or with one that does not parse: shown
        # as not this wallet's, never as its KVR credited.
        address = browser.eval("window.kvasirWorker.address()")
        fake = tmp_path / "fake-ledger"
        (fake / "v1" / "balance").mkdir(parents=True)
        static.mounts["fakeledger"] = fake.resolve()
        good = {"wallet": address, "pendingNanoKvr": "5", "pendingKvr": "0.000000005", "bytesCredited": "1",
                "units": "0.000001", "creditCount": "1"}
        for lie, says in (({**good, "wallet": "ab" * 32}, "for another wallet"),
                          ({**good, "pendingKvr": "lots"}, "no pendingKvr in the answer")):
            (fake / "v1" / "balance" / address).write_text(json.dumps(lie))
            browser.goto(_page_url(static, autostart="0", balance=f"{static.base}/fakeledger"))
            wait_until(lambda: "not this wallet's balance" in browser.eval(credited_at), DEADLINE_S,  # noqa: B023
                       "the page to refuse the answer")
            assert says in browser.eval(credited_at), browser.eval(credited_at)
            assert browser.eval("window.kvasirWorker.credited()") is None
            assert browser.eval("document.getElementById('credited').textContent") == "KVR credited: —"
        browser.goto(_page_url(static, hub=f"ws://127.0.0.1:{dead}"))
        _wait_phase(browser, ("waiting",))
        assert state["thread"] == "worker", state
        assert "not connected" in browser.eval("document.getElementById('status').textContent")
        assert browser.eval("document.getElementById('thread').textContent") == "a dedicated worker thread"
        browser.eval("window.kvasirWorker.stop()")
        assert browser.eval("window.kvasirWorker.state().phase") == "stopped"
        # Where no module worker starts (thread=main stands for such a browser), the page runs the
        # worker on its main thread, and says so.
        browser.goto(_page_url(static, hub=f"ws://127.0.0.1:{dead}", thread="main"))
        state = _wait_phase(browser, ("waiting",))
        assert "could not connect" in state["detail"] and state["thread"] == "main", state
        detail = browser.eval("document.getElementById('detail').textContent")
        assert "on the page's main thread" in detail, detail
        browser.eval("window.kvasirWorker.stop()")
        assert browser.eval("window.kvasirWorker.state().phase") == "stopped"
    finally:
        browser.close()


def _console(log: pathlib.Path) -> str:
    """The page's console lines (and Chromium's errors) from its log."""
    if not log.exists():
        return "(no log)"
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if "CONSOLE" in ln or "dbus" not in ln]
    return "\n".join(lines[-80:])


@needs_chromium
def test_a_page_joins_a_live_swarm_through_the_gateway_and_is_credited(static, tmp_path):
    """The page serves half the experts through the TLS gateway, from its own worker thread; the
    backbone's decode is the local one's, every answer passes its checks, the ledger credits the
    page's wallet, and the page shows the KVR credited as the ledger's HTTP read gives it."""
    from test_status_page import _Chromium

    from kvasir.swarm import LocalSwarm

    model = static.model
    with LocalSwarm(tmp_path / "swarm") as sw:
        sw.start_ledger(http=True)
        sw.start_gateway()
        sw.start_hub(gateway=True, receipt_interval=0.5)
        sw.start_worker("python", model, "*:4-7")
        sw.wait_sessions(1, watch=["python"])
        browser = _Chromium(tmp_path, 1100, 1300)
        try:
            # The gateway's certificate is the swarm's dev CA's, which this profile does not know.
            browser.send("Security.setIgnoreCertificateErrors", ignore=True)
            url = _page_url(static, gateway=sw.gateway_url, experts="*:0-3", ledger=sw.ledger_address,
                            balance=sw.ledger_http_url)
            t0 = time.monotonic()
            browser.goto(url)
            state = _wait_phase(browser, ("connected", "refused", "failed"))
            assert state.get("phase") == "connected", json.dumps(state, indent=1)
            joined_s = time.monotonic() - t0
            assert state["encrypted"] is True and state["experts"] == 16, state
            assert state["thread"] == "worker", state
            address = browser.eval("window.kvasirWorker.address()")
            sessions = sw.wait_sessions(2, watch=["python"])
            page_session = next(s for s in sessions if s.wallet == address)
            assert page_session.device == "browser" and page_session.encrypted, page_session

            result = sw.run_backbone(["--model", str(model), "--prompt", "a worker in a web page", "--batch", "2",
                                      "--max-new-tokens", "12", "--compare-local", "--wait-sessions", "2", "--json"],
                                     timeout=300)
            decode_s = float(result["seconds"])  # type: ignore[arg-type]
            assert result["backbone_exit_code"] == 0, result
            assert result["tokens_identical"] is True, result
            assert result["verdict"] in ("within the audit bound, tokens identical", "bitwise equal"), result
            assert result["local_rows"] == 0 and result["fallback_calls"] == 0 and result["remote_rows"] > 0, result
            assert result["sessions_quarantined"] == [] and result["row_check_refusals"] == 0, result
            work = result["work"]
            assert isinstance(work, dict) and work[page_session.session_id]["rows"] > 0, work

            state = browser.eval("window.kvasirWorker.state()")
            assert state["calls"] > 0 and state["rows"] > 0 and state["phase"] == "connected", state
            sessions = sw.list_sessions()
            credited = sw.wait_credited(sessions)
            page_now = next(s for s in sessions if s.wallet == address)
            assert credited[page_now.session_id] == page_now.work_bytes > 0, credited
            credits = sw.ledger_credits(address)
            assert sum(c.bytes for c in credits) >= credited[page_now.session_id] > 0, credits
            balance = sw.ledger_balance(address)
            assert int(balance.pending_nano_kvr) > 0, balance

            # The page reads the wallet's balance from the ledger's HTTP every 5 s: it comes to
            # show what the ledger's gRPC GetBalance answers.
            def page_shows_the_ledger() -> bool:
                got = browser.eval("window.kvasirWorker.credited() || null")
                now = sw.ledger_balance(address)
                return got is not None and (got["pendingKvr"], got["bytesCredited"], got["creditCount"]) == (
                    now.pending_kvr, str(now.bytes_credited), str(now.credit_count))

            wait_until(page_shows_the_ledger, DEADLINE_S, "the page's credited() to show the ledger's balance")
            page_credited = browser.eval("window.kvasirWorker.credited()")
            balance = sw.ledger_balance(address)
            assert page_credited == {"wallet": address, "pendingNanoKvr": str(balance.pending_nano_kvr),
                                     "pendingKvr": balance.pending_kvr, "bytesCredited": str(balance.bytes_credited),
                                     "units": balance.units, "creditCount": str(balance.credit_count)}, page_credited
            assert int(page_credited["bytesCredited"]) >= credited[page_now.session_id] > 0, page_credited

            shot = tmp_path / "web-worker-page.png"
            browser.eval("window.scrollTo(0, 0)")
            # The page renders each state its thread posts: the screenshot waits for a render that shows them.
            n = page_credited["creditCount"]
            shown = (f"KVR credited: {page_credited['pendingKvr']} KVR ({page_credited['bytesCredited']} B in "
                     f"{n} receipt{'' if n == '1' else 's'})")
            want = ("connected", address, f"kvasir balance --wallet {address}", shown, "a dedicated worker thread")
            wait_until(lambda: all(w in browser.eval("document.body.innerText") for w in want), DEADLINE_S,
                       "the page's status to show the session, its wallet and the balance command")
            browser.screenshot(shot, full=True)
            text = browser.eval("document.body.innerText")
            assert all(w in text for w in want), text
            print(f"\nscreenshot of the page: {shot}")
            print(f"page joined (loaded, fetched, connected through the gateway) {joined_s:.2f} s after navigation; "
                  f"first call {state['firstCallMs']} ms after start; {state['calls']} calls, {state['rows']} rows "
                  f"in a decode of {decode_s:.2f} s ({state['rows'] / decode_s:.0f} rows/s of decode); "
                  f"{static.weight_bytes()} B of weights fetched in all tests; credited "
                  f"{credited[page_now.session_id]} B = {int(balance.pending_nano_kvr)} nano-KVR; the page shows "
                  f"{shown!r}")

            # Stop: the page closes its session and says so; the hub drops it.
            browser.eval("window.kvasirWorker.stop()")
            state = browser.eval("window.kvasirWorker.state()")
            assert state["phase"] == "stopped", state
            deadline = time.monotonic() + 30
            while any(s.wallet == address for s in sw.list_sessions()):
                assert time.monotonic() < deadline, "the hub still lists the stopped page's session"
                time.sleep(0.2)
            _check_wallet_file(browser, static, tmp_path, address)
        finally:
            browser.close()


def _page_address(browser, timeout: float = 30.0) -> str:  # type: ignore[no-untyped-def]
    """The page's wallet address, once its script has set it up."""
    deadline = time.monotonic() + timeout
    while True:
        got = browser.eval("window.kvasirWorker ? window.kvasirWorker.address() : null")
        if got:
            return str(got)
        assert time.monotonic() < deadline, "the page did not set up its wallet"
        time.sleep(0.1)


def _check_wallet_file(browser, static, tmp_path: pathlib.Path, address: str) -> None:  # type: ignore[no-untyped-def]
    """The page's exported key file is the Python worker's wallet file of the same address; the
    wallet outlives a reload; a Python worker's key file imported makes the page that wallet."""
    from kvasir_rpc import Wallet

    exported = tmp_path / "page.key"
    exported.write_text(browser.eval("window.kvasirWorker.keyFile()"))
    exported.chmod(0o600)
    assert Wallet.load(exported).address == address
    browser.goto(_page_url(static, autostart="0"))
    assert _page_address(browser) == address
    theirs = Wallet.load_or_create(tmp_path / "python.key")
    text = (tmp_path / "python.key").read_text()
    assert browser.eval(f"window.kvasirWorker.importKey({json.dumps(text)})") is True
    assert browser.eval("window.kvasirWorker.address()") == theirs.address
    browser.goto(_page_url(static, autostart="0"))
    assert _page_address(browser) == theirs.address


# -- every family the swarm serves, one Chromium and one static server for all of them ----------------------------

# Releases in a format the page does not decode (it has no FP8, MXFP4 or compressed-tensors
# dequantization): it must refuse them in its status, not serve them. (model_type, quant)
UNSERVED_RELEASES = [("qwen3_moe", "fp8"), ("deepseek_v3", "fp8"), ("gpt_oss", "mxfp4"), ("qwen3_moe", "ct-fp8")]


def _served_families() -> list[str]:
    from test_families import NOW_SERVED, SERVED_BEFORE, WALK_SERVED

    return SERVED_BEFORE + NOW_SERVED + WALK_SERVED


def _wait_phase(browser, phases: tuple[str, ...], timeout: float = DEADLINE_S) -> dict:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        state = browser.eval("window.kvasirWorker ? window.kvasirWorker.state() : null") or {}
        if state.get("phase") in phases:
            return state
        assert time.monotonic() < deadline, f"the page is not {'/'.join(phases)} within {timeout:g} s: {state}"
        time.sleep(0.1)


def _page_conformance(browser, static, name: str, model: pathlib.Path,  # type: ignore[no-untyped-def]
                      log: pathlib.Path, *, kernel_line: str = "", log_line: str = "",
                      **params: str) -> tuple[dict, dict]:
    """``kvasir conformance`` (run_check, its hub in this process) with the shared Chromium's tab
    as the worker: once the check's hub listens, the tab is sent to the page with the hub's URL
    and the model ``/NAME/``'s URL; when the check ends, the tab goes to about:blank (the page's
    worker ends with it). Returns the steps by name and what the worker said of itself; with
    ``kernel_line``, the page's kernel line must start with it, with ``log_line`` its log hold it."""
    import threading

    from kvasir.conformance import run_check

    static.mounts[name] = model.resolve()
    navigated: list[BaseException | None] = []

    def navigate(url: str) -> None:
        q = urllib.parse.urlencode({"hub": url, "model": f"{static.base}/{name}/", **params}, safe=":/")
        try:
            browser.goto(f"{static.base}/web/index.html?{q}")
            navigated.append(None)
        except BaseException as exc:  # noqa: BLE001 (reported below, after the check)
            navigated.append(exc)

    threads: list[threading.Thread] = []

    def say_url(url: str) -> None:
        threads.append(threading.Thread(target=navigate, args=(url,), daemon=True))
        threads[-1].start()

    try:
        results, worker = run_check(model, worker_log=log, timeout_s=60, say_url=say_url)
    finally:
        for t in threads:
            t.join(60)
        state = browser.eval("window.kvasirWorker ? window.kvasirWorker.state() : null")
        browser.goto("about:blank")
    assert navigated == [None], navigated
    steps = {r.step: r for r in results}
    failed = {s: (r.status, r.detail) for s, r in steps.items() if r.status != PASS}
    assert [r.step for r in results] == list(STEPS) and not failed, (name, failed, state)
    assert state and state["kernel"].startswith(kernel_line), (name, state and state["kernel"])
    assert log_line in "\n".join(state["log"]), (name, state["log"])
    return steps, worker


@needs_chromium
def test_the_page_passes_conformance_on_every_served_family_and_refuses_what_it_cannot_serve(
        static, tmp_path_factory, tmp_path):
    """One Chromium and one static server for every family the swarm serves (tests/test_families.py:
    bfloat16, sharded, as released): the tab is sent to the page with each check's hub and each
    model in turn and passes every step of ``kvasir conformance``; then, for each FP8, MXFP4 and
    compressed-tensors release, the page says in its status that it cannot serve it and does not
    dial (it has no dequantization of those formats)."""
    from test_status_page import _Chromium

    from kvasir.families import make_family_checkpoint

    models = tmp_path_factory.mktemp("web-families")
    browser = _Chromium(tmp_path, 800, 600)
    timings: dict[str, float] = {}
    try:
        for model_type in _served_families():
            model = make_family_checkpoint(models / model_type, model_type, dtype="bfloat16", shard="100KB")
            t0 = time.monotonic()
            steps, worker = _page_conformance(browser, static, f"fam-{model_type}", model,
                                              tmp_path / f"{model_type}.log", e2e="auto")
            timings[model_type] = time.monotonic() - t0
            assert str(worker["worker_version"]).startswith("kvasir-web-worker") and worker["device"] == "browser"
            assert "its projections pass the row checks" in steps["dispatch"].detail, (model_type, steps["dispatch"])
            assert any(v in steps["dispatch"].detail for v in ("every row within the audit bound",
                                                               "every row bitwise equal")), steps["dispatch"]
        for model_type, quant in UNSERVED_RELEASES:
            name = f"{model_type}-{quant}"
            model = make_family_checkpoint(models / name, model_type, dtype="bfloat16", shard="100KB", quant=quant)
            static.mounts[name] = model.resolve()
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                dead = s.getsockname()[1]
            q = urllib.parse.urlencode({"hub": f"ws://127.0.0.1:{dead}", "model": f"{static.base}/{name}/"},
                                       safe=":/")
            browser.goto(f"{static.base}/web/index.html?{q}")
            state = _wait_phase(browser, ("failed", "refused", "connected", "waiting"))
            method = {"fp8": "fp8", "mxfp4": "mxfp4", "ct-fp8": "compressed-tensors"}[quant]
            assert state["phase"] == "failed" and f"a quantized release (quant_method {method})" in state["detail"] \
                and "serve it with the Python worker" in state["detail"], (name, state)
            assert "not connected" in browser.eval("document.getElementById('status').textContent")
            assert state["experts"] == 0 and state["calls"] == 0, state
            # Refused from config.json alone: not one byte of the release's weights was fetched.
            assert not [p for p, _ in static.requests if p.startswith(f"/{name}/") and p.endswith(".safetensors")]
            browser.goto("about:blank")
    finally:
        browser.close()
    print("\nconformance per family (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))


# -- the page's tab killed mid-decode ---------------------------------------------------------------------------------


def _descendants(pid: int) -> list[int]:
    """The pids of ``pid``'s children, theirs, and so on (from /proc), children first."""
    parents: dict[int, list[int]] = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _hub_counted(contrib_db: pathlib.Path, session_id: str) -> int:
    """The bytes of work the hub counted for a session (its contribution store, read-only)."""
    import sqlite3

    db = sqlite3.connect(f"file:{contrib_db}?mode=ro", uri=True, timeout=10)
    try:
        row = db.execute("SELECT COALESCE(SUM(cumulative_bytes), 0) FROM work WHERE session_id = ?",
                         (session_id,)).fetchone()
    finally:
        db.close()
    return int(row[0])


@needs_chromium
def test_the_page_computes_on_webgpu_and_passes_conformance_on_every_served_family(static, tmp_path_factory, tmp_path):
    """Chromium with WebGPU (``--enable-unsafe-webgpu``: here SwiftShader, a GPU emulated on the
    CPU): with ``kernel=webgpu`` the page computes its experts' matrix products on the GPU (the
    elementwise steps in JavaScript, for the activations' exact rounding) and passes every step of
    ``kvasir conformance`` on the tiny model of every family the swarm serves, its answers within
    the audit bound and its projections through the row checks. With ``kernel=auto`` (the
    default) it sees a software adapter, says so, and computes with WebAssembly, faster there."""
    from test_status_page import _Chromium

    from kvasir.families import make_family_checkpoint

    models = tmp_path_factory.mktemp("webgpu-families")
    browser = _Chromium(tmp_path, 800, 600, flags=("--enable-unsafe-webgpu",))
    timings: dict[str, float] = {}
    try:
        for model_type in _served_families():
            model = make_family_checkpoint(models / model_type, model_type, dtype="bfloat16", shard="100KB")
            t0 = time.monotonic()
            steps, worker = _page_conformance(browser, static, f"gpu-{model_type}", model,
                                              tmp_path / f"{model_type}.log", kernel_line="WebGPU on ",
                                              e2e="auto", kernel="webgpu")
            timings[model_type] = time.monotonic() - t0
            assert "its projections pass the row checks" in steps["dispatch"].detail, (model_type, steps["dispatch"])
            assert any(v in steps["dispatch"].detail for v in ("every row within the audit bound",
                                                               "every row bitwise equal")), steps["dispatch"]
        _page_conformance(browser, static, "auto-qwen3_moe", static.model, tmp_path / "auto.log",
                          kernel_line="WebAssembly SIMD", log_line="a software one on the CPU", e2e="auto",
                          kernel="auto")
    finally:
        browser.close()
    print("\nWebGPU (SwiftShader) conformance per family, s: "
          + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))


@needs_chromium
def test_killing_the_page_mid_decode_changes_no_token_and_loses_no_receipted_credit(static, tmp_path):
    """A live swarm (ledger, TLS gateway, a hub receipting every 0.5 s, a Python worker on experts
    4-7, the page on 0-3 through the gateway) and a long decode: once the page has served calls
    and the ledger has credited a receipt for its session, Chromium is killed (SIGKILL, the
    browser and every process of it). The decode goes on: the backbone computes the page's
    experts itself, and its tokens are still the local run's; the page's wallet keeps every
    credit it had and, once the hub's receipts settle, is credited exactly the bytes the hub
    counted for its session (what the backbone accepted from it before the kill)."""
    import signal

    from test_status_page import _Chromium

    from kvasir.swarm import LocalSwarm

    model = static.model
    with LocalSwarm(tmp_path / "swarm") as sw:
        sw.start_ledger()
        sw.start_gateway()
        sw.start_hub(gateway=True, receipt_interval=0.5)
        sw.start_worker("python", model, "*:4-7")
        sw.wait_sessions(1, watch=["python"])
        browser = _Chromium(tmp_path, 800, 600)
        backbone = None
        try:
            browser.send("Security.setIgnoreCertificateErrors", ignore=True)
            browser.goto(_page_url(static, gateway=sw.gateway_url, experts="*:0-3"))
            state = _wait_phase(browser, ("connected", "refused", "failed"))
            assert state["phase"] == "connected" and state["experts"] == 16, state
            address = browser.eval("window.kvasirWorker.address()")
            page = next(s for s in sw.wait_sessions(2, watch=["python"]) if s.wallet == address)

            backbone = sw.start_backbone(["--model", str(model), "--prompt", "a tab closed mid-decode", "--batch", "2",
                                          "--max-new-tokens", "400", "--compare-local", "--wait-sessions", "2"])
            # Served calls, and a receipt of them credited, while the decode still runs.
            deadline = time.monotonic() + DEADLINE_S
            while True:
                assert backbone.poll() is None, "the decode ended before the page's work was credited: make it longer"
                calls = browser.eval("window.kvasirWorker.state().calls")
                before = sum(int(c.bytes) for c in sw.ledger_credits(address) if c.session_id == page.session_id)
                if calls > 0 and before > 0:
                    break
                assert time.monotonic() < deadline, (calls, before)
                time.sleep(0.1)
            chromium = browser.proc.pid
            for pid in [chromium, *_descendants(chromium)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            browser.proc.wait(10)
            killed_while_decoding = backbone.poll() is None
            result = sw.backbone_result(backbone, timeout=300)
            backbone = None
        finally:
            if backbone is not None and backbone.poll() is None:
                backbone.kill()
                backbone.wait(10)
            browser.close()
        assert killed_while_decoding, "the decode ended before the kill: make it longer"
        assert result["backbone_exit_code"] == 0, result
        assert result["tokens_identical"] is True, result
        assert result["verdict"] in ("within the audit bound, tokens identical", "bitwise equal"), result
        # The page's experts after the kill: computed by the backbone itself.
        assert result["local_rows"] > 0 or result["fallback_calls"] > 0, result
        assert result["sessions_quarantined"] == [] and result["row_check_refusals"] == 0, result
        work = result["work"]
        assert isinstance(work, dict) and work[page.session_id]["rows"] > 0, work

        # No credit lost: once the hub's receipts settle, the ledger holds, for the page's
        # session, every byte the hub counted for it (and never less than before the kill).
        contrib = tmp_path / "swarm" / "hub-contrib.sqlite"
        deadline = time.monotonic() + 60
        while True:
            counted = _hub_counted(contrib, page.session_id)
            credited = sum(int(c.bytes) for c in sw.ledger_credits(address) if c.session_id == page.session_id)
            if credited == counted:
                break
            assert time.monotonic() < deadline, f"ledger credited {credited} of the {counted} B the hub counted"
            time.sleep(0.2)
        assert credited == counted == work[page.session_id]["bytes"] >= before > 0, (credited, counted, before, work)
        print(f"\nkilled the page after {before} B credited; decode: {result['seconds']} s (stopped early on eos: "
              f"{result.get('stopped_early')}), local rows "
              f"{result['local_rows']}, fallback calls {result['fallback_calls']}; the page's session credited "
              f"{credited} B = the hub's count")
