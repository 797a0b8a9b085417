"""Only the backbone reaches a worker: real processes on 127.0.0.1 (hub, one worker,
backbone), port 0, every wait bounded.

* A client that opens a session's target before the backbone (raw HTTP/2 junk, a gRPC call
  without the key, one with a wrong key) neither takes the worker away nor gets its bytes
  spliced or counted; the backbone's decode stays remote and bitwise equal.
* Connections presenting no key are bounded per session (the oldest makes room) and closed
  after a deadline.
* WatchSessions without the token is bounded; ListSessions and the backbone's own watch
  keep working.
"""

from __future__ import annotations

import socket

import grpc
import pytest
from helpers import wait_until

from kvasir.swarm import LocalSwarm
from kvasir_rpc import expert_pb2, expert_pb2_grpc, session_pb2, session_pb2_grpc
from kvasir_rpc._access import TARGET_KEY_METADATA, bearer, target_key

# Integration: a real swarm.
pytestmark = pytest.mark.integration

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = bytes.fromhex("000000040000000000")


def frame(ftype: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([ftype, flags]) + stream.to_bytes(4, "big") + payload


def _connect(target: str) -> socket.socket:
    host, port = target.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=15)
    sock.settimeout(15)
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _is_open(sock: socket.socket) -> bool:
    """No EOF and no reset waiting on ``sock`` (it has nothing more to read)."""
    sock.settimeout(0.2)
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except TimeoutError:
        return True
    except ConnectionError:
        return False
    finally:
        sock.settimeout(15)


def _closed_by_hub(sock: socket.socket) -> bool:
    try:
        while sock.recv(65536):
            pass
    except ConnectionError:
        pass
    return True


def _request() -> expert_pb2.DispatchRequest:
    import torch

    from kvasir_rpc._codec import encode_tensor

    return expert_pb2.DispatchRequest(call_id=1, layer=0, hidden=encode_tensor(torch.randn(2, 64)),
                                      weights=encode_tensor(torch.ones(2)),
                                      segments=[expert_pb2.ExpertSegment(expert=0, rows=2)])


def _dispatch_code(target: str, metadata: tuple[tuple[str, str], ...]) -> tuple[grpc.StatusCode, str]:
    # Its own connection: grpcio would otherwise share one between channels to one address.
    with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        stub = expert_pb2_grpc.ExpertServiceStub(ch)
        try:
            next(iter(stub.Dispatch(iter([_request()]), timeout=15, metadata=metadata)))
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""


def _counted(sw: LocalSwarm) -> tuple[int, int]:
    (s,) = sw.list_sessions()
    return int(s.bytes_to_worker), int(s.bytes_from_worker)


@pytest.fixture(scope="module")
def swarm(tiny_models, tmp_path_factory):
    """A hub whose targets wait long for a key (so a squatter outlasts a decode) and one
    worker holding every expert."""
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path_factory.mktemp("access")) as sw:
        sw.start_hub(extra=["--target-auth-timeout", "300"])
        sw.start_worker("worker1", model, "all")
        sw.wait_sessions(1, watch=["worker1"])
        sw.model = model  # type: ignore[attr-defined]
        yield sw


def test_a_squatter_neither_takes_the_worker_nor_gets_spliced(swarm):
    (session,) = swarm.list_sessions()
    before = _counted(swarm)
    # Raw HTTP/2: the preface, SETTINGS and ignorable frames of an unknown type, held open.
    squatter = _connect(session.target)
    junk = PREFACE + frame(4, 0, 0) + b"".join(frame(0xFA, 0, 0, bytes(100)) for _ in range(20))
    squatter.sendall(junk)
    assert _recv_exactly(squatter, 9) == EMPTY_SETTINGS  # the hub's gate, not the worker, answered
    # gRPC calls without the key and with a wrong one (another session's, another token's).
    for metadata in [(), ((TARGET_KEY_METADATA, "0" * 64),),
                     ((TARGET_KEY_METADATA, target_key(swarm.backbone_token, "s1-000000000000")),),
                     ((TARGET_KEY_METADATA, target_key("x" * 32, session.session_id)),)]:
        code, details = _dispatch_code(session.target, metadata)
        assert code == grpc.StatusCode.PERMISSION_DENIED, (metadata, code, details)
        assert TARGET_KEY_METADATA in details
    # More than the gate reads before a first request: closed.
    flood = _connect(session.target)
    flood.sendall(PREFACE + frame(4, 0, 0) + b"".join(frame(0xFA, 0, 0, bytes(16_000)) for _ in range(5)))
    assert _closed_by_hub(flood)
    flood.close()
    assert _is_open(squatter)
    assert _counted(swarm) == before, "bytes of refused connections were counted for the worker"
    # The backbone connects while the squatter still holds its connection.
    result = swarm.run_backbone(["--model", str(swarm.model), "--prompt", "squatted", "--max-new-tokens", "4",
                                 "--compare-local"])
    assert result["backbone_exit_code"] == 0
    assert result["remote_calls"] > 0 and result["fallback_calls"] == 0
    assert result["tokens_identical"] is True and result["max_abs_logit_diff"] == 0.0
    assert session.session_id in result["sessions_used"]
    assert _is_open(squatter), "the squatter was still there during the decode"
    squatter.close()
    assert "target connection refused" in (swarm.logs / "hub.log").read_text()


