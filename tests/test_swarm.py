"""Real processes on 127.0.0.1: hub, workers and backbone as separate programs, port 0
everywhere, every wait bounded."""

from __future__ import annotations

import signal

import grpc
import psutil
import pytest
import torch
from helpers import wait_until

from kvasir.cli import run_demo
from kvasir.swarm import LocalSwarm
from kvasir_rpc import expert_pb2, expert_pb2_grpc, session_pb2
from kvasir_rpc._access import TARGET_KEY_METADATA, target_key
from kvasir_rpc._codec import decode_tensor, encode_tensor

# Integration: real swarms of processes.
pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("arch", "path"),
    # (qwen3_moe through the gateway: tests/test_status_page.py runs `kvasir demo` so and checks
    # the same verdict, with the page, the metrics and kvasir status.)
    [("qwen3_moe", "hub"), ("qwen3_5_moe", "gateway"), ("mixtral", "gateway")],
)
def test_demo_remote_equals_local_bitwise(arch, path, tiny_models, tmp_path):
    result = run_demo(arch, model=tiny_models(arch), path=path, say=lambda _msg: None, workdir=tmp_path)
    # What the swarm logged about sessions, shown if an assertion below fails.
    events = [line[:240] for log in sorted((tmp_path / "logs").glob("*.log")) for line in log.read_text().splitlines()
              if any(k in line for k in ("session", "tunnel", "keepalive", "error", "Error"))]
    # Through the backbone service: together and alone the same tokens; alone, every logit
    # of every step equal to the local service's (their SHA-256 digests).
    assert result["tokens_identical"] is True
    assert result["logits_identical"] is True
    assert result["reference_tokens_identical"] is True
    assert result["max_batch_size"] == 2 and result["n_tokens"] == 24
    assert result["remote_calls"] > 0 and result["remote_rows"] > 0
    assert result["fallback_calls"] == 0
    assert result["path"] == path
    assert str(result["status_url"]).startswith("http://127.0.0.1:")
    # Qwen3.5's shared expert was computed while the remote calls flew, bitwise as above.
    assert (result["shared_overlapped"] > 0) == (arch == "qwen3_5_moe")
    sessions = result["sessions"]
    assert len(sessions) == 2, events
    assert len(result["sessions_used"]) == 2, "both workers must have served calls"
    for s in sessions:
        assert len(s["wallet"]) == 64 and s["bytes_in"] > 0 and s["bytes_out"] > 0, (sessions, events)
        # Paid for the work the backbone accepted, every byte of it once; never the tunnel's
        # framing around it.
        assert 0 < s["bytes"] == s["credited_bytes"] < s["bytes_in"] + s["bytes_out"], s
        assert s["credited_nano_kvr"] == s["bytes"] * 7
    assert result["ledger_total_nano_kvr"] == sum(s["bytes"] * 7 for s in sessions)
    # Honest workers are audited and never quarantined; nothing was replayed.
    assert result["audited_rows"] > 0 and result["sessions_quarantined"] == [] and result["replays"] == 0


@pytest.fixture
def swarm(two_worker_swarm):
    """A hub and two workers holding half the experts each, shared by the tests below (and
    by test_stragglers' honest decode: conftest's session swarm)."""
    return two_worker_swarm


def test_worker_has_no_listening_tcp_or_udp_socket(swarm):
    for name in ("worker1", "worker2"):
        proc = psutil.Process(swarm.procs[name].pid)
        conns = proc.net_connections(kind="inet")
        listening = [c for c in conns if c.status == psutil.CONN_LISTEN]
        udp = [c for c in conns if c.type == __import__("socket").SOCK_DGRAM]
        assert listening == [] and udp == [], (name, conns)
        # It does hold its one outbound connection to the hub.
        assert any(c.raddr and c.raddr.port == swarm.hub_ws_port for c in conns)


def test_session_service_lists_what_workers_hold(swarm):
    sessions = sorted(swarm.list_sessions(), key=lambda s: s.slices[0].experts[0])
    assert [tuple(s.slices[0].experts) for s in sessions] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    for s in sessions:
        assert len(s.wallet) == 64 and len(s.weights_digest) == 32
        assert s.device == "cpu" and s.model_type == "qwen3_moe"
        assert [sl.layer for sl in s.slices] == [0, 1, 2, 3]
        assert s.connected_since_unix_ms > 0 and s.target.startswith("127.0.0.1:")
    assert sessions[0].weights_digest != sessions[1].weights_digest


