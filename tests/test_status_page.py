"""The hub's --http end to end: a live swarm (ledger, hub with --http, two workers on halves of
the experts, a backbone decode that does work), its /metrics against ListSessions, and the
status page rendered by headless Chromium (the DOM it builds, and a screenshot)."""

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
def test_status_page_shows_the_swarm(tiny_models, tmp_path: pathlib.Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from kvasir_rpc import read_model_info
    from kvasir_rpc.dev.swarm import LocalSwarm

    model = tiny_models("qwen3_moe")
    info = read_model_info(model)
    half = info.num_experts // 2
    with LocalSwarm(tmp_path / "swarm") as sw:
        sw.start_ledger()
        sw.start_hub(http=True, extra=["--keepalive", "1"])
        url = sw.status_url
        sw.start_worker("worker1", model, f"*:0-{half - 1}")
        sw.start_worker("worker2", model, f"*:{half}-{info.num_experts - 1}")
        sw.wait_sessions(2, watch=["worker1", "worker2"])
        sw.run_backbone(["--model", str(model), "--prompt", "The swarm", "--max-new-tokens", "6"], timeout=300)
        sessions = sw.list_sessions()
        assert len(sessions) == 2 and all(s.work_bytes > 0 for s in sessions)
        sw.wait_credited(sessions)
        # The ledger's answer reaches the hub's session records with the next receipt pass.
        status = _wait("credits and round trips on /api/status", lambda: (
            (st := _status(url)) and all(s["credited_nano_kvr"] > 0 and s["rtt_ms"] is not None
                                         for s in st["sessions"]) and len(st["sessions"]) == 2 and st))
        by_id = {s["session_id"]: s for s in status["sessions"]}
        listed = {s.session_id: s for s in sw.list_sessions()}
        assert set(by_id) == set(listed)
        for sid, s in listed.items():
            assert s.credited_nano_kvr == by_id[sid]["credited_nano_kvr"] > 0
            assert s.work_rows == by_id[sid]["rows"] > 0 and s.work_calls == by_id[sid]["calls"] > 0
            assert s.rtt_ms > 0
        emap = status["expert_map"]
        assert (emap["layers"], emap["experts"]) == (info.num_layers, info.num_experts)
        assert all(h == 1 for row in emap["holders"] for h in row)
        assert status["totals"]["credited_nano_kvr"] == sum(s["credited_nano_kvr"] for s in status["sessions"])

        # /metrics parses, and its tunnel bytes are ListSessions' (no session has ended).
        families = {f.name: f for f in text_string_to_metric_families(_get(url + "metrics").decode())}
        listed = {s.session_id: s for s in sw.list_sessions()}
        tunnel = {smp.labels["direction"]: smp.value for smp in families["kvasir_hub_tunnel_bytes"].samples
                  if smp.name.endswith("_total")}
        # Keepalive pings are not tunnel payload, so the counters hold still between the calls.
        assert tunnel["to_worker"] == sum(s.bytes_to_worker for s in listed.values())
        assert tunnel["from_worker"] == sum(s.bytes_from_worker for s in listed.values())
        live = {(smp.labels["encrypted"], smp.labels["via"]): smp.value
                for smp in families["kvasir_hub_sessions"].samples}
        assert live[("false", "direct")] == 2 and sum(live.values()) == 2
        work = next(smp.value for smp in families["kvasir_hub_work_bytes"].samples if smp.name.endswith("_total"))
        assert work == sum(s.work_bytes for s in listed.values())
        rtt = {smp.name: smp.value for smp in families["kvasir_hub_worker_rtt_seconds"].samples
               if not smp.labels.get("le")}
        assert rtt["kvasir_hub_worker_rtt_seconds_count"] >= 2
        credited = next(smp.value for smp in families["kvasir_hub_credited_nano_kvr"].samples
                        if smp.name.endswith("_total"))
        assert credited == status["totals"]["credited_nano_kvr"]

        # The page, as a browser renders it.
        done = _chromium(tmp_path, "--dump-dom", url)
        assert done.returncode == 0, done.stderr[-2000:]
        dom = done.stdout
        assert 'data-loaded="true"' in dom, dom[-3000:]
        for sid, s in by_id.items():
            row = re.search(rf'<tr data-session-id="{re.escape(sid)}"[^>]*>', dom)
            assert row is not None, f"session {sid} not on the page"
            attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', row.group(0)))
            assert int(attrs["data-bytes-in"]) > 0 and int(attrs["data-bytes-out"]) > 0
            assert int(attrs["data-credited-nano-kvr"]) > 0
        cells = re.findall(r'<div class="cell h\d" data-layer="(\d+)" data-expert="(\d+)" data-holders="(\d+)"', dom)
        assert len(cells) == info.num_layers * info.num_experts
        assert all(int(h) == 1 for _, _, h in cells)
        assert f'id="session-count">2<' in dom
        credited_kvr = re.search(r'id="total-credited">([0-9.]+) KVR<', dom)
        assert credited_kvr is not None and float(credited_kvr.group(1)) > 0

        _screenshot(tmp_path, url, "status-page.png")

        # A local-only expert shows as such: stop one worker and its half goes to 0.
        sw.stop_process("worker2")
        after = _wait("one session left", lambda: (st := _status(url)) and len(st["sessions"]) == 1 and st)
        holders = after["expert_map"]["holders"]
        assert all(row[:half] == [1] * half and row[half:] == [0] * (info.num_experts - half) for row in holders)
        done = _chromium(tmp_path, "--dump-dom", url)
        cells = re.findall(r'data-layer="(\d+)" data-expert="(\d+)" data-holders="(\d+)"', done.stdout)
        assert {(int(e) < half, int(h)) for _, e, h in cells} == {(True, 1), (False, 0)}

        # Its closing is counted, with why.
        families = {f.name: f for f in text_string_to_metric_families(_get(url + "metrics").decode())}
        closed = {smp.labels["reason"]: smp.value for smp in families["kvasir_hub_sessions_closed"].samples
                  if smp.name.endswith("_total")}
        assert sum(closed.values()) == 1, closed

        _screenshot(tmp_path, url, "status-page-local-only.png")


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs chromium (make system-deps installs it)")
def test_a_live_demo_shows_on_its_page_its_metrics_and_kvasir_status(tiny_models, tmp_path: pathlib.Path) -> None:
    """`kvasir demo --stay` through the gateway: once the verdict is in and the swarm still
    runs, the status page (as Chromium renders it), every component's /metrics, and
    `kvasir status` / `kvasir balance` tell the same story as the verdict: both sessions,
    their bytes and credits, the expert map, non-zero throughput. Ctrl-C then stops it."""
    import signal
    import sys
    import threading

    from prometheus_client.parser import text_string_to_metric_families

    from helpers import ROOT
    from kvasir_rpc import read_model_info

    model = tiny_models("qwen3_moe")
    info = read_model_info(model)
    proc = subprocess.Popen([sys.executable, "-m", "kvasir_rpc", "demo", "--stay", "--json",
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
        assert verdict["tokens_identical"] and verdict["logits_identical"], verdict
        url, endpoints = verdict["status_url"], verdict["metrics_urls"]
        assert set(endpoints) == {"ledger", "gateway", "hub", "backbone"}, endpoints
        total = verdict["ledger_total_nano_kvr"]
        assert total > 0 and len(verdict["sessions"]) == 2
        by_id = {s["session_id"]: s for s in verdict["sessions"]}

        # The hub's JSON: both sessions with the verdict's bytes and credits, the full map,
        # throughput that was not zero while the decode ran.
        status = _wait("every credit on the page", lambda: (st := _status(url))["totals"]["credited_nano_kvr"] == total
                       and st, timeout=30)
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
        cells = re.findall(r'data-layer="(\d+)" data-expert="(\d+)" data-holders="(\d+)"', dom)
        assert len(cells) == info.num_layers * info.num_experts and all(h == "1" for _, _, h in cells)
        _screenshot(tmp_path, url, "status-page-demo.png")

        # Every component's /metrics.
        hub = metrics(endpoints["hub"])
        assert sum(hub["kvasir_hub_sessions"].values()) == 2
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
        shown = subprocess.run([sys.executable, "-m", "kvasir_rpc", "status", "--hub", hub_grpc, "--json"],
                               capture_output=True, text=True, timeout=60, check=True)
        listed = {s["session_id"]: s for s in json.loads(shown.stdout)["sessions"]}
        assert set(listed) == set(by_id)
        for sid, s in listed.items():
            assert int(s["credited_nano_kvr"]) == by_id[sid]["credited_nano_kvr"]
            assert int(s["work_bytes"]) == by_id[sid]["bytes"]
        shown = subprocess.run([sys.executable, "-m", "kvasir_rpc", "status", "--hub", hub_grpc],
                               capture_output=True, text=True, timeout=60, check=True)
        assert "2 live sessions" in shown.stdout, shown.stdout

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