def test_connections_without_a_key_are_bounded_and_cannot_keep_the_backbone_out(swarm):
    (session,) = swarm.list_sessions()
    silent = [_connect(session.target) for _ in range(8)]
    try:
        for s in silent:
            assert _recv_exactly(s, 9) == EMPTY_SETTINGS
        # A ninth makes room by dropping the oldest, so strangers that hold every slot
        # cannot keep out the backbone, whose key arrives one round trip after it connects.
        silent.append(_connect(session.target))
        assert _recv_exactly(silent[-1], 9) == EMPTY_SETTINGS
        wait_until(lambda: not _is_open(silent[0]), 15, "the oldest silent connection to be dropped")
        assert all(_is_open(s) for s in silent[1:])
        key = ((TARGET_KEY_METADATA, target_key(swarm.backbone_token, session.session_id)),)
        assert _dispatch_code(session.target, key) == (grpc.StatusCode.OK, "")
        wait_until(lambda: not _is_open(silent[1]), 15, "the next oldest to make room for the backbone")
        assert all(_is_open(s) for s in silent[2:])
    finally:
        for s in silent:
            s.close()
    assert "dropped for a newer connection" in (swarm.logs / "hub.log").read_text()


def test_a_silent_connection_is_closed_after_the_deadline(tiny_models, tmp_path):
    with LocalSwarm(tmp_path) as sw:
        sw.start_hub(extra=["--target-auth-timeout", "1"])
        sw.start_worker("worker1", tiny_models("qwen3_moe"), "all")
        (session,) = sw.wait_sessions(1, watch=["worker1"])
        sock = _connect(session.target)
        sock.sendall(PREFACE + frame(4, 0, 0))
        assert _recv_exactly(sock, 9) == EMPTY_SETTINGS
        wait_until(lambda: not _is_open(sock), 15, "the hub to close a connection that presents no key")
        sock.close()
        assert "no first request within 1 s" in (sw.logs / "hub.log").read_text()
        assert _counted(sw) == (0, 0)


def test_watchers_without_the_token_are_bounded(swarm):
    calls = []
    with grpc.insecure_channel(swarm.hub_grpc_address) as ch:
        stub = session_pb2_grpc.SessionServiceStub(ch)

        def watch(metadata: tuple[tuple[str, str], ...] = ()):  # type: ignore[no-untyped-def]
            call = stub.WatchSessions(session_pb2.WatchSessionsRequest(), metadata=metadata, timeout=120)
            calls.append(call)
            return call

        try:
            admitted = [watch() for _ in range(4)]
            for call in admitted:  # each holds a slot once it has its first event
                assert next(call).event.kind in (session_pb2.SessionEvent.KIND_ADDED,
                                                 session_pb2.SessionEvent.KIND_SYNCED)
            refused = [watch() for _ in range(16)]
            for call in refused:
                with pytest.raises(grpc.RpcError) as info:
                    next(call)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "backbone token" in info.value.details()
            with pytest.raises(grpc.RpcError) as info:
                next(watch(bearer("w" * 32)))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # ListSessions still answers, and the backbone's watch has its own allowance.
            assert len(stub.ListSessions(session_pb2.ListSessionsRequest(), timeout=5).sessions) == 1
            backbone_watch = watch(bearer(swarm.backbone_token))
            assert next(backbone_watch).event.kind == session_pb2.SessionEvent.KIND_ADDED
            result = swarm.run_backbone(["--model", str(swarm.model), "--prompt", "watched", "--max-new-tokens", "3"])
            assert result["remote_calls"] > 0 and result["fallback_calls"] == 0
            # A slot given back is taken again.
            admitted[0].cancel()

            def another_watch_admitted() -> bool:
                try:
                    next(watch())
                    return True
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    return False

            wait_until(another_watch_admitted, 15, "a freed watch slot")
        finally:
            for call in calls:
                call.cancel()