def _dispatch(swarm: LocalSwarm, session: session_pb2.Session,
              req: expert_pb2.DispatchRequest) -> expert_pb2.DispatchResponse:
    """One call to ``session``'s target, presenting its key as the backbone does."""
    key = ((TARGET_KEY_METADATA, target_key(swarm.backbone_token, session.session_id)),)
    with grpc.insecure_channel(session.target) as ch:
        grpc.channel_ready_future(ch).result(timeout=15)
        stub = expert_pb2_grpc.ExpertServiceStub(ch)
        return next(iter(stub.Dispatch(iter([req]), timeout=15, metadata=key)))


def _request(hidden: torch.Tensor, experts: list[tuple[int, int]], layer: int = 0) -> expert_pb2.DispatchRequest:
    rows = hidden.shape[0]
    return expert_pb2.DispatchRequest(
        call_id=7, layer=layer, hidden=encode_tensor(hidden), weights=encode_tensor(torch.ones(rows)),
        segments=[expert_pb2.ExpertSegment(expert=e, rows=n) for e, n in experts],
    )


def test_expert_service_answers_bad_input_precisely_and_keeps_serving(swarm):
    session = min(swarm.list_sessions(), key=lambda s: s.slices[0].experts[0])  # holds experts 0-3
    good = _request(torch.randn(3, 64), [(0, 2), (1, 1)])
    cases = {
        "wrong width": (_request(torch.randn(3, 65), [(0, 3)]), grpc.StatusCode.INVALID_ARGUMENT),
        "wrong dtype": (_request(torch.zeros(3, 64, dtype=torch.int32), [(0, 3)]), grpc.StatusCode.INVALID_ARGUMENT),
        "rows not covered": (_request(torch.randn(3, 64), [(0, 2)]), grpc.StatusCode.INVALID_ARGUMENT),
        "expert not held": (_request(torch.randn(2, 64), [(5, 2)]), grpc.StatusCode.FAILED_PRECONDITION),
        "layer not held": (_request(torch.randn(2, 64), [(0, 2)], layer=9), grpc.StatusCode.FAILED_PRECONDITION),
    }
    short = _request(torch.randn(3, 64), [(0, 3)])
    short.hidden.data = short.hidden.data[:-1]
    cases["byte length"] = (short, grpc.StatusCode.INVALID_ARGUMENT)
    nan = _request(torch.full((1, 64), float("nan")), [(0, 1)])
    cases["nan"] = (nan, grpc.StatusCode.INVALID_ARGUMENT)
    # Deduplicated rows: an index past hidden's rows, or one entry short of the assignments.
    far = _request(torch.randn(2, 64), [(0, 2)])
    far.row_index[:] = [0, 2]
    cases["row_index out of range"] = (far, grpc.StatusCode.INVALID_ARGUMENT)
    few = _request(torch.randn(2, 64), [(0, 2)])
    few.row_index[:] = [1]
    cases["row_index too short"] = (few, grpc.StatusCode.INVALID_ARGUMENT)
    for name, (req, code) in cases.items():
        with pytest.raises(grpc.RpcError) as info:
            _dispatch(swarm, session, req)
        assert info.value.code() == code, (name, info.value.details())
        assert info.value.details(), name
    resp = _dispatch(swarm, session, good)
    assert resp.partials.call_id == 7 and list(resp.partials.partials.shape) == [3, 64]
    assert len(swarm.list_sessions()) == 2


def test_deduplicated_rows_give_the_same_partials(swarm):
    """A token routed to two experts of one worker can travel once (row_index): the
    partials equal those of the same assignments sent row by row, bitwise."""
    session = min(swarm.list_sessions(), key=lambda s: s.slices[0].experts[0])  # holds experts 0-3
    distinct = torch.randn(3, 64)
    index = [2, 0, 0, 1, 2]  # expert 0 gets rows 2 and 0, expert 3 gets rows 0, 1 and 2
    weights = torch.rand(5)
    segments = [expert_pb2.ExpertSegment(expert=0, rows=2), expert_pb2.ExpertSegment(expert=3, rows=3)]
    packed = expert_pb2.DispatchRequest(call_id=1, layer=1, hidden=encode_tensor(distinct),
                                        weights=encode_tensor(weights), segments=segments, row_index=index)
    spread = expert_pb2.DispatchRequest(call_id=2, layer=1, hidden=encode_tensor(distinct[index]),
                                        weights=encode_tensor(weights), segments=segments)
    a = decode_tensor(_dispatch(swarm, session, packed).partials.partials)
    b = decode_tensor(_dispatch(swarm, session, spread).partials.partials)
    assert a.shape == (5, 64) and torch.equal(a, b)
    assert packed.ByteSize() < spread.ByteSize()


