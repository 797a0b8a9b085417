"""A live `kvasir demo --stay` through the gateway, end to end: its verdict, the hub's status
page rendered by headless Chromium (the DOM it builds, and screenshots), every component's
/metrics, and `kvasir status`, all telling the same story; then a worker leaves and its experts
turn local-only on the page."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import time
import urllib.request

import pytest

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
DEADLINE_S = 120.0


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (a local test server)
        return resp.read()


def _status(url: str) -> dict:
    return json.loads(_get(url + "api/status"))


def _chromium(tmp_path: pathlib.Path, *args: str, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / "chromium-profile"
    profile.mkdir(exist_ok=True)
    # Virtual time lets the page's first poll and render finish before the dump, without
    # waiting in real time; the real-time bound is the subprocess timeout.
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-dev-shm-usage", f"--user-data-dir={profile}",
                           "--virtual-time-budget=5000", *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


def _screenshot(tmp_path: pathlib.Path, url: str, name: str) -> None:
    """The page at 1280x900 as a PNG in ``tmp_path``, copied to $KVASIR_SCREENSHOT_DIR if set."""
    shot = tmp_path / name
    done = _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,900", url)
    assert done.returncode == 0 and shot.stat().st_size > 10_000, done.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("KVASIR_SCREENSHOT_DIR"):
        out = pathlib.Path(os.environ["KVASIR_SCREENSHOT_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, out / name)


def _map_cells(dom: str) -> list[tuple[int, int, int]]:
    """(layer, expert, holders) of every cell of the page's expert map: its canvas carries the
    holders it drew, run-length encoded ("holders*count,..." per layer, ";" between layers)."""
    found = re.search(r'<canvas id="expert-map"[^>]*data-holders-rle="([^"]*)"', dom)
    assert found, "no expert map canvas on the page"
    cells: list[tuple[int, int, int]] = []
    for layer, row in enumerate(found.group(1).split(";") if found.group(1) else []):
        expert = 0
        for run in row.split(","):
            holders, count = (int(x) for x in run.split("*"))
            cells.extend((layer, expert + i, holders) for i in range(count))
            expert += count
    return cells


def _wait(what: str, check, timeout: float = DEADLINE_S):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(0.5)


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs chromium (make system-deps installs it)")
def test_a_live_demo_shows_on_its_page_its_metrics_and_kvasir_status(tiny_models, tmp_path: pathlib.Path) -> None:
    """`kvasir demo --stay` through the gateway: once the verdict is in and the swarm still
    runs, the status page (as Chromium renders it), every component's /metrics, and
    `kvasir status` / `kvasir balance` tell the same story as the verdict: both sessions,
    their bytes and credits, the expert map, non-zero throughput. Ctrl-C then stops it."""
    import signal
    import sys
    import threading

    import psutil
    from helpers import ROOT
    from prometheus_client.parser import text_string_to_metric_families

    from kvasir_rpc import read_model_info

    model = tiny_models("qwen3_moe")
    info = read_model_info(model)
    proc = subprocess.Popen([sys.executable, "-m", "kvasir", "demo", "--stay", "--json",
                             "--model", str(model), "--max-new-tokens", "4"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    lines: list[str] = []
    staying = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops it" in line:
                staying.set()

    def metrics(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        """{sample name: {sorted labels: value}} of one /metrics."""
        out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for family in text_string_to_metric_families(_get(url).decode()):
            for smp in family.samples:
                out.setdefault(smp.name, {})[tuple(sorted(smp.labels.items()))] = smp.value
        return out

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert staying.wait(400), "".join(lines[-40:])
        text = "".join(lines)
        # Printed early: before the decode's verdict.
        assert text.index("status page:") < text.index("Prometheus metrics:") < text.index("concurrent Generate")
        verdict = json.loads(next(line for line in lines if line.startswith("{")))
        # The verdict itself: through the backbone service, together and alone the same
        # tokens; alone, every logit of every step equal to the local service's (digests);
        # transformers' eager experts agree.
        assert verdict["tokens_identical"] is verdict["logits_identical"] is True, verdict
        assert verdict["reference_tokens_identical"] is True
        assert verdict["max_batch_size"] == 2 and verdict["n_tokens"] == 8
        assert verdict["remote_calls"] > 0 and verdict["fallback_calls"] == 0 and verdict["path"] == "gateway"
        assert len(verdict["sessions_used"]) == 2, "both workers must have served calls"
        # Honest workers are audited and never quarantined; nothing was replayed.
        assert verdict["audited_rows"] > 0 and verdict["sessions_quarantined"] == [] and verdict["replays"] == 0
        for s in verdict["sessions"]:
            # Paid for the work the backbone accepted, every byte of it once; never the
            # tunnel's framing around it.
            assert len(s["wallet"]) == 64 and s["bytes_in"] > 0 and s["bytes_out"] > 0, s
            assert 0 < s["bytes"] == s["credited_bytes"] < s["bytes_in"] + s["bytes_out"], s
            assert s["credited_nano_kvr"] == s["bytes"] * 7
        url, endpoints = verdict["status_url"], verdict["metrics_urls"]
        assert set(endpoints) == {"ledger", "gateway", "hub", "backbone"}, endpoints
        total = verdict["ledger_total_nano_kvr"]
        assert total > 0 and len(verdict["sessions"]) == 2
        by_id = {s["session_id"]: s for s in verdict["sessions"]}

        # The hub's JSON: both sessions with the verdict's bytes and credits, the full map,
        # throughput that was not zero while the decode ran.
        # (The ledger's answer reaches the hub a moment after the ledger shows the credit; a
        # round trip is measured at the hub's first keepalive, 15 s into a session.)
        status = _wait("every credit and round trip on the page", lambda: (
            (st := _status(url))["totals"]["credited_nano_kvr"] == total
            and all(s["rtt_ms"] is not None for s in st["sessions"]) and st), timeout=40)
        assert {s["session_id"] for s in status["sessions"]} == set(by_id)
        for s in status["sessions"]:
            assert s["credited_nano_kvr"] == by_id[s["session_id"]]["credited_nano_kvr"] > 0
            assert s["work_bytes"] == by_id[s["session_id"]]["bytes"] > 0
            assert s["via"] == "gateway"
        assert all(h == 1 for row in status["expert_map"]["holders"] for h in row)
        assert max(point["rows_per_s"] for point in status["history"]["points"]) > 0, status["history"]

        # The page, as a browser renders it.
        done = _chromium(tmp_path, "--dump-dom", url)
        assert done.returncode == 0, done.stderr[-2000:]
        dom = done.stdout
        assert 'id="session-count">2<' in dom
        for sid in by_id:
            assert f'data-session-id="{sid}"' in dom, f"session {sid} not on the page"
        cells = _map_cells(dom)
        assert len(cells) == info.num_layers * info.num_experts and all(h == 1 for _, _, h in cells)
        _screenshot(tmp_path, url, "status-page-demo.png")

        # Every component's /metrics.
        hub = metrics(endpoints["hub"])
        assert hub["kvasir_hub_sessions"][(("encrypted", "true"), ("via", "gateway"))] == 2
        assert sum(hub["kvasir_hub_sessions"].values()) == 2
        assert hub["kvasir_hub_worker_rtt_seconds_count"][()] >= 2
        assert hub["kvasir_hub_credited_nano_kvr_total"][()] == total
        assert hub["kvasir_hub_work_bytes_total"][()] == sum(s["bytes"] for s in verdict["sessions"])
        ledger = metrics(endpoints["ledger"])
        assert ledger["kvasir_ledger_credited_nano_kvr_total"][()] == total
        gateway = metrics(endpoints["gateway"])
        assert gateway["kvasir_gateway_sessions"][()] == 2
        assert all(v > 0 for v in gateway["kvasir_gateway_relayed_bytes_total"].values())
        backbone = verdict["backbone_metrics"]  # scraped before the backbone stopped
        assert backbone["kvasir_backbone_remote_rows_total"] == verdict["remote_rows"] > 0
        assert backbone["kvasir_backbone_expert_call_duration_seconds_count"] == verdict["remote_calls"]

        # The terminal's view.
        hub_grpc = re.search(r"hub: SessionService on (\S+)", text).group(1)  # type: ignore[union-attr]
        shown = subprocess.run([sys.executable, "-m", "kvasir", "status", "--hub", hub_grpc, "--json"],
                               capture_output=True, text=True, timeout=60, check=True)
        listed = {s["session_id"]: s for s in json.loads(shown.stdout)["sessions"]}
        assert set(listed) == set(by_id)
        for sid, s in listed.items():
            assert int(s["credited_nano_kvr"]) == by_id[sid]["credited_nano_kvr"]
            assert int(s["work_bytes"]) == by_id[sid]["bytes"]
            assert s["via_gateway"] is True and float(s["rtt_ms"]) > 0
        # The hub's tunnel counters are ListSessions' (keepalives are not tunnel payload).
        hub = metrics(endpoints["hub"])
        assert hub["kvasir_hub_tunnel_bytes_total"][(("direction", "to_worker"),)] == sum(
            int(s["bytes_to_worker"]) for s in listed.values())
        assert hub["kvasir_hub_tunnel_bytes_total"][(("direction", "from_worker"),)] == sum(
            int(s["bytes_from_worker"]) for s in listed.values())
        shown = subprocess.run([sys.executable, "-m", "kvasir", "status", "--hub", hub_grpc],
                               capture_output=True, text=True, timeout=60, check=True)
        assert "2 live sessions" in shown.stdout, shown.stdout

        # A worker leaves: its half of the map turns local-only (the backbone computes it),
        # on the page too, and the hub counts the close.
        half = info.num_experts // 2
        second = [c for c in psutil.Process(proc.pid).children(recursive=True)
                  if "worker" in c.cmdline() and f"*:{half}-{info.num_experts - 1}" in c.cmdline()]
        assert len(second) == 1, [c.cmdline() for c in psutil.Process(proc.pid).children(recursive=True)]
        second[0].terminate()
        after = _wait("one session left", lambda: (st := _status(url)) and len(st["sessions"]) == 1 and st)
        assert all(row[:half] == [1] * half and row[half:] == [0] * (info.num_experts - half)
                   for row in after["expert_map"]["holders"])
        done = _chromium(tmp_path, "--dump-dom", url)
        cells = _map_cells(done.stdout)
        assert {(e < half, h) for _, e, h in cells} == {(True, 1), (False, 0)}
        closed = metrics(endpoints["hub"])["kvasir_hub_sessions_closed_total"]
        assert sum(closed.values()) == 1, closed
        _screenshot(tmp_path, url, "status-page-local-only.png")

        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, "".join(lines[-20:])
        reader.join(10)
        assert "stopping the swarm" in "".join(lines)
        with pytest.raises(OSError):
            _get(url, timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


class _Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe:
    it reads commands on fd 3 and writes answers and events on fd 4, NUL-terminated JSON), one
    page attached. Enough of the protocol for a test: commands, awaited events, evaluation."""

    def __init__(self, tmp_path: pathlib.Path, width: int, height: int, flags: tuple[str, ...] = ()) -> None:
        """``flags``: more of Chromium's flags (``--enable-unsafe-webgpu`` gives a page WebGPU)."""
        import fcntl

        profile = tmp_path / "chromium-cdp-profile"
        profile.mkdir(exist_ok=True)
        to_chromium, self._to = os.pipe()
        self._from, from_chromium = os.pipe()
        # Above 9, so the shell's redirections onto 3 and 4 cannot clobber them.
        ins, outs = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_chromium, from_chromium))
        os.close(to_chromium)
        os.close(from_chromium)
        self._log = (tmp_path / "chromium-cdp.log").open("wb")
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage",
                f"--user-data-dir={profile}", "--remote-debugging-pipe", f"--window-size={width},{height}",
                "--hide-scrollbars", *flags, "about:blank"]
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$0" "$@" 3<&{ins} 4>&{outs} {ins}<&- {outs}>&-',
                                      CHROMIUM, *args], pass_fds=(ins, outs), stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        os.close(ins)
        os.close(outs)
        self._buf = b""
        self._id = 0
        self._events: list[dict] = []
        self.session: str | None = None
        targets = self.send("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.send("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
        self.send("Page.enable")
        self.send("Network.enable")
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                  mobile=False)

    def _read(self, deadline: float) -> dict:
        import select

        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from], [], [], left)[0]:
                raise AssertionError("chromium did not answer in time")
            chunk = os.read(self._from, 1 << 20)
            if not chunk:
                raise AssertionError(f"chromium closed its pipe (exit {self.proc.poll()})")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, timeout: float = 30.0, **params):  # type: ignore[no-untyped-def]
        self._id += 1
        msg: dict = {"id": self._id, "method": method, "params": params}
        if self.session is not None:
            msg["sessionId"] = self.session
        os.write(self._to, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            got = self._read(deadline)
            if got.get("id") == self._id:
                assert "error" not in got, f"{method}: {got['error']}"
                return got["result"]
            if "method" in got:
                self._events.append(got)

    def wait_event(self, method: str, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for i, ev in enumerate(self._events):
                if ev["method"] == method:
                    del self._events[i]
                    return ev["params"]
            got = self._read(deadline)
            if "method" in got:
                self._events.append(got)

    def eval(self, expression: str, timeout: float = 30.0):  # type: ignore[no-untyped-def]
        """The value of a JS expression in the page (a promise is awaited)."""
        res = self.send("Runtime.evaluate", timeout=timeout, expression=expression, returnByValue=True,
                        awaitPromise=True)
        assert "exceptionDetails" not in res, res["exceptionDetails"]
        return res["result"].get("value")

    def goto(self, url: str) -> None:
        self._events.clear()
        self.send("Page.navigate", url=url)
        self.wait_event("Page.loadEventFired")

    def hover(self, x: float, y: float) -> None:
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def screenshot(self, path: pathlib.Path, *, full: bool = False) -> None:
        import base64

        params: dict = {"format": "png"}
        if full:
            w, h = self.eval("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
            params.update(captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": w, "height": h, "scale": 1})
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", **params)["data"]))

    def close(self) -> None:
        try:
            self.session = None
            self.send("Browser.close", timeout=10)
        except (AssertionError, OSError):
            pass
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self._to)
        os.close(self._from)
        self._log.close()


def _serve_board(board, stack):  # type: ignore[no-untyped-def]
    """Serve ``make_app`` for ``board`` (with its sampling, as the hub's --http does) on a free
    local port, in a trio thread that ``stack`` stops; the port."""
    import queue
    import threading

    import trio

    from relay.hub._http import HubCollector, hub_metrics, serve_hub_http

    metrics = hub_metrics(board.registry, HubCollector(board.registry))
    started: queue.SimpleQueue = queue.SimpleQueue()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_hub_http, "127.0.0.1:0", board, metrics)
            started.put((port, trio.lowlevel.current_trio_token(), nursery.cancel_scope))

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    port, token, scope = started.get(timeout=30)

    def stop() -> None:
        trio.from_thread.run_sync(scope.cancel, trio_token=token)
        thread.join(10)

    stack.callback(stop)
    return port


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs chromium (make system-deps installs it)")
def test_the_page_at_a_real_shape_paints_real_data_first_and_its_map_fits_and_names_holders(
        tmp_path: pathlib.Path) -> None:
    """A hub's page for a 49 layers x 256 experts model with three workers and demand, in
    Chromium at 1280x900: the first paint (its polls blocked) shows the sessions, never "no live
    sessions"; per session its backbones, refusals and checks; the expert map is a canvas that
    fits the width (no horizontal scroll) and the screen; hovering a cell names its layer,
    expert, holders and demand; polls then bring a new session and redraw the map. Screenshots
    stay in tmp_path (their paths are printed)."""
    import contextlib

    from kvasir_rpc import ExpertSet, HelloInfo, ModelShape, Wallet
    from relay.hub._gateway_link import GatewayLinkState
    from relay.hub._http import page_with
    from relay.hub._receipts import ReceiptSenderStats
    from relay.hub._registry import SessionRegistry
    from relay.hub._status import StatusBoard
    from relay.hub._work_desk import QuarantineNote, WorkDeskStats

    layers, experts = 49, 256
    registry = SessionRegistry()

    def join(sid: str, slices: dict[int, range], **kw) -> str:  # type: ignore[no-untyped-def]
        wallet = Wallet.generate().address
        projections, channels = kw.pop("projections", True), kw.pop("channels", 4)
        hello = HelloInfo(wallet=wallet, slices={layer: ExpertSet.of(ids) for layer, ids in slices.items()},
                          weights_digest=b"d" * 32, device="cuda:0 NVIDIA H200", model_type="qwen3_moe",
                          worker_version="test", projections=projections, tunnel_channels=channels)
        registry.add(sid, hello, target="127.0.0.1:1", remote="127.0.0.1:2", **kw)
        return wallet

    # Layers x experts: s1 holds experts 0-127 everywhere, s2 64-191 (through a gateway), s3 (an
    # older worker, sampled audits only) 192-223 of the first 24 layers; the rest no one holds.
    join("s1-0a1b2c3d4e5f", {layer: range(0, 128) for layer in range(layers)}, encrypted=True)
    join("s2-1b2c3d4e5f60", {layer: range(64, 192) for layer in range(layers)}, via_gateway=True,
         encrypted=True)
    join("s3-2c3d4e5f6071", {layer: range(192, 224) for layer in range(24)}, projections=False, channels=0)
    for sid, opened, refused, rtt in (("s1-0a1b2c3d4e5f", 3, 0, 0.0042), ("s2-1b2c3d4e5f60", 4, 7, 0.0311),
                                      ("s3-2c3d4e5f6071", 1, 0, 0.0008)):
        for _ in range(opened):
            registry.note_connection(sid, opened=1)
        for _ in range(refused):
            registry.note_connection(sid, refused_busy=1)
        registry.set_rtt(sid, rtt)
        registry.count_bytes(sid, to_worker=123_456_789, from_worker=98_765_432)
        registry.set_work(sid, 50_000_000, calls=1200, rows=480_000)
        registry.credit(sid, 1, 50_000_000, 350_000_000)
    # The backbones' routers: rows to every expert of layer 3 (some to experts no one holds),
    # and a lot to expert 250 of layer 40, which no one holds.
    registry.demand.report("r" * 16, [(3, [10] * experts), (40, [0] * 250 + [5000])])
    # s2's calls were lost now and then: a fifth of the rows sent to it computed by the backbone.
    registry.note_fallback("s2-1b2c3d4e5f60", "r" * 16, 120_000)
    gateway = GatewayLinkState("wss://gw.example:443", state="connected", connects=2, pairs_live=1, pairs_served=5)
    registry.gateway_links.append(gateway)
    now_ms = int(time.time() * 1000)
    quarantined = QuarantineNote(session_id="s9-feedface0001", wallet="w" * 64, violation="VIOLATION_ROW_CHECK",
                                 layer=7, expert=99, detail="row 3 does not fit expert 99",
                                 at_unix_ms=now_ms - 30_000, until_unix_ms=now_ms + 3_600_000)
    board = StatusBoard(registry, hub_key="k" * 64, shape=ModelShape(layers=layers, experts=experts),
                        desk=lambda: WorkDeskStats(reports=12, work_bytes=150_000_000, work_calls=3600,
                                                   work_rows=1_440_000, refused=2,
                                                   quarantines={"wrong_rows": 1},
                                                   recent_quarantines=(quarantined,)),
                        sender=lambda: ReceiptSenderStats(submitted=9, acked=9, rejected=0, refused=3, flushes=40,
                                                          ledger_errors=1, ended_recorded=1, ended_queued=0,
                                                          credited_bytes=150_000_000,
                                                          credited_nano_kvr=1_050_000_000,
                                                          ledger="ledger.example:50051", pending=4,
                                                          last_answer_unix_ms=now_ms - 5_000))
    doc = board.snapshot()
    assert doc["totals"]["receipts_refused"] == 3 and doc["totals"]["ledger_errors"] == 1  # type: ignore[index]
    assert doc["totals"]["quarantines_by_violation"] == {"wrong_rows": 1}  # type: ignore[index]
    runs = doc["expert_map"]["holder_runs"]  # type: ignore[index]
    assert runs["s3-2c3d4e5f6071"][:2] == [[0, 192, 223], [1, 192, 223]]
    # The page is served with the document inside, escaped for a <script> element.
    served = page_with({"a": "</script><!--<script>&"}).decode()
    assert "</script><!--" not in served.split('id="initial">', 1)[1].split("</script>", 1)[0]
    assert json.loads(served.split('id="initial">', 1)[1].split("</script>", 1)[0]) == {"a": "</script><!--<script>&"}

    with contextlib.ExitStack() as stack:
        port = _serve_board(board, stack)
        url = f"http://127.0.0.1:{port}/"
        assert b'id="initial">{' in _get(url)
        browser = _Chromium(tmp_path, 1280, 900)
        stack.callback(browser.close)

        # The first paint, with every poll blocked: the document the page was served with.
        browser.send("Network.setBlockedURLs", urls=["*api/status*"])
        browser.goto(url)
        first = browser.eval("""({
            source: document.body.dataset.source,
            rows: [...document.querySelectorAll('#sessions tr')].map((tr) => ({
                id: tr.dataset.sessionId, text: tr.textContent, backbones: tr.dataset.backbones,
                max: tr.dataset.backbonesMax, refused: tr.dataset.backbonesRefused, checks: tr.dataset.checks})),
            count: document.getElementById('session-count').textContent,
            quarantines: document.getElementById('total-quarantines').textContent,
            ledger: document.getElementById('ledger').textContent,
            pending: document.getElementById('receipts-pending').textContent,
            uncovered: document.getElementById('uncovered-share').textContent})""")
        assert first["source"] == "initial" and first["count"] == "3", first
        assert "no live sessions" not in json.dumps(first) and "loading" not in json.dumps(first["rows"])
        rows = {r["id"]: r for r in first["rows"]}
        assert set(rows) == {"s1-0a1b2c3d4e5f", "s2-1b2c3d4e5f60", "s3-2c3d4e5f6071"}
        assert (rows["s2-1b2c3d4e5f60"]["backbones"], rows["s2-1b2c3d4e5f60"]["max"],
                rows["s2-1b2c3d4e5f60"]["refused"]) == ("4", "4", "7")
        assert rows["s3-2c3d4e5f6071"]["checks"] == "sampled" and rows["s1-0a1b2c3d4e5f"]["checks"] == "rows"
        assert "31.1 ms" in rows["s2-1b2c3d4e5f60"]["text"] and "0.35" in rows["s2-1b2c3d4e5f60"]["text"]
        assert first["quarantines"] == "1" and "wrong_rows 1" in first["ledger"]
        assert "1.05 KVR" in first["ledger"] and "unreachable" in first["ledger"]
        # Per session its fallback share; the ledger and gateway links; the latest quarantine.
        assert "20.0%" in rows["s2-1b2c3d4e5f60"]["text"] and "20.0%" not in rows["s1-0a1b2c3d4e5f"]["text"]
        assert re.search(r"ledger\.example:50051 · answered [5-9] s ago", first["ledger"]), first["ledger"]
        assert first["pending"] == "4"
        assert "wss://gw.example:443 · connected" in first["ledger"] and "1 workers now, 5 in all" in first["ledger"]
        assert "VIOLATION_ROW_CHECK · session s9-feedface0 · wallet" in first["ledger"]
        assert re.search(r"layer 7 expert 99 · 3\d s ago", first["ledger"]), first["ledger"]
        # Every column of the sessions table shows: none is scrolled away inside its box.
        assert browser.eval("(() => { const t = document.querySelector('#sessions').closest('table');"
                            " return t.getBoundingClientRect().width <= t.parentElement.clientWidth; })()")
        share = doc["demand"]["uncovered_share"]  # type: ignore[index]
        assert 0 < share < 1 and first["uncovered"] == f"{100 * share:.1f}%", (first["uncovered"], share)
        # The blocked poll fails; the page says so and keeps what it shows.
        failed = browser.eval("""new Promise((done) => { const t0 = Date.now(); (function check() {
            const line = document.getElementById('status-line');
            if (line.className === 'bad' || Date.now() - t0 > 8000) done([line.className, line.textContent,
                document.querySelectorAll('#sessions tr[data-session-id]').length]);
            else setTimeout(check, 100); })(); })""")
        assert failed[0] == "bad" and "unreachable" in failed[1] and failed[2] == 3, failed

        # The map: a canvas as wide as its section, no horizontal scrolling, all on one screen.
        geom = browser.eval("""(() => { const c = document.getElementById('expert-map');
            const r = c.getBoundingClientRect();
            return {left: r.left, top: r.top, width: r.width, height: r.height, pixels: c.width,
                    plot: c.dataset.plot.split(',').map(Number), layers: +c.dataset.layers,
                    experts: +c.dataset.experts, scrollWidth: document.documentElement.scrollWidth,
                    innerWidth: window.innerWidth, cells: document.querySelectorAll('#expert-map *').length}; })()""")
        assert geom["scrollWidth"] <= geom["innerWidth"] == 1280, geom
        assert (geom["layers"], geom["experts"]) == (layers, experts)
        assert 0 <= geom["left"] and geom["left"] + geom["width"] <= geom["innerWidth"] and geom["width"] > 1000
        assert geom["height"] <= 900 and geom["pixels"] == round(geom["width"]), geom
        left, top, cw, ch = geom["plot"]
        assert cw >= 3.5 and ch >= 6, geom  # every cell big enough to see and to point at
        holders = doc["expert_map"]["holders"]  # type: ignore[index]
        cells = _map_cells(browser.eval("document.getElementById('map-wrap').innerHTML"))
        assert [h for _, _, h in cells] == [h for row in holders for h in row]

        def hover(layer: int, expert: int) -> dict:
            # The whole map on the screen (scrolled to if need be), then the mouse on the cell.
            at = browser.eval("(() => { const c = document.getElementById('expert-map');"
                              " c.scrollIntoView({block: 'nearest'}); return c.getBoundingClientRect().toJSON(); })()")
            assert -1 <= at["top"] and at["bottom"] <= 901, at
            browser.hover(at["left"] + left + (expert + 0.5) * cw, at["top"] + top + (layer + 0.5) * ch)
            return browser.eval("""(() => { const t = document.getElementById('map-tip');
                return {shown: getComputedStyle(t).display !== 'none', layer: t.dataset.layer,
                        expert: t.dataset.expert, holders: t.dataset.holders, rows: t.dataset.demandRows,
                        text: t.innerText, box: t.getBoundingClientRect().toJSON()}; })()""")

        tip = hover(3, 100)
        assert tip["shown"] and (tip["layer"], tip["expert"], tip["holders"]) == ("3", "100", "2"), tip
        assert "layer 3 · expert 100" in tip["text"] and "holders: 2" in tip["text"]
        assert "s1-0a1b2c3d4e5f" in tip["text"] and "s2-1b2c3d4e5f60" in tip["text"] and "10.0 rows" in tip["text"]
        assert tip["box"]["right"] <= 1280
        tip = hover(40, 250)
        assert (tip["layer"], tip["expert"], tip["holders"]) == ("40", "250", "0"), tip
        assert "backbones compute it" in tip["text"] and float(tip["rows"]) > 4000
        tip = hover(10, 200)
        assert (tip["layer"], tip["expert"], tip["holders"]) == ("10", "200", "1") and "s3-2c3d4e5f6071" in tip["text"]
        tip = hover(48, 0)
        assert (tip["layer"], tip["expert"], tip["holders"]) == ("48", "0", "1"), tip
        shot = tmp_path / "status-page-49x256.png"
        browser.screenshot(shot)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
        full = tmp_path / "status-page-49x256-full.png"
        browser.screenshot(full, full=True)
        print(f"\nstatus page screenshots: {shot} {full}")

        # Polls: unblocked, they bring a session that joined since and redraw the map.
        join("s4-3d4e5f607182", {layer: range(224, 256) for layer in range(layers)})
        browser.send("Network.setBlockedURLs", urls=[])
        polled = browser.eval("""new Promise((done) => { const t0 = Date.now(); (function check() {
            const n = document.querySelectorAll('#sessions tr[data-session-id]').length;
            if ((document.body.dataset.source === 'poll' && n === 4) || Date.now() - t0 > 10000)
                done([document.body.dataset.source, n, document.getElementById('expert-map').dataset.generation,
                      document.getElementById('status-line').className]);
            else setTimeout(check, 100); })(); })""", timeout=20)
        assert polled[:2] == ["poll", 4] and polled[3] == "", polled
        assert int(polled[2]) > doc["expert_map"]["generation"]  # type: ignore[index]
        tip = hover(30, 240)
        assert (tip["layer"], tip["expert"], tip["holders"]) == ("30", "240", "1") and "s4-3d4e5f607182" in tip["text"]
