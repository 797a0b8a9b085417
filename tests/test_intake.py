"""Malformed upgrades, in memory and on a fake clock: the gateway (``Gateway._handle``) and the
hub's intake (``UpgradeIntake.screen``) answer each with its precise 4xx, count it, log it
in exactly one line (never a traceback) and close the connection; the refusal log keeps a
flood to a bounded number of lines. tests/test_gateway.py and tests/test_swarm.py send the
same requests to real processes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import structlog
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from probes import GOOD, KEY, PROBES
from structlog.testing import capture_logs

from kvasir_rpc import HttpRequest
from relay._intake import UpgradeIntake, upgrade_refusal
from relay._refusals import RefusalLog
from relay.gateway._gateway import Gateway, GatewayConfig

TOKEN = "s3cret-hub-token"
REMOTE = "203.0.113.7:50123"
BUDGET_S = 60.0  # fake seconds a test may take


def run(fn: Callable[[], Awaitable[None]]) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def parse_answer(data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (names lower-case) and body of one HTTP/1.1 answer."""
    top, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = top.decode("latin-1").split("\r\n")
    assert status_line.startswith("HTTP/1.1 "), data[:200]
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    assert int(headers["content-length"]) == len(body), data[:300]
    return int(status_line.split()[1]), headers, body


async def exchange(serve: Callable[[trio.abc.Stream], Awaitable[None]], data: bytes) -> bytes:
    """Send ``data`` and EOF to ``serve`` over an in-memory stream and read until it closes."""
    client, server = trio.testing.memory_stream_pair()
    got = bytearray()
    with trio.fail_after(BUDGET_S):
        async with trio.open_nursery() as nursery:

            async def serve_and_close() -> None:
                try:
                    await serve(server)
                finally:
                    await server.aclose()

            nursery.start_soon(serve_and_close)
            try:
                await client.send_all(data)
                await client.send_eof()
            except trio.BrokenResourceError:
                pass  # the server answered and closed before reading it all (a head too big)
            while chunk := await client.receive_some(1 << 16):
                got += chunk
    return bytes(got)


def refusal_lines(logs: list[dict[str, object]]) -> list[dict[str, object]]:
    for entry in logs:
        assert "exc_info" not in entry and entry["log_level"] not in ("error", "critical"), entry
    return [e for e in logs if e["event"] == "connection refused"]


# -- the gateway -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/worker", "/v1/hub/control"])
@pytest.mark.parametrize("name", list(PROBES))
def test_the_gateway_answers_each_malformed_upgrade_once_with_its_4xx(name: str, path: str) -> None:
    data, status, reason, header = PROBES[name]
    data = data.replace(b" /v1/worker ", b" " + path.encode() + b" ", 1)
    if path != "/v1/worker":
        data = data.replace(b"\r\n\r\n", f"\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode(), 1)

    async def main() -> None:
        gateway = Gateway(GatewayConfig(hub_token=TOKEN, handshake_timeout_s=30.0))
        with capture_logs() as logs:
            answer = await exchange(lambda s: gateway._handle(s, REMOTE), data)  # type: ignore[arg-type]
        got_status, headers, body = parse_answer(answer)
        assert got_status == status, answer
        if header is not None:
            assert headers[header[0]] == header[1], headers
        assert body.strip(), "the answer says what is wrong"
        assert gateway.statistics().refused == {reason: 1}
        lines = refusal_lines(logs)
        assert len(lines) == 1 and len(logs) == 1, logs
        assert lines[0]["reason"] == reason and lines[0]["status"] == status and lines[0]["remote"] == REMOTE

    run(main)


def test_the_gateway_keeps_serving_after_malformed_upgrades() -> None:
    async def main() -> None:
        gateway = Gateway(GatewayConfig(hub_token=TOKEN, handshake_timeout_s=30.0))
        for data, *_ in PROBES.values():
            await exchange(lambda s: gateway._handle(s, REMOTE), data)  # type: ignore[arg-type]
        # A well-formed upgrade now gets as far as it can without a hub: 503, not a refusal of its form.
        status, headers, _ = parse_answer(await exchange(lambda s: gateway._handle(s, REMOTE), GOOD))  # type: ignore[arg-type]
        assert status == 503 and headers["retry-after"] == "5"
        assert sum(gateway.statistics().refused.values()) == len(PROBES) + 1

    run(main)


def test_a_client_gone_before_a_whole_head_is_counted_and_logged_without_an_answer() -> None:
    async def main() -> None:
        gateway = Gateway(GatewayConfig(hub_token=TOKEN, handshake_timeout_s=30.0))
        with capture_logs() as logs:
            assert await exchange(lambda s: gateway._handle(s, REMOTE), GOOD[:30]) == b""  # type: ignore[arg-type]
        assert gateway.statistics().refused == {"incomplete": 1}
        assert len(refusal_lines(logs)) == 1 == len(logs)

    run(main)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(
    st.binary(max_size=400),
    st.builds(lambda cut, junk: GOOD[:cut] + junk, st.integers(0, len(GOOD)), st.binary(max_size=40)),
    st.builds(lambda drop: b"\r\n".join(x for i, x in enumerate(GOOD.split(b"\r\n")) if i != drop),
              st.integers(1, 7)),
))
def test_any_bytes_get_an_answer_or_a_close_and_at_most_one_line(data: bytes) -> None:
    async def main() -> None:
        gateway = Gateway(GatewayConfig(hub_token=TOKEN, handshake_timeout_s=30.0))
        with capture_logs() as logs:
            answer = await exchange(lambda s: gateway._handle(s, REMOTE), data)  # type: ignore[arg-type]
        if answer:
            status, _, _ = parse_answer(answer)
            assert status in (200, 400, 401, 404, 405, 414, 426, 431, 503), answer
        assert len(logs) <= 1 and len(refusal_lines(logs)) == len(logs)
        assert sum(gateway.statistics().refused.values()) == len(logs)

    run(main)


