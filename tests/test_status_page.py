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
        cells = re.findall(r'data-layer="(\d+)" data-expert="(\d+)" data-holders="(\d+)"', dom)
        assert len(cells) == info.num_layers * info.num_experts and all(h == "1" for _, _, h in cells)
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
        shown = subprocess.run([sys.executable, "-m", "kvasir_rpc", "status", "--hub", hub_grpc, "--json"],
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
        shown = subprocess.run([sys.executable, "-m", "kvasir_rpc", "status", "--hub", hub_grpc],
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
        cells = re.findall(r'data-layer="(\d+)" data-expert="(\d+)" data-holders="(\d+)"', done.stdout)
        assert {(int(e) < half, int(h)) for _, e, h in cells} == {(True, 1), (False, 0)}
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
