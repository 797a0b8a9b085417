"""A backbone given the wrong --hub-token-file: the hub refuses its WatchSessions, and the wait
for --wait-sessions ends at once in one line naming the flag and the file it must be, instead
of waiting out --wait-timeout and blaming too few workers. In process: the hub's own session
server (or a fake SessionService) on 127.0.0.1:0, no subprocess."""

from __future__ import annotations

import argparse
import pathlib
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from backbone.cli._setup import _await_sessions
from backbone.experts._links import SessionWatcher
from kvasir_rpc import session_pb2, session_pb2_grpc
from relay.hub._registry import SessionRegistry
from relay.hub._sessions import create_session_server

HUB_TOKEN = "the-hubs-backbone-token-0123456789abcdef"


@pytest.fixture
def hub() -> Iterator[str]:
    """The hub's SessionService as the hub runs it (its stream limits check the token)."""
    server, port = create_session_server(SessionRegistry(), "127.0.0.1:0", backbone_token=HUB_TOKEN)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def _args(hub: str, wait_sessions: int = 2, wait_timeout: float = 60.0) -> argparse.Namespace:
    return argparse.Namespace(hub=hub, hub_token_file=pathlib.Path("WRONG"), wait_sessions=wait_sessions,
                              wait_timeout=wait_timeout)


def test_a_refused_token_ends_the_wait_at_once_with_the_hubs_words(hub: str) -> None:
    watcher = SessionWatcher(hub, token="not-the-hubs-token-0123456789abcdef")
    try:
        t0 = time.monotonic()
        assert not watcher.wait(lambda s: len(s) >= 2, timeout=30)
        assert time.monotonic() - t0 < 10
        assert watcher.refusal is not None and "wrong backbone token" in watcher.refusal
    finally:
        watcher.close()


def test_generate_and_serve_end_in_one_line_naming_the_token_file(hub: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    watcher = SessionWatcher(hub, token="not-the-hubs-token-0123456789abcdef")
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exited:
        _await_sessions(watcher, _args(hub))  # what build_setup (generate and serve) calls
    assert exited.value.code == 2 and time.monotonic() - t0 < 10
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"the hub at {hub} refused this backbone's token (the hub said: wrong backbone token" in err
    assert "--hub-token-file WRONG must be the hub's .kvasir/hub-backbone.token" in err
    assert "start more workers" not in err and "Traceback" not in err


def test_the_right_token_still_waits_and_counts(hub: str, capsys: pytest.CaptureFixture[str]) -> None:
    watcher = SessionWatcher(hub, token=HUB_TOKEN)
    try:
        assert watcher.wait(lambda s: len(s) >= 0, timeout=10) and watcher.refusal is None
    finally:
        watcher.close()
    watcher = SessionWatcher(hub, token=HUB_TOKEN)
    with pytest.raises(SystemExit) as exited:
        _await_sessions(watcher, _args(hub, wait_sessions=1, wait_timeout=0.5))
    assert exited.value.code == 3
    assert "listed 0 of the 1 sessions asked for (--wait-sessions)" in capsys.readouterr().err


class _FlakyHub(session_pb2_grpc.SessionServiceServicer):
    """Answers each WatchSessions call with the next code of ``codes`` (None: the snapshot of
    no sessions, then the stream stays open)."""

    def __init__(self, codes: list[grpc.StatusCode | None]) -> None:
        self.codes = codes
        self.calls = 0

    def WatchSessions(self, request, context):  # type: ignore[no-untyped-def]
        code = self.codes[min(self.calls, len(self.codes) - 1)]
        self.calls += 1
        if code is not None:
            context.abort(code, f"fake hub says {code.name}")
        yield session_pb2.WatchSessionsResponse(event=session_pb2.SessionEvent(kind=session_pb2.SessionEvent.KIND_SYNCED))
        while context.is_active():
            time.sleep(0.05)


@pytest.fixture
def flaky_hub():  # type: ignore[no-untyped-def]
    servers: list[grpc.Server] = []

    def start(codes: list[grpc.StatusCode | None]) -> tuple[str, _FlakyHub]:
        fake = _FlakyHub(codes)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        session_pb2_grpc.add_SessionServiceServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}", fake

    yield start
    for server in servers:
        server.stop(0)


def test_permission_denied_counts_as_a_refusal_and_is_forgotten_once_let_in(flaky_hub) -> None:  # type: ignore[no-untyped-def]
    address, _fake = flaky_hub([grpc.StatusCode.PERMISSION_DENIED] * 3 + [None])  # refused for 0.7 s of backoff
    watcher = SessionWatcher(address, token="t")
    try:
        assert not watcher.wait(lambda s: True, timeout=10)
        assert watcher.refusal == "fake hub says PERMISSION_DENIED"
        deadline = time.monotonic() + 10
        while not watcher.wait(lambda s: True, timeout=0.2):  # then let in: the hub took a new token file
            assert time.monotonic() < deadline
        assert watcher.refusal is None
    finally:
        watcher.close()


def test_other_errors_are_retried_and_are_no_refusal(flaky_hub) -> None:  # type: ignore[no-untyped-def]
    address, fake = flaky_hub([grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, None])
    watcher = SessionWatcher(address, token="t")
    try:
        assert watcher.wait(lambda s: True, timeout=10)
        assert watcher.refusal is None and fake.calls >= 3 and watcher.resubscribes >= 2
    finally:
        watcher.close()


@pytest.mark.integration
def test_backbone_generate_with_a_wrong_token_file_against_a_real_hub(tiny_models, tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    """The whole path: a hub process, ``python -m backbone generate`` with another token."""
    import os
    import subprocess
    import sys

    from kvasir.swarm import LocalSwarm

    wrong = tmp_path / "WRONG.token"
    wrong.write_text("b" * 64 + "\n")
    wrong.chmod(0o600)
    root = pathlib.Path(__file__).resolve().parent.parent
    with LocalSwarm(tmp_path / "swarm") as sw:
        sw.start_hub()
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "backbone", "generate", "--model", str(tiny_models("qwen3_moe")),
                              "--hub", sw.hub_grpc_address, "--hub-token-file", str(wrong), "--prompt", "x",
                              "--wait-sessions", "2", "--wait-timeout", "300"], capture_output=True, text=True,
                             timeout=300, cwd=root, stdin=subprocess.DEVNULL,
                             env={**os.environ, "KVASIR_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert time.monotonic() - t0 < 120  # not the --wait-timeout of 300 s
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"the hub at {sw.hub_grpc_address} refused this backbone's token (the hub said: wrong backbone token" \
        in lines[0]
    assert f"--hub-token-file {wrong} must be the hub's .kvasir/hub-backbone.token" in lines[0]