def test_hub_refuses_bad_hello_and_keeps_serving(swarm):
    import trio

    from kvasir_rpc import HELLO_SIGNATURE_DOMAIN, Wallet, WsClosed, open_websocket, session_pb2
    from kvasir_rpc.protocol import TUNNEL_SUBPROTOCOL as SUBPROTOCOL

    wallet, other = Wallet.generate(), Wallet.generate()

    async def attempt(make_hello) -> tuple[int, str]:
        with trio.fail_after(15):
            async with open_websocket(swarm.hub_ws_url, subprotocols=[SUBPROTOCOL]) as ws:
                ch = session_pb2.SessionChallenge.FromString(await ws.receive_message())  # type: ignore[arg-type]
                await ws.send_message(make_hello(ch))
                try:
                    await ws.receive_message()
                except WsClosed as exc:
                    return exc.code, exc.reason
                return 0, "accepted"

    def body(ch, nonce=None):
        return session_pb2.HelloBody(
            nonce=nonce if nonce is not None else ch.nonce, hub_key=ch.hub_key, wallet=wallet.address,
            slices=[session_pb2.ExpertSlice(layer=0, experts=[0])], weights_digest=bytes(32), device="cpu",
        ).SerializeToString()

    def bad_signature(ch):
        b = body(ch)
        return session_pb2.SessionHello(body=b, signature=other.sign(HELLO_SIGNATURE_DOMAIN + b)).SerializeToString()

    def stale(ch):
        b = body(ch, nonce=bytes(32))
        return session_pb2.SessionHello(body=b, signature=wallet.sign(HELLO_SIGNATURE_DOMAIN + b)).SerializeToString()

    code, reason = trio.run(attempt, bad_signature)
    assert code == 4100 and "bad signature" in reason  # CloseCode.HELLO_INVALID: permanent
    code, reason = trio.run(attempt, stale)
    assert code == 4201 and "stale challenge" in reason  # CloseCode.HELLO_STALE: retry
    code, reason = trio.run(attempt, lambda ch: b"\xff\x00garbage")
    assert code == 1002
    assert len(swarm.list_sessions()) == 2
    # The real sessions still decode.
    result = swarm.run_backbone(["--model", str(swarm.model), "--prompt", "still here", "--max-new-tokens", "3"])
    assert result["remote_calls"] > 0 and result["fallback_calls"] == 0



@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "drained"])
def test_worker_lost_mid_decode_keeps_tokens_identical(sig, tiny_models, tmp_path):
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path) as sw:
        sw.start_hub()
        sw.start_worker("worker1", model, "*:0-3")
        sw.start_worker("worker2", model, "*:4-7")
        sw.wait_sessions(2, watch=["worker1", "worker2"])
        victim = max(sw.list_sessions(), key=lambda s: s.slices[0].experts[0]).session_id
        backbone = sw.start_backbone(["--model", str(model), "--prompt", "a long decode", "--max-new-tokens", "150",
                                      "--compare-local", "--wait-sessions", "2"])

        def victim_busy() -> bool:
            return any(s.session_id == victim and s.bytes_from_worker > 20_000 for s in sw.list_sessions())

        try:
            wait_until(victim_busy, 120, "the decode to reach worker2")
            sw.procs["worker2"].send_signal(sig)
        finally:
            result = sw.backbone_result(backbone, timeout=300)
        assert result["backbone_exit_code"] == 0
        assert result["tokens_identical"] is True and result["max_abs_logit_diff"] == 0.0
        assert result["n_tokens"] == 150
        assert victim in result["sessions_used"]
        assert sw.procs["worker2"].wait(timeout=30) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        wait_until(lambda: victim not in {s.session_id for s in sw.list_sessions()}, 30, "the hub to drop the session")
        assert len(sw.list_sessions()) == 1
        # A draining worker leaves once: it does not dial the hub again on its way out.
        assert (sw.logs / "worker2.log").read_text().count("session established") == 1


