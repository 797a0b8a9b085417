"""The sealed heartbeat over real WebSockets (the library's, both ends, on an in-memory
stream, a fake clock): an encrypted session's liveness check, which the byte movers handle below the
tunnel's control state machine.

A peer that answers is kept however long the session lasts; one whose heartbeats stop
coming back is dropped with 1001 within keepalive + timeout, even while its WebSocket still
answers pings (what a relay answering for a dead worker looks like); an ack that answers no
heartbeat waiting is a violation (1008). Both sides run the same code, so each test runs
with the hub checking the worker and the other way round.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from kvasir_rpc import WebSocket
from kvasir_rpc._channel import Heartbeat, HeartbeatAck, TunnelCipher
from kvasir_rpc._errors import CloseCode, LocalProtocolError, RemoteProtocolError
from kvasir_rpc._tunnel import SealedHeartbeat, keepalive, receive_message, send_whole
from kvasir_rpc.protocol import Data, Open, WorkerTunnel

KEYS = (bytes(range(32)), bytes(range(32, 64)))
INTERVAL_S, TIMEOUT_S = 15.0, 10.0

SIDES = pytest.mark.parametrize("hub_checks", [True, False], ids=["hub-checks-worker", "worker-checks-hub"])


def run(fn) -> None:  # type: ignore[no-untyped-def]
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


@contextlib.asynccontextmanager
async def ws_pair(nursery: trio.Nursery) -> AsyncIterator[tuple[WebSocket, WebSocket]]:
    """(hub's WebSocket, worker's WebSocket), connected in memory, each with the keepalive of
    its own the hub and the worker give it (a ping once the peer is silent INTERVAL_S, 1001
    after TIMEOUT_S more)."""
    hub_stream, worker_stream = trio.testing.memory_stream_pair()
    kw = {"max_message_bytes": 1 << 20, "keepalive_s": INTERVAL_S, "idle_timeout_s": INTERVAL_S + TIMEOUT_S}
    yield WebSocket(hub_stream, **kw), WebSocket(worker_stream, client=True, **kw)  # type: ignore[arg-type]


def sides(hub_checks: bool, hub_ws: WebSocket, worker_ws: WebSocket):  # type: ignore[no-untyped-def]
    """(checker's ws, its cipher, peer's ws, its cipher)."""
    hub, worker = TunnelCipher.for_hub(KEYS), TunnelCipher.for_worker(KEYS)
    return (hub_ws, hub, worker_ws, worker) if hub_checks else (worker_ws, worker, hub_ws, hub)


async def read_all(ws: WebSocket, cipher: TunnelCipher, heartbeat: SealedHeartbeat | None,
                   into: list[bytes | str]) -> None:
    while True:
        into.append(await receive_message(ws, cipher, heartbeat))


@SIDES
def test_an_answering_peer_is_kept_and_the_tunnel_never_sees_a_heartbeat(hub_checks):
    async def main() -> None:
        async with trio.open_nursery() as nursery, ws_pair(nursery) as (hub_ws, worker_ws):
            ws, cipher, peer_ws, peer_cipher = sides(hub_checks, hub_ws, worker_ws)
            heartbeat = SealedHeartbeat(ws, cipher)
            got: list[bytes | str] = []
            nursery.start_soon(read_all, ws, cipher, heartbeat, [])
            nursery.start_soon(read_all, peer_ws, peer_cipher, None, got)
            nursery.start_soon(keepalive, ws, INTERVAL_S, TIMEOUT_S, heartbeat)
            # Tunnel messages interleave with the heartbeats; the state machine sees only them.
            tunnel = WorkerTunnel()
            sent: list[bytes | str] = ["open", b"bytes", b"more"] if hub_checks else []
            for msg in sent:
                await trio.sleep(INTERVAL_S * 0.7)
                await send_whole(ws, msg, cipher=cipher)
            await trio.sleep(10 * INTERVAL_S)
            assert got == sent
            assert [tunnel.receive(m) for m in got] == ([Open(), Data(b"bytes"), Data(b"more")] if hub_checks else [])
            assert heartbeat.monitor.answered >= 9 and heartbeat.monitor.waiting in (None, heartbeat.monitor.sent - 1)
            assert heartbeat.rtt_s is not None and heartbeat.rtt_s < 1.0
            nursery.cancel_scope.cancel()

    run(main)


@SIDES
def test_a_silent_peer_behind_a_ping_answering_relay_is_dropped_with_1001(hub_checks):
    """The peer's WebSocket takes the heartbeats and answers pings (as a relay does on its
    own) but nothing comes back sealed: gone within keepalive + timeout. Pings alone would
    have kept it for ever."""

    async def main() -> None:
        async with trio.open_nursery() as nursery, ws_pair(nursery) as (hub_ws, worker_ws):
            ws, cipher, peer_ws, _ = sides(hub_checks, hub_ws, worker_ws)

            async def swallow() -> None:
                while True:
                    await peer_ws.receive_message()

            nursery.start_soon(swallow)
            heartbeat = SealedHeartbeat(ws, cipher)
            nursery.start_soon(read_all, ws, cipher, heartbeat, [])
            # WebSocket pings (the WebSocket's own keepalive): answered by whatever holds the
            # other end, so they pass.
            await trio.sleep(5 * INTERVAL_S)
            stats = ws.statistics()
            assert stats.pings_sent >= 4 and stats.pongs_received >= stats.pings_sent - 1  # the last may be on its way
            t0 = trio.current_time()
            with pytest.raises(RemoteProtocolError) as err:
                await keepalive(ws, INTERVAL_S, TIMEOUT_S, heartbeat)
            assert trio.current_time() - t0 == pytest.approx(INTERVAL_S + TIMEOUT_S, abs=0.1)
            assert err.value.close_code == CloseCode.GOING_AWAY
            peer = "worker" if hub_checks else "hub"
            assert err.value.reason == (f"no sealed heartbeat answer within {TIMEOUT_S:g} s: the {peer} is gone or "
                                        "a relay is answering for it")
            assert len(err.value.reason) <= 120  # it goes in the close frame
            nursery.cancel_scope.cancel()

    run(main)


@SIDES
@pytest.mark.parametrize("answer", ["unsolicited", "wrong number", "twice"])
def test_an_ack_that_answers_nothing_waiting_ends_the_session_1008(hub_checks, answer):
    async def main() -> None:
        async with trio.open_nursery() as nursery, ws_pair(nursery) as (hub_ws, worker_ws):
            ws, cipher, peer_ws, peer_cipher = sides(hub_checks, hub_ws, worker_ws)
            heartbeat = SealedHeartbeat(ws, cipher)
            if answer == "unsolicited":
                await send_whole(peer_ws, HeartbeatAck(0), cipher=peer_cipher)
            else:
                nursery.start_soon(heartbeat.check, TIMEOUT_S)
                beat = peer_cipher.open(await peer_ws.receive_message())
                assert beat == Heartbeat(0)
                acks = [HeartbeatAck(1)] if answer == "wrong number" else [HeartbeatAck(0), HeartbeatAck(0)]
                for ack in acks:
                    await send_whole(peer_ws, ack, cipher=peer_cipher)
            with pytest.raises(RemoteProtocolError) as err:
                await read_all(ws, cipher, heartbeat, [])
            assert err.value.close_code == CloseCode.POLICY_VIOLATION
            assert "acknowledged heartbeat" in err.value.reason
            nursery.cancel_scope.cancel()

    run(main)


def test_an_ack_on_a_side_that_sends_no_heartbeats_is_1008():
    async def main() -> None:
        async with trio.open_nursery() as nursery, ws_pair(nursery) as (hub_ws, worker_ws):
            hub, worker = TunnelCipher.for_hub(KEYS), TunnelCipher.for_worker(KEYS)
            await send_whole(worker_ws, HeartbeatAck(0), cipher=worker)
            with pytest.raises(RemoteProtocolError, match="no heartbeat was sent") as err:
                await receive_message(hub_ws, hub)
            assert err.value.close_code == CloseCode.POLICY_VIOLATION
            nursery.cancel_scope.cancel()

    run(main)


def test_a_heartbeat_is_never_sent_in_clear():
    async def main() -> None:
        async with trio.open_nursery() as nursery, ws_pair(nursery) as (hub_ws, _):
            with pytest.raises(LocalProtocolError, match="only sealed"):
                await send_whole(hub_ws, Heartbeat(0))
            nursery.cancel_scope.cancel()

    run(main)
