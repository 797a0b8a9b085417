"""The hub's status document and metrics, in process with a fake clock: the expert map (holders
per layer x expert, 0 = local only), the rates and their bounded history, per-session credits
counted once per receipt, close reasons, and the Prometheus text a scrape gets."""

from __future__ import annotations

import pathlib

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvasir_rpc import ExpertSet, HelloInfo, ModelShape, Wallet, session_pb2
from relay.hub._contributions import ContributionStore
from relay.hub._http import HubCollector, hub_metrics
from relay.hub._registry import SessionRegistry
from relay.hub._status import HISTORY_POINTS, RATE_WINDOW, SAMPLE_S, StatusBoard
from relay.hub._work_desk import WorkDesk


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def hello(wallet: str, slices: dict[int, range]) -> HelloInfo:
    return HelloInfo(wallet=wallet, slices={layer: ExpertSet.of(ids) for layer, ids in slices.items()},
                     weights_digest=b"d" * 32, device="cpu", model_type="qwen3_moe", worker_version="test")


def add(registry: SessionRegistry, sid: str, slices: dict[int, range], **kw) -> str:  # type: ignore[no-untyped-def]
    wallet = Wallet.generate().address
    registry.add(sid, hello(wallet, slices), target="127.0.0.1:1", remote="127.0.0.1:2", **kw)
    return wallet


@pytest.fixture
def desk(tmp_path: pathlib.Path):  # type: ignore[no-untyped-def]
    registry = SessionRegistry()
    store = ContributionStore(tmp_path / "hub.sqlite")
    yield WorkDesk(registry, store, Wallet.generate(), quarantine_s=60.0)
    store.close()


def report(desk: WorkDesk, sid: str, nbytes: int, calls: int, rows: int, run: str = "r" * 16) -> None:
    desk.report(session_pb2.ReportWorkRequest(run_id=run, reports=[
        session_pb2.WorkReport(session_id=sid, cumulative_bytes=nbytes, calls=calls, rows=rows)]))


def test_the_expert_map_counts_holders_and_shows_local_only_experts() -> None:
    registry = SessionRegistry()
    board = StatusBoard(registry, hub_key="k", shape=ModelShape(layers=3, experts=4))
    add(registry, "a", {0: range(0, 2), 1: range(0, 4)})
    add(registry, "b", {0: range(1, 3), 1: range(2, 4)})
    holders = board.snapshot()["expert_map"]["holders"]  # type: ignore[index]
    assert holders == [[1, 2, 1, 0], [1, 1, 2, 2], [0, 0, 0, 0]]
    registry.remove("b", "worker_closed")
    holders = board.snapshot()["expert_map"]["holders"]  # type: ignore[index]
    assert holders == [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]


def test_without_a_configured_shape_the_map_is_what_sessions_have_shown_and_never_shrinks() -> None:
    registry = SessionRegistry()
    board = StatusBoard(registry, hub_key="k")
    assert board.snapshot()["model"] == {"layers": 0, "experts": 0, "source": "none"}
    add(registry, "a", {0: range(0, 4)})
    add(registry, "b", {1: range(4, 8)})
    assert board.snapshot()["model"] == {"layers": 2, "experts": 8, "source": "sessions"}
    registry.remove("b")
    st = board.snapshot()
    assert st["model"] == {"layers": 2, "experts": 8, "source": "sessions"}
    assert st["expert_map"]["holders"] == [[1, 1, 1, 1, 0, 0, 0, 0], [0] * 8]  # type: ignore[index]


def test_the_map_is_recomputed_only_when_the_live_set_changes() -> None:
    registry = SessionRegistry()
    board = StatusBoard(registry, hub_key="k", shape=ModelShape(layers=1, experts=2))
    add(registry, "a", {0: range(0, 1)})
    first = board.snapshot()["expert_map"]
    registry.count_bytes("a", to_worker=10)
    assert board.snapshot()["expert_map"] is first  # bytes moved: same map object
    add(registry, "b", {0: range(0, 2)})
    assert board.snapshot()["expert_map"]["holders"] == [[2, 1]]  # type: ignore[index]