# -- the hub's intake ----------------------------------------------------------------------------


async def _no_handler(stream: trio.abc.Stream, request: object, remote: str) -> None:
    raise AssertionError("screen() hands nothing on: it returns the request")


def intake(refusals: RefusalLog, timeout_s: float = 10.0) -> UpgradeIntake:
    # screen() needs no listener: the test hands it each stream itself.
    return UpgradeIntake([object()], refusals, timeout_s=timeout_s, handle=_no_handler)  # type: ignore[list-item]


@pytest.mark.parametrize("name", list(PROBES))
def test_the_hub_intake_answers_each_malformed_upgrade_once_with_its_4xx(name: str) -> None:
    data, status, reason, header = PROBES[name]

    async def main() -> None:
        refusals = RefusalLog(structlog.get_logger("test"))
        screen = intake(refusals)
        with capture_logs() as logs:
            answer = await exchange(lambda s: screen.screen(s, REMOTE), data)
        got_status, headers, body = parse_answer(answer)
        assert got_status == status, answer
        if header is not None:
            assert headers[header[0]] == header[1], headers
        assert body.strip()
        assert refusals.counts() == {reason: 1}
        lines = refusal_lines(logs)
        assert len(lines) == 1 == len(logs) and lines[0]["reason"] == reason

    run(main)


def test_the_hub_intake_hands_on_a_good_upgrade_with_the_bytes_after_its_head() -> None:
    frame = b"\x82\x82abcd" + bytes(x ^ y for x, y in zip(b"hi", b"abcd"))

    async def main() -> None:
        refusals = RefusalLog(structlog.get_logger("test"))
        screen = intake(refusals)
        client, server = trio.testing.memory_stream_pair()
        with trio.fail_after(BUDGET_S):
            await client.send_all(GOOD + frame)
            request = await screen.screen(server, REMOTE)
            assert request is not None and request.is_upgrade and request.trailing == frame
            await server.send_all(b"answer")  # the stream is the handler's, as it was
            assert await client.receive_some(100) == b"answer"
        assert refusals.counts() == {}

    run(main)