def test_worker_reconnects_after_hub_restart(tiny_models, tmp_path):
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path) as sw:
        sw.start_hub()
        ws_port = sw.hub_ws_port
        sw.start_worker("worker1", model, "all")
        first = sw.wait_sessions(1, watch=["worker1"])[0]
        sw.stop_process("hub")
        # Same address again, as a restarted service would have.
        sw.procs.pop("hub")
        ready = sw.workdir / "hub.ready.json"
        ready.unlink()
        sw._spawn("hub", ["-m", "relay", "hub", "--listen", f"127.0.0.1:{ws_port}", "--grpc", "127.0.0.1:0",
                          "--key", str(sw.workdir / "hub.key"), "--backbone-token-file", str(sw.backbone_token_file),
                          "--contrib-db", str(sw.workdir / "hub-contrib.sqlite"), "--ready-file", str(ready)])
        wait_until(ready.exists, 30, "the hub to restart")
        sw.hub_grpc_port = __import__("json").loads(ready.read_text())["grpc_port"]
        again = sw.wait_sessions(1, timeout=60, watch=["worker1"])[0]
        assert again.wallet == first.wallet and again.session_id != first.session_id
        result = sw.run_backbone(["--model", str(model), "--prompt", "back again", "--max-new-tokens", "2"])
        assert result["remote_calls"] > 0


def test_bfloat16_wire_halves_the_bytes_and_says_it_is_not_exact(swarm):
    def metered() -> int:
        return sum(s.bytes_to_worker + s.bytes_from_worker for s in swarm.list_sessions())

    args = ["--model", str(swarm.model), "--prompt", "narrow wire", "--max-new-tokens", "8", "--batch", "2"]
    t0 = metered()
    exact = swarm.run_backbone(args)
    t1 = metered()
    narrow = swarm.run_backbone([*args, "--wire-dtype", "bfloat16", "--compare-local"])
    t2 = metered()
    assert exact["wire_dtype"] == "float32" and exact["bit_exact_wire"] is True
    assert narrow["wire_dtype"] == "bfloat16" and narrow["bit_exact_wire"] is False
    assert narrow["remote_rows"] == exact["remote_rows"] > 0 and narrow["fallback_calls"] == 0
    # Tensor payload halves; the per-call framing does not.
    assert 0.45 < (t2 - t1) / (t1 - t0) < 0.65, (t1 - t0, t2 - t1)
    assert narrow["min_logit_cosine"] > 0.999
    assert narrow["max_abs_logit_diff"] > 0.0  # honest: not bit-exact


@pytest.mark.parametrize("groups", ["3", "auto"])
def test_pipelined_groups_stay_bitwise_equal(swarm, groups):
    result = swarm.run_backbone(["--model", str(swarm.model), "--prompt", "pipelined", "--max-new-tokens", "6",
                                 "--batch", "5", "--groups", groups, "--compare-local"])
    assert result["backbone_exit_code"] == 0
    assert result["tokens_identical"] is True and result["max_abs_logit_diff"] == 0.0
    assert result["reference_tokens_identical"] is True
    assert result["n_tokens"] == 30 and result["remote_calls"] > 0 and result["fallback_calls"] == 0
    if groups == "3":
        assert result["groups"] == 3 and result["groups_reason"] == "forced"
    else:
        assert 1 <= result["groups"] <= 5 and "measured tokens/s by groups" in result["groups_reason"]


def test_frozen_worker_is_dropped_and_rejoins_when_it_thaws(tiny_models, tmp_path):
    """A worker that stops answering (SIGSTOP: no FIN, no RST) must not stay listed forever:
    the hub's keepalive drops it; thawed, it notices its dead connection and rejoins."""
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path) as sw:
        sw.start_hub(extra=["--keepalive", "0.5", "--keepalive-timeout", "1"])
        sw.start_worker("worker1", model, "all")
        first = sw.wait_sessions(1, watch=["worker1"])[0]
        sw.procs["worker1"].send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: sw.list_sessions() == [], 20, "the hub to drop the frozen worker")
        finally:
            sw.procs["worker1"].send_signal(signal.SIGCONT)
        again = sw.wait_sessions(1, timeout=60, watch=["worker1"])[0]
        assert again.wallet == first.wallet and again.session_id != first.session_id
        result = sw.run_backbone(["--model", str(model), "--prompt", "thawed", "--max-new-tokens", "2"])
        assert result["remote_calls"] > 0 and result["fallback_calls"] == 0