def test_rates_come_from_recent_samples_and_the_history_is_bounded(desk: WorkDesk) -> None:
    clock, wall = FakeClock(), FakeClock()
    registry = desk.registry
    board = StatusBoard(registry, hub_key="k", desk=desk.statistics, clock=clock, wall=wall)
    add(registry, "a", {0: range(0, 2)})
    board.sample()
    assert board.rows_per_s("a") == 0.0  # one sample: no rate yet
    rows = 0
    for _ in range(3):
        clock.t += SAMPLE_S
        wall.t += SAMPLE_S
        rows += 100
        report(desk, "a", rows * 10, rows // 10, rows)
        registry.count_bytes("a", to_worker=1000, from_worker=500)
        board.sample()
    assert board.rows_per_s("a") == pytest.approx(100 / SAMPLE_S)
    st = board.snapshot()
    (session,) = st["sessions"]  # type: ignore[misc]
    assert session["rows"] == 300 and session["calls"] == 30 and session["rows_per_s"] == pytest.approx(50.0)
    points = st["history"]["points"]  # type: ignore[index]
    assert len(points) == 3
    assert points[-1]["rows_per_s"] == pytest.approx(50.0)
    assert points[-1]["bytes_per_s"] == pytest.approx(1500 / SAMPLE_S)
    assert points[-1]["work_bytes_per_s"] == pytest.approx(500.0)
    # The rate forgets what is older than its window; the history keeps HISTORY_POINTS.
    for _ in range(HISTORY_POINTS + RATE_WINDOW):
        clock.t += SAMPLE_S
        wall.t += SAMPLE_S
        board.sample()
    assert board.rows_per_s("a") == 0.0
    assert len(board.history()) == HISTORY_POINTS
    # An ended session's samples go with it.
    registry.remove("a")
    board.sample()
    assert board.rows_per_s("a") == 0.0 and not board._rows


def test_a_receipt_is_credited_to_its_session_once() -> None:
    registry = SessionRegistry()
    add(registry, "a", {0: range(1)})
    registry.credit("a", 1, 1000, 7000)
    registry.credit("a", 1, 1000, 7000)  # the ledger's DUPLICATE answer to a resend
    registry.credit("a", 2, 1500, 3500)
    registry.credit("gone", 1, 10, 70)  # not live: nothing
    (s,) = registry.statistics()
    assert (s.credited_bytes, s.credited_nano_kvr) == (1500, 10500)
    proto = s.to_proto()
    assert (proto.credited_bytes, proto.credited_nano_kvr) == (1500, 10500)
    st = StatusBoard(registry, hub_key="k").snapshot()
    assert st["sessions"][0]["credited_kvr"] == "0.000010500"  # type: ignore[index]


def test_the_status_document_holds_no_secret_and_names_the_path() -> None:
    registry = SessionRegistry()
    add(registry, "a", {0: range(1)}, via_gateway=True, encrypted=True)
    registry.set_rtt("a", 0.0125)
    (session,) = StatusBoard(registry, hub_key="hubkey").snapshot()["sessions"]  # type: ignore[misc]
    assert session["via"] == "gateway" and session["encrypted"] is True
    assert session["rtt_ms"] == pytest.approx(12.5)
    assert "target" not in session and "remote_address" not in session
    assert "127.0.0.1" not in repr(session)


def test_metrics_parse_and_count_what_the_hub_saw(desk: WorkDesk) -> None:
    registry = desk.registry
    metrics = hub_metrics(registry, HubCollector(registry, desk=desk.statistics))
    add(registry, "a", {0: range(2)})
    add(registry, "b", {0: range(2)}, via_gateway=True, encrypted=True)
    registry.count_bytes("a", to_worker=100, from_worker=40)
    registry.count_bytes("b", to_worker=5, from_worker=6)
    registry.set_rtt("a", 0.003)
    report(desk, "a", 900, 3, 12)
    report(desk, "missing", 900, 3, 12)
    registry.remove("b", "keepalive")
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics).decode())}

    def value(name: str, suffix: str = "_total", **labels: str) -> float:
        return next(s.value for s in families[name].samples
                    if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("kvasir_hub_sessions", "", encrypted="false", via="direct") == 1
    assert value("kvasir_hub_sessions", "", encrypted="true", via="gateway") == 0
    assert value("kvasir_hub_sessions_opened") == 2
    assert value("kvasir_hub_sessions_closed", reason="keepalive") == 1
    # Ended sessions' bytes stay counted.
    assert value("kvasir_hub_tunnel_bytes", direction="to_worker") == 105
    assert value("kvasir_hub_tunnel_bytes", direction="from_worker") == 46
    assert value("kvasir_hub_work_bytes") == 900 and value("kvasir_hub_work_rows") == 12
    assert value("kvasir_hub_work_refused") == 1
    assert value("kvasir_hub_worker_rtt_seconds", "_count") == 1
    assert value("kvasir_hub_worker_rtt_seconds", "_bucket", le="0.005") == 1
    # A repeated report adds nothing.
    report(desk, "a", 900, 3, 12)
    assert desk.statistics().work_bytes == 900


def test_the_status_shows_demand_and_the_share_routed_to_experts_no_one_holds(desk: WorkDesk) -> None:
    registry = desk.registry
    add(registry, "s1", {0: range(0, 4)})
    desk.report(session_pb2.ReportWorkRequest(run_id="d" * 16, demand=[
        session_pb2.ExpertDemand(layer=0, rows=[10, 0, 0, 0, 0, 30])]))
    doc = StatusBoard(registry, hub_key="k" * 64, shape=ModelShape(layers=1, experts=8)).snapshot()
    assert doc["demand"]["rows"][0][:6] == [10.0, 0.0, 0.0, 0.0, 0.0, 30.0]  # type: ignore[index]
    assert doc["demand"]["uncovered_share"] == 0.75  # type: ignore[index]
    (s,) = doc["sessions"]  # type: ignore[misc]
    assert (s["backbones"], s["backbones_max"], s["backbones_refused"]) == (0, 1, 0)


def test_a_demand_report_past_the_protocols_bounds_is_refused(desk: WorkDesk) -> None:
    from relay.hub._work_desk import DeskError

    with pytest.raises(DeskError) as caught:
        desk.report(session_pb2.ReportWorkRequest(run_id="d" * 16, demand=[
            session_pb2.ExpertDemand(layer=0, rows=[1] * 70_000)]))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and "demand" in caught.value.message


def test_the_map_names_the_runs_each_session_holds_and_the_totals_show_the_receipt_loops_troubles() -> None:
    from relay.hub._receipts import ReceiptSenderStats
    from relay.hub._work_desk import WorkDeskStats

    registry = SessionRegistry()
    add(registry, "a", {0: range(0, 3), 1: range(2, 4)})
    registry.add("b", HelloInfo(wallet="w", slices={0: ExpertSet.of([1, 3, 4, 9])}, weights_digest=b"d" * 32,
                                device="cpu", model_type="m", worker_version="t"), target="t", remote="r")
    registry.remove("gone-never-added", "keepalive")
    add(registry, "c", {0: range(1)})
    registry.remove("c", "keepalive")
    board = StatusBoard(registry, hub_key="k", shape=ModelShape(layers=2, experts=8),
                        desk=lambda: WorkDeskStats(reports=1, work_bytes=0, work_calls=0, work_rows=0, refused=4,
                                                   quarantines={"wrong_rows": 2, "bad_projection": 1}),
                        sender=lambda: ReceiptSenderStats(submitted=3, acked=2, rejected=1, refused=5, flushes=9,
                                                          ledger_errors=6, ended_recorded=0, ended_queued=0))
    doc = board.snapshot()
    # Runs of consecutive expert ids, both ends included; ids past the grid left out.
    assert doc["expert_map"]["holder_runs"] == {  # type: ignore[index]
        "a": [[0, 0, 2], [1, 2, 3]], "b": [[0, 1, 1], [0, 3, 4]]}
    t: dict = doc["totals"]  # type: ignore[assignment]
    assert (t["quarantines"], t["quarantines_by_violation"], t["work_refused"]) == (
        3, {"bad_projection": 1, "wrong_rows": 2}, 4)
    assert (t["receipts_acked"], t["receipts_rejected"], t["receipts_refused"], t["ledger_errors"]) == (2, 1, 5, 6)
    assert t["receipts_loop"] is True and t["sessions_closed_by"] == {"keepalive": 1}
    assert doc["demand"]["total_rows"] == 0.0  # type: ignore[index]
    bare = StatusBoard(registry, hub_key="k").snapshot()["totals"]
    assert bare["receipts_loop"] is False and bare["quarantines_by_violation"] == {}  # type: ignore[index]


def test_the_page_is_served_with_the_status_inside_and_nothing_in_it_can_end_its_script() -> None:
    """``/`` carries ``board.snapshot()`` in its "initial" element (the first paint shows it),
    escaped so a value holding ``</script>`` or ``<!--<script>`` stays inside the element."""
    import json
    import re

    import trio
    from prometheus_client import CollectorRegistry

    from relay.hub._http import embed_json, make_app

    registry = SessionRegistry()
    hostile = "</script><script>alert(1)</script><!--<script>&\u2028"
    registry.add("a", HelloInfo(wallet=hostile, slices={0: ExpertSet.of([0])}, weights_digest=b"d" * 32,
                                device="<!--<script>", model_type="m", worker_version="t"), target="t", remote="r")
    board = StatusBoard(registry, hub_key="k", shape=ModelShape(layers=1, experts=2))
    assert json.loads(embed_json({"w": hostile})) == {"w": hostile}
    assert not set(embed_json({"w": hostile}).decode()) & set("<>&\u2028")

    async def get(path: str) -> tuple[int, bytes]:
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(msg: dict) -> None:
            sent.append(msg)

        await make_app(board, CollectorRegistry())(
            {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": [],
             "server": ("test", 80), "client": ("test", 1)}, receive, send)  # type: ignore[arg-type]
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")

    status, body = trio.run(get, "/")
    page = body.decode()
    assert status == 200
    # One initial element, ending where the page put its end: nothing inside closed it early.
    (inside,) = re.findall(r'<script type="application/json" id="initial">(.*?)</script>', page, re.S)
    assert "<" not in inside and page.count("<script") == 2
    shown = json.loads(inside)
    assert shown["sessions"][0]["wallet"] == hostile and shown["sessions"][0]["device"] == "<!--<script>"
    assert shown["expert_map"]["holders"] == [[1, 0]] and shown["totals"]["sessions"] == 1
    status, body = trio.run(get, "/api/status")
    assert status == 200 and json.loads(body)["sessions"][0]["wallet"] == hostile


def test_the_status_lists_the_backbones_that_reported_with_their_load_and_shares(desk: WorkDesk) -> None:
    desk.report(session_pb2.ReportWorkRequest(run_id="b" * 16, status=session_pb2.BackboneStatus(
        kind="serve", running=3, waiting=1, remote_rows=90, local_rows=0, fallback_rows=10, worker_busy_refusals=2)))
    desk.report(session_pb2.ReportWorkRequest(run_id="g" * 16))  # no status: not listed
    doc = StatusBoard(desk.registry, hub_key="k" * 64).snapshot()
    (b,) = doc["backbones"]  # type: ignore[misc]
    assert (b["run"], b["kind"], b["running"], b["waiting"]) == ("b" * 12, "serve", 3, 1)
    assert (b["remote_share"], b["fallback_share"], b["worker_busy_refusals"]) == (0.9, 0.1, 2)


def test_each_session_shows_its_fallback_share_over_backbone_runs_and_the_latest_quarantines(desk: WorkDesk) -> None:
    add(desk.registry, "s1", {0: range(4)})
    wallet = add(desk.registry, "s2", {0: range(4)})

    def work(run: str, sid: str, nbytes: int, rows: int, fallback: int) -> None:
        desk.report(session_pb2.ReportWorkRequest(run_id=run, reports=[session_pb2.WorkReport(
            session_id=sid, cumulative_bytes=nbytes, calls=1, rows=rows, fallback_rows=fallback)]))

    work("a" * 16, "s1", 1000, 60, 10)
    work("a" * 16, "s1", 1000, 60, 10)  # the same report again: nothing more
    work("b" * 16, "s1", 500, 20, 10)   # a second backbone run: its own count, summed
    work("a" * 16, "s2", 1000, 80, 0)
    board = StatusBoard(desk.registry, hub_key="k" * 64, desk=desk.statistics)
    doc = board.snapshot()
    by = {s["session_id"]: s for s in doc["sessions"]}  # type: ignore[attr-defined]
    assert (by["s1"]["fallback_rows"], by["s1"]["fallback_share"]) == (20, 0.2)  # 20 of 80 + 20
    assert (by["s2"]["fallback_rows"], by["s2"]["fallback_share"]) == (0, 0.0)
    # Many runs of one session stay bounded and keep their sum.
    for i in range(SessionRegistry.MAX_FALLBACK_RUNS + 10):
        desk.registry.note_fallback("s2", f"{i:016d}", 1)
    assert desk.registry.get("s2").fallback_rows == SessionRegistry.MAX_FALLBACK_RUNS + 10  # type: ignore[union-attr]
    assert doc["quarantines"] == [] and doc["links"] == {"ledger": None, "gateways": []}

    desk.quarantine(session_pb2.QuarantineRequest(session_id="s2", violation=session_pb2.VIOLATION_ROW_CHECK,
                                                  layer=0, expert=3, detail="rows do not fit"))
    (q,) = board.snapshot()["quarantines"]  # type: ignore[misc]
    assert (q["session_id"], q["wallet"], q["violation"], q["expert"]) == ("s2", wallet, "VIOLATION_ROW_CHECK", 3)
    assert q["until_unix_ms"] > q["at_unix_ms"] > 0 and q["detail"] == "rows do not fit"


def test_the_links_name_the_ledger_with_its_pending_receipts_and_each_gateway_state() -> None:
    from relay.hub._gateway_link import GatewayLinkState
    from relay.hub._receipts import ReceiptSenderStats

    registry = SessionRegistry()
    link = GatewayLinkState("wss://gw.example:443")
    registry.gateway_links.append(link)
    stats = ReceiptSenderStats(submitted=0, acked=0, rejected=0, refused=0, flushes=3, ledger_errors=2,
                               ended_recorded=0, ended_queued=0, ledger="ledger.example:50051", pending=7,
                               last_error="StatusCode.UNAVAILABLE: connection refused")
    board = StatusBoard(registry, hub_key="k" * 64, sender=lambda: stats)
    links = board.snapshot()["links"]
    assert links["ledger"] == {"address": "ledger.example:50051", "pending_receipts": 7,  # type: ignore[index]
                               "last_answer_unix_ms": None,
                               "last_error": "StatusCode.UNAVAILABLE: connection refused"}
    (g,) = links["gateways"]  # type: ignore[index]
    assert (g["gateway"], g["state"], g["connects"]) == ("wss://gw.example:443", "connecting", 0)
    link.connects += 1
    link.to("connected")
    link.pairs_live = link.pairs_served = 2
    link.to("retrying", "closed by the gateway")
    (g,) = board.snapshot()["links"]["gateways"]  # type: ignore[index]
    assert (g["state"], g["last_error"], g["pairs_live"], g["connects"]) == ("retrying", "closed by the gateway", 2, 1)