def test_the_hub_intake_closes_a_silent_connection_after_its_deadline() -> None:
    async def main() -> None:
        refusals = RefusalLog(structlog.get_logger("test"))
        screen = intake(refusals, timeout_s=3.0)
        client, server = trio.testing.memory_stream_pair()
        t0 = trio.current_time()
        with capture_logs() as logs, trio.fail_after(BUDGET_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(screen.screen, server, REMOTE)
                await client.send_all(GOOD[:20])
                assert await client.receive_some(100) == b""
        assert trio.current_time() - t0 == pytest.approx(3.0)
        assert refusals.counts() == {"handshake_timeout": 1} and len(refusal_lines(logs)) == 1 == len(logs)

    run(main)


# -- the rate limit on refusal lines ------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_logs_n_lines_per_interval_then_one_summary() -> None:
    clock = FakeClock()
    refusals = RefusalLog(structlog.get_logger("test"), lines_per_interval=3, interval_s=10.0, clock=clock)
    with capture_logs() as logs:
        for i in range(50):
            refusals.refused("ws_key", remote=f"198.51.100.{i}:1")
            clock.now += 0.1  # 50 in 5 s
        refusals.flush()  # the window is not over: nothing yet
        assert [e["remote"] for e in logs] == ["198.51.100.0:1", "198.51.100.1:1", "198.51.100.2:1"]
        clock.now = 1010.0
        refusals.flush()
        refusals.flush()  # said once
    assert len(logs) == 4
    summary = logs[3]
    assert summary["event"] == "... and 47 more refused for ws_key in the last 10 s"
    assert (summary["reason"], summary["suppressed"], summary["window_s"]) == ("ws_key", 47, 10.0)
    assert refusals.counts() == {"ws_key": 50}


def test_each_reason_has_its_own_budget_and_a_new_window_starts_after_the_summary() -> None:
    clock = FakeClock()
    refusals = RefusalLog(structlog.get_logger("test"), lines_per_interval=2, interval_s=10.0, clock=clock)
    with capture_logs() as logs:
        for _ in range(5):
            refusals.refused("ws_key")
            refusals.refused("garbage")
        clock.now += 12.0
        refusals.refused("ws_key")  # the next window: its summary first, then the line
    events = [(e["event"], e["reason"]) for e in logs]
    assert events == [
        ("connection refused", "ws_key"), ("connection refused", "garbage"),
        ("connection refused", "ws_key"), ("connection refused", "garbage"),
        ("... and 3 more refused for ws_key in the last 12 s", "ws_key"),
        ("connection refused", "ws_key"),
    ]
    with capture_logs() as later:
        refusals.flush()
    assert [(e["event"], e["reason"]) for e in later] == [("... and 3 more refused for garbage in the last 12 s",
                                                           "garbage")]
    assert refusals.counts() == {"ws_key": 6, "garbage": 5}


def test_a_steady_flood_stays_within_n_plus_one_lines_per_interval() -> None:
    clock = FakeClock()
    refusals = RefusalLog(structlog.get_logger("test"), lines_per_interval=5, interval_s=10.0, clock=clock)
    with capture_logs() as logs:
        for step in range(10_000):  # 100 a second for 10 intervals
            refusals.refused("bad_request")
            clock.now += 0.01
            if step % 500 == 499:
                refusals.flush()
        clock.now += 10.0
        refusals.flush()
    assert len(logs) <= 10 * 6
    summed = sum(int(e.get("suppressed", 0)) for e in logs) + sum(1 for e in logs if e["event"] == "connection refused")
    assert summed == 10_000  # every refusal is either a line or in a summary


def test_a_refusal_the_operator_must_act_on_is_a_warning_and_still_rate_limited() -> None:
    # A hub with the wrong token is told 401 and stops; the gateway's operator sees why, at
    # warning level, without a flood of such hubs filling the disk.
    clock = FakeClock()
    refusals = RefusalLog(structlog.get_logger("test"), lines_per_interval=2, interval_s=10.0, clock=clock)
    with capture_logs() as logs:
        for i in range(20):
            refusals.refused("hub_token", warn=True, remote=f"198.51.100.{i}:1")
        refusals.refused("ws_key")
        clock.now += 10.0
        refusals.flush()
    assert [(e["log_level"], e["event"]) for e in logs] == [
        ("warning", "connection refused"), ("warning", "connection refused"), ("info", "connection refused"),
        ("warning", "... and 18 more refused for hub_token in the last 10 s"),
    ]
    assert logs[0]["remote"] == "198.51.100.0:1"


def test_run_flushes_every_interval_on_the_trio_clock() -> None:
    async def main() -> None:
        refusals = RefusalLog(structlog.get_logger("test"), lines_per_interval=1, interval_s=10.0,
                              clock=trio.current_time)
        with capture_logs() as logs:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(refusals.run)
                for _ in range(4):
                    refusals.refused("rate")
                await trio.sleep(25)
                nursery.cancel_scope.cancel()
        assert [e["event"] for e in logs] == ["connection refused", "... and 3 more refused for rate in the last 10 s"]

    run(main)


def test_upgrade_refusal_accepts_the_rfc_example() -> None:
    req = HttpRequest("GET", "/chat", [(b"host", b"server.example.com"), (b"upgrade", b"websocket"),
                                       (b"connection", b"Upgrade"), (b"sec-websocket-key", KEY),
                                       (b"sec-websocket-version", b"13")], b"")
    assert upgrade_refusal(req) is None
