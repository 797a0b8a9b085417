"""The public gateway's pairing and routing, in memory and on a fake clock: a hub's control
WebSocket, workers that wait to be announced, the hub's data connection, the splice, and
every HTTP refusal on the way, the limits per source address and on unfinished messages, and
pings relayed end to end. No sockets, no TLS, no processes: each connection is one
``memory_stream_pair`` served by ``Gateway._handle``; tests/test_gateway.py runs the real
thing over TLS.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
from wsmem import MemClient, open_client
from wsproto.events import BytesMessage, CloseConnection, Event, Ping, Pong

from kvasir_rpc import CloseCode
from kvasir_rpc._ws import _LINGER_S
from kvasir_rpc.protocol import (
    GATEWAY_SUBPROTOCOL,
    HUB_CONTROL_PATH,
    HUB_DATA_PREFIX,
    PING,
    TUNNEL_SUBPROTOCOL,
    WORKER_PATH,
    PairRequest,
    decode_pair,
    encode_pair,
)
from relay.gateway._gateway import Gateway, GatewayConfig

TOKEN = "s3cret-hub-token"
AUTH = [(b"authorization", f"Bearer {TOKEN}".encode())]
WORKER_ADDR = "203.0.113.7:50123"
HUB_ADDR = "10.0.0.2:40000"
# Timers far beyond any test's fake-clock budget unless a test is about them: keepalive
# pings would otherwise interleave with the messages a test expects.
QUIET = dict(hub_token=TOKEN, keepalive_s=1000.0, idle_timeout_s=5000.0, handshake_timeout_s=30.0)
BUDGET_S = 60.0  # fake seconds a test may take; a hang jumps the clock here and fails


def run(fn: Callable[[], Awaitable[None]]) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


@dataclasses.dataclass
class Harness:
    gateway: Gateway
    nursery: trio.Nursery

    async def dial(self, path: str, remote: str, *, subprotocols: list[str] | None = None,
                   headers: list[tuple[bytes, bytes]] | None = None) -> MemClient:
        """A client connection to the gateway, served as ``Gateway.handle`` serves one."""
        client_stream, server_stream = trio.testing.memory_stream_pair()

        async def serve() -> None:
            try:
                await self.gateway._handle(server_stream, remote)  # type: ignore[arg-type]
            finally:
                await server_stream.aclose()

        self.nursery.start_soon(serve)
        return await open_client(client_stream, path, subprotocols=subprotocols, headers=headers)

    async def control(self) -> MemClient:
        hub = await self.dial(HUB_CONTROL_PATH, HUB_ADDR, subprotocols=[GATEWAY_SUBPROTOCOL], headers=AUTH)
        assert hub.status is None and hub.subprotocol == GATEWAY_SUBPROTOCOL
        await trio.testing.wait_all_tasks_blocked()  # the gateway has installed it
        assert self.gateway.statistics().hub_connected
        return hub

    async def worker(self, remote: str = WORKER_ADDR) -> MemClient:
        worker = await self.dial(WORKER_PATH, remote, subprotocols=[TUNNEL_SUBPROTOCOL])
        assert worker.status is None and worker.subprotocol == TUNNEL_SUBPROTOCOL
        return worker

    async def data(self, pair_id: str, *, subprotocols: list[str] | None = None,
                   headers: list[tuple[bytes, bytes]] | None = None) -> MemClient:
        return await self.dial(HUB_DATA_PREFIX + pair_id, HUB_ADDR,
                               subprotocols=[TUNNEL_SUBPROTOCOL] if subprotocols is None else subprotocols,
                               headers=AUTH if headers is None else headers)


@asynccontextmanager
async def gateway(**overrides: object) -> AsyncIterator[Harness]:
    """A gateway and a nursery for its connections. On leaving, every connection handler
    must have returned by itself (nothing is cancelled), within the fake-clock budget."""
    with trio.fail_after(BUDGET_S):
        async with trio.open_nursery() as nursery:
            yield Harness(Gateway(GatewayConfig(**{**QUIET, **overrides})), nursery)  # type: ignore[arg-type]


async def announced(hub: MemClient, remote: str = WORKER_ADDR) -> str:
    """The pair id of the next worker announced on ``hub``'s control socket."""
    msg = await hub.next_event()
    assert isinstance(msg, str), msg
    request = decode_pair(msg)
    assert request.remote == remote and msg == encode_pair(PairRequest(request.pair_id, remote))
    return request.pair_id


async def closed_with(client: MemClient) -> CloseConnection:
    event = await client.next_event()
    assert isinstance(event, CloseConnection), event
    assert await client.next_event() is None  # and the stream ends after the close frame
    return event


# -- 1. the happy path -----------------------------------------------------------------------


@pytest.mark.parametrize("closer", ["worker", "hub"])
def test_a_worker_is_announced_paired_and_relayed_both_ways_until_one_side_closes(closer: str) -> None:
    async def main() -> None:
        async with gateway() as h:
            hub = await h.control()
            start = trio.current_time()
            worker = await h.worker()
            pid = await announced(hub)
            await trio.testing.wait_all_tasks_blocked()
            stats = h.gateway.statistics()
            assert (stats.unpaired, stats.sessions) == (1, 0)

            data = await h.data(pid)
            assert data.status is None and data.subprotocol == TUNNEL_SUBPROTOCOL
            await trio.testing.wait_all_tasks_blocked()
            stats = h.gateway.statistics()
            assert (stats.unpaired, stats.sessions, stats.relayed_bytes) == (0, 1, 0)

            # Both ways, text as text and binary as binary, fragments joined into one message.
            await worker.send_message(b"\x00\x01h2-preface")
            await worker.send_message("eof")
            await worker.send(BytesMessage(b"ab", message_finished=False), BytesMessage(b"cd"))
            assert [await data.next_event() for _ in range(3)] == [b"\x00\x01h2-preface", "eof", b"abcd"]
            await data.send_message("open")
            await data.send_message(b"\xff" * 5000)
            await data.send_message("héllo")
            assert [await worker.next_event() for _ in range(3)] == ["open", b"\xff" * 5000, "héllo"]
            assert trio.current_time() == start  # nothing above waited on a timer

            first, second = (worker, data) if closer == "worker" else (data, worker)
            await first.close(4000, "done here")
            got = await closed_with(second)
            assert (got.code, got.reason) == (4000, "done here")
            echo = await closed_with(first)  # the closer's handshake is answered too
            assert echo.code == 4000

            await hub.close()
            await closed_with(hub)
        stats = h.gateway.statistics()
        assert (stats.unpaired, stats.sessions, stats.hub_connected) == (0, 0, False)
        # Payload bytes, not characters: "héllo" is 6 bytes of UTF-8.
        assert stats.relayed_bytes == 12 + 3 + 4 + 4 + 5000 + 6
        assert stats.refused == {}

    run(main)


def test_a_side_that_vanishes_without_a_close_frame_closes_the_other_1001() -> None:
    async def main() -> None:
        async with gateway() as h:
            hub = await h.control()
            worker = await h.worker()
            data = await h.data(await announced(hub))
            await worker.send_message(b"x")
            assert await data.next_event() == b"x"
            await worker.aclose()  # 1006 cannot be sent: the hub hears 1001
            assert (await closed_with(data)).code == 1001
            await hub.close()
        assert h.gateway.statistics().sessions == 0

    run(main)


# -- 2. the pairing timeout ------------------------------------------------------------------


def test_a_worker_no_hub_takes_is_closed_4207_after_the_pairing_time() -> None:
    async def main() -> None:
        async with gateway(pairing_timeout_s=10.0) as h:
            hub = await h.control()
            start = trio.current_time()
            worker = await h.worker()
            pid = await announced(hub)
            got = await closed_with(worker)
            assert got.code == CloseCode.PAIRING_TIMEOUT and "in time" in got.reason
            assert trio.current_time() - start == pytest.approx(10.0)
            await trio.testing.wait_all_tasks_blocked()
            stats = h.gateway.statistics()
            assert (stats.unpaired, stats.sessions, stats.refused) == (0, 0, {"pairing_timeout": 1})
            late = await h.data(pid)  # the id died with the wait
            assert late.status == 404
            await hub.close()

    run(main)


# -- 3. refusals -------------------------------------------------------------------------------


def test_an_unknown_or_taken_pair_id_is_404() -> None:
    async def main() -> None:
        async with gateway() as h:
            hub = await h.control()
            unknown = await h.data("NoSuchPairId_123")
            assert unknown.status == 404 and b"no worker waits" in unknown.body
            worker = await h.worker()
            pid = await announced(hub)
            data = await h.data(pid)
            assert data.status is None
            again = await h.data(pid)  # a second hub connection cannot take a live session
            assert again.status == 404
            await worker.close()
            await closed_with(data)
            await closed_with(worker)
            after = await h.data(pid)  # nor one that ended
            assert after.status == 404
            await hub.close()
        assert h.gateway.statistics().refused == {"unknown_pairing": 3}

    run(main)


@pytest.mark.parametrize("headers", [[], [(b"authorization", b"Bearer wrong")], [(b"authorization", TOKEN.encode())]],
                         ids=["missing", "wrong", "not-bearer"])
@pytest.mark.parametrize("path", [HUB_CONTROL_PATH, HUB_DATA_PREFIX + "SomePairId_1"], ids=["control", "data"])
def test_hub_paths_without_the_token_are_401(headers: list[tuple[bytes, bytes]], path: str) -> None:
    async def main() -> None:
        async with gateway() as h:
            hub = await h.dial(path, HUB_ADDR, subprotocols=[GATEWAY_SUBPROTOCOL, TUNNEL_SUBPROTOCOL], headers=headers)
            assert hub.status == 401 and hub.headers["www-authenticate"] == "Bearer"
            assert b"hub token" in hub.body
            assert h.gateway.statistics().hub_connected is False
        assert h.gateway.statistics().refused == {"hub_token": 1}

    run(main)


def test_a_gateway_without_a_token_admits_no_hub() -> None:
    async def main() -> None:
        async with gateway(hub_token="") as h:
            # An empty token would read "Bearer" (h11 strips the trailing space) and match
            # nothing; the gateway refuses every token anyway rather than rely on that.
            for headers in ([(b"authorization", b"Bearer")], AUTH):
                hub = await h.dial(HUB_CONTROL_PATH, HUB_ADDR, subprotocols=[GATEWAY_SUBPROTOCOL], headers=headers)
                assert hub.status == 401

    run(main)


def test_a_worker_while_no_hub_is_connected_is_503_with_retry_after() -> None:
    async def main() -> None:
        async with gateway() as h:
            worker = await h.dial(WORKER_PATH, WORKER_ADDR, subprotocols=[TUNNEL_SUBPROTOCOL])
            assert worker.status == 503 and worker.headers["retry-after"] == "5"
            assert b"no hub is connected" in worker.body
            hub = await h.control()
            await hub.close()
            await closed_with(hub)
            await trio.testing.wait_all_tasks_blocked()
            again = await h.dial(WORKER_PATH, WORKER_ADDR, subprotocols=[TUNNEL_SUBPROTOCOL])
            assert again.status == 503  # the hub came and went
        assert h.gateway.statistics().refused == {"no_hub": 2}

    run(main)


@pytest.mark.parametrize("offered", [[], ["kvasir.tunnel.v0", "chat"]], ids=["none", "others"])
def test_a_worker_without_the_tunnel_subprotocol_is_400_naming_it(offered: list[str]) -> None:
    async def main() -> None:
        async with gateway() as h:
            hub = await h.control()
            worker = await h.dial(WORKER_PATH, WORKER_ADDR, subprotocols=offered)
            assert worker.status == 400 and TUNNEL_SUBPROTOCOL.encode() in worker.body
            assert h.gateway.statistics().unpaired == 0
            await hub.close()
        assert h.gateway.statistics().refused == {"subprotocol": 1}

    run(main)


def test_the_data_path_without_a_tunnel_subprotocol_is_400_and_the_worker_still_waits() -> None:
    async def main() -> None:
        async with gateway() as h:
            hub = await h.control()
            worker = await h.worker()
            pid = await announced(hub)
            wrong = await h.data(pid, subprotocols=[GATEWAY_SUBPROTOCOL])
            assert wrong.status == 400 and TUNNEL_SUBPROTOCOL.encode() in wrong.body
            assert h.gateway.statistics().unpaired == 1
            data = await h.data(pid)  # a proper dial still takes the worker
            await data.send_message(b"ok")
            assert await worker.next_event() == b"ok"
            await data.close()
            await closed_with(worker)
            await closed_with(data)
            await hub.close()
        assert h.gateway.statistics().refused == {"subprotocol": 1}

    run(main)


# -- 4. capacity ---------------------------------------------------------------------------------


def test_at_most_max_unpaired_workers_wait_the_next_gets_503() -> None:
    async def main() -> None:
        async with gateway(max_unpaired=2) as h:
            hub = await h.control()
            waiting = [await h.worker(f"198.51.100.{i}:1000") for i in range(2)]
            pids = [await announced(hub, f"198.51.100.{i}:1000") for i in range(2)]
            refused = await h.dial(WORKER_PATH, "198.51.100.9:1000", subprotocols=[TUNNEL_SUBPROTOCOL])
            assert refused.status == 503 and refused.headers["retry-after"] == "5"
            assert b"capacity" in refused.body
            # A paired worker no longer waits: its place is free again.
            data = await h.data(pids[0])
            await trio.testing.wait_all_tasks_blocked()
            assert h.gateway.statistics().unpaired == 1
            third = await h.worker("198.51.100.9:1000")
            pids.append(await announced(hub, "198.51.100.9:1000"))
            datas = [data, await h.data(pids[1]), await h.data(pids[2])]
            for w, d in zip([*waiting, third], datas, strict=True):
                await w.close()
                await closed_with(d)
                await closed_with(w)
            await hub.close()
        assert h.gateway.statistics().refused == {"capacity": 1}

    run(main)


def test_simultaneous_arrivals_cannot_exceed_max_unpaired() -> None:
    async def main() -> None:
        async with gateway(max_unpaired=2) as h:
            hub = await h.control()
            workers: list[MemClient] = []

            async def arrive(i: int) -> None:
                workers.append(await h.dial(WORKER_PATH, f"198.51.100.{i}:1000", subprotocols=[TUNNEL_SUBPROTOCOL]))

            async with trio.open_nursery() as nursery:  # every upgrade in flight at once
                for i in range(6):
                    nursery.start_soon(arrive, i)
            assert sorted(w.status or 0 for w in workers) == [0, 0, 503, 503, 503, 503]
            await trio.testing.wait_all_tasks_blocked()
            assert h.gateway.statistics().unpaired == 2
            for _ in range(2):
                decode_pair(await hub.next_event())  # type: ignore[arg-type]
            for w in workers:
                if w.status is None:
                    assert (await closed_with(w)).code == CloseCode.PAIRING_TIMEOUT  # no hub dials: the wait times out
            await hub.close()
        assert h.gateway.statistics().refused == {"capacity": 4, "pairing_timeout": 2}

    run(main)


def test_waiting_workers_count_toward_max_sessions() -> None:
    async def main() -> None:
        async with gateway(max_sessions=1) as h:
            hub = await h.control()
            worker = await h.worker()
            pid = await announced(hub)
            # The one place is promised to the waiting worker, before and after it pairs.
            assert (await h.dial(WORKER_PATH, WORKER_ADDR, subprotocols=[TUNNEL_SUBPROTOCOL])).status == 503
            data = await h.data(pid)
            await trio.testing.wait_all_tasks_blocked()
            assert (await h.dial(WORKER_PATH, WORKER_ADDR, subprotocols=[TUNNEL_SUBPROTOCOL])).status == 503
            await worker.close()
            await closed_with(data)
            await closed_with(worker)
            await trio.testing.wait_all_tasks_blocked()
            again = await h.worker()  # the place is free once the session ends
            data = await h.data(await announced(hub))
            await again.close()
            await closed_with(data)
            await closed_with(again)
            await hub.close()
        assert h.gateway.statistics().refused == {"capacity": 2}

    run(main)


# -- 5. the control channel --------------------------------------------------------------------------


@pytest.mark.parametrize("message", ["hello", "pong", b"ping", encode_pair(PairRequest("AbCdEfGh_-12"))])
def test_anything_but_ping_on_the_control_channel_closes_it_1002(message: bytes | str) -> None:
    async def main() -> None:
        async with gateway() as h:
            hub = await h.control()
            await hub.send_message(message)
            got = await closed_with(hub)
            assert got.code == 1002 and "no messages" in got.reason
            await trio.testing.wait_all_tasks_blocked()
            assert h.gateway.statistics().hub_connected is False

    run(main)


def test_ping_on_the_control_channel_is_accepted() -> None:
    async def main() -> None:
        async with gateway() as h:
            hub = await h.control()
            for _ in range(3):
                await hub.send_message(PING)
            await trio.testing.wait_all_tasks_blocked()
            assert h.gateway.statistics().hub_connected
            worker = await h.worker()  # and the channel still announces workers
            data = await h.data(await announced(hub))
            await data.close(1000)
            await closed_with(worker)
            await closed_with(data)
            await hub.close()
            assert (await closed_with(hub)).code == 1000

    run(main)


def test_a_second_control_connection_replaces_the_first_1001() -> None:
    async def main() -> None:
        async with gateway() as h:
            first = await h.control()
            second = await h.control()
            got = await closed_with(first)
            assert got.code == 1001 and "replaced" in got.reason
            await trio.testing.wait_all_tasks_blocked()
            assert h.gateway.statistics().hub_connected  # the first one's end leaves the second in place
            worker = await h.worker()
            data = await h.data(await announced(second))
            await worker.close()
            await closed_with(data)
            await closed_with(worker)
            await second.close()
        assert h.gateway.statistics().hub_connected is False

    run(main)


# -- 6. a new control connection while workers wait -----------------------------------------------------


def test_workers_waiting_across_a_control_replacement_are_all_paired() -> None:
    async def main() -> None:
        async with gateway() as h:
            first = await h.control()
            early = await h.worker("198.51.100.1:1000")
            early_pid = await announced(first, "198.51.100.1:1000")
            second = await h.control()
            assert (await closed_with(first)).code == 1001
            late = await h.worker("198.51.100.2:1000")
            late_pid = await announced(second, "198.51.100.2:1000")  # announced on the new one
            await trio.testing.wait_all_tasks_blocked()
            assert h.gateway.statistics().unpaired == 2
            # The early worker's id outlives the control socket that announced it.
            for worker, pid in [(early, early_pid), (late, late_pid)]:
                data = await h.data(pid)
                await worker.send_message(pid)
                assert await data.next_event() == pid
                await data.close(1000)
                await closed_with(worker)
                await closed_with(data)
            await second.close()
        stats = h.gateway.statistics()
        assert (stats.unpaired, stats.sessions, stats.refused) == (0, 0, {})

    run(main)


# -- 7. sessions per source address ------------------------------------------------------------------


def test_sessions_per_source_address_are_capped_429_and_other_addresses_still_get_in() -> None:
    async def main() -> None:
        async with gateway(max_sessions_per_address=2) as h:
            hub = await h.control()
            first = await h.worker("198.51.100.1:1000")
            pid = await announced(hub, "198.51.100.1:1000")
            second = await h.worker("198.51.100.1:1001")  # another port, the same address
            await announced(hub, "198.51.100.1:1001")
            refused = await h.dial(WORKER_PATH, "198.51.100.1:1002", subprotocols=[TUNNEL_SUBPROTOCOL])
            assert refused.status == 429 and refused.headers["retry-after"] == "5"
            assert b"198.51.100.1" in refused.body and b"2 sessions" in refused.body
            other = await h.worker("198.51.100.2:1000")  # another address is not affected
            await announced(hub, "198.51.100.2:1000")
            assert h.gateway.statistics().sessions_by_address == {"198.51.100.1": 2, "198.51.100.2": 1}
            # Spliced sessions count too; the place comes back when one ends.
            data = await h.data(pid)
            refused = await h.dial(WORKER_PATH, "198.51.100.1:1003", subprotocols=[TUNNEL_SUBPROTOCOL])
            assert refused.status == 429
            await first.close()
            await closed_with(data)
            await closed_with(first)
            await trio.testing.wait_all_tasks_blocked()
            third = await h.worker("198.51.100.1:1004")
            await announced(hub, "198.51.100.1:1004")
            for w in (second, other, third):  # no hub dials these: they time out waiting
                assert (await closed_with(w)).code == CloseCode.PAIRING_TIMEOUT
            await hub.close()
        stats = h.gateway.statistics()
        assert stats.refused == {"address_sessions": 2, "pairing_timeout": 3}
        assert stats.sessions_by_address == {}  # nothing left behind

    run(main)


def test_an_ipv6_slash_64_is_one_address_and_ipv4_mapped_is_its_ipv4() -> None:
    async def main() -> None:
        async with gateway(max_sessions_per_address=1) as h:
            hub = await h.control()
            v6 = await h.worker("2001:db8:1:2::1:443")
            await announced(hub, "2001:db8:1:2::1:443")
            same_64 = await h.dial(WORKER_PATH, "2001:db8:1:2:ffff::9:443", subprotocols=[TUNNEL_SUBPROTOCOL])
            assert same_64.status == 429
            v4 = await h.worker("192.0.2.1:443")
            await announced(hub, "192.0.2.1:443")
            mapped = await h.dial(WORKER_PATH, "::ffff:192.0.2.1:443", subprotocols=[TUNNEL_SUBPROTOCOL])
            assert mapped.status == 429
            assert h.gateway.statistics().sessions_by_address == {"2001:db8:1:2::/64": 1, "192.0.2.1": 1}
            for w in (v6, v4):
                assert (await closed_with(w)).code == CloseCode.PAIRING_TIMEOUT
            await hub.close()
        assert h.gateway.statistics().refused == {"address_sessions": 2, "pairing_timeout": 2}

    run(main)


# -- 8. unfinished messages ----------------------------------------------------------------------------


def test_a_spliced_worker_trickling_a_message_is_cut_4209_at_the_deadline_and_the_hub_told() -> None:
    async def main() -> None:
        async with gateway(message_deadline_s=7.0) as h:
            hub = await h.control()
            worker = await h.worker()
            data = await h.data(await announced(hub))
            start = trio.current_time()
            for _ in range(5):
                await worker.send(BytesMessage(b"z" * 4096, message_finished=False))
                await trio.sleep(1)
            await trio.testing.wait_all_tasks_blocked()
            assert h.gateway.statistics().buffered_bytes == 5 * 4096
            got = await closed_with(worker)
            assert got.code == CloseCode.MESSAGE_TIMEOUT and "not finished within 7 s" in got.reason
            # At the deadline; the connection's end waits out the linger for this test worker,
            # which does not answer the close (kvasir_rpc._ws: WebSocket._refuse).
            assert trio.current_time() - start in (pytest.approx(7.0), pytest.approx(7.0 + _LINGER_S))
            relayed = await closed_with(data)  # the hub hears why its session ended
            assert relayed.code == CloseCode.MESSAGE_TIMEOUT
            await hub.close()
        stats = h.gateway.statistics()
        assert (stats.buffered_bytes, stats.refused) == (0, {"message_deadline": 1})

    run(main)


def test_unfinished_messages_of_all_sessions_share_the_budget_4208() -> None:
    async def main() -> None:
        async with gateway(max_buffered_bytes=10_000) as h:
            hub = await h.control()
            a = await h.worker("198.51.100.1:1000")
            data_a = await h.data(await announced(hub, "198.51.100.1:1000"))
            b = await h.worker("198.51.100.2:1000")
            data_b = await h.data(await announced(hub, "198.51.100.2:1000"))
            await a.send(BytesMessage(b"a" * 6000, message_finished=False))
            await trio.testing.wait_all_tasks_blocked()
            await b.send(BytesMessage(b"b" * 6000, message_finished=False))
            assert (await closed_with(b)).code == CloseCode.BUFFERS_FULL
            assert (await closed_with(data_b)).code == CloseCode.BUFFERS_FULL
            await a.send(BytesMessage(b"a"))  # a's message was held within the budget and goes through
            assert await data_a.next_event() == b"a" * 6001
            await a.close()
            await closed_with(data_a)
            await closed_with(a)
            await hub.close()
        stats = h.gateway.statistics()
        assert (stats.buffered_bytes, stats.refused) == (0, {"buffer_full": 1})

    run(main)


# -- 9. liveness end to end: pings and pongs are relayed across the splice --------------------------------


async def raw_events(client: MemClient) -> list[Event]:
    """What arrived for ``client``, unanswered (``next_event`` would answer pings)."""
    while True:
        events = list(client.conn.events())
        if events:
            return events
        assert await client._feed(), "the stream ended"


@pytest.mark.parametrize("pinger", ["hub", "worker"])
def test_a_ping_crosses_the_splice_and_its_pong_comes_back(pinger: str) -> None:
    async def main() -> None:
        async with gateway() as h:
            hub = await h.control()
            worker = await h.worker()
            data = await h.data(await announced(hub))
            src, dst = (data, worker) if pinger == "hub" else (worker, data)
            await src.send(Ping(b"end-to-end"))
            assert [(type(e), e.payload) for e in await raw_events(dst)] == [(Ping, b"end-to-end")]  # type: ignore[attr-defined]
            await dst.send(Pong(b"end-to-end"))
            assert [(type(e), e.payload) for e in await raw_events(src)] == [(Pong, b"end-to-end")]  # type: ignore[attr-defined]
            await worker.close()
            await closed_with(data)
            await closed_with(worker)
            await hub.close()

    run(main)


def test_a_spliced_worker_that_never_answers_is_seen_by_the_hub() -> None:
    """The gateway no longer answers the hub's pings: a frozen worker leaves the hub's
    keepalive without a pong (here the hub waits 10 s, as its keepalive does, then closes)."""

    async def main() -> None:
        async with gateway(keepalive_s=3.0) as h:  # the gateway's own pings do not change that
            hub = await h.control()
            worker = await h.worker()
            data = await h.data(await announced(hub))
            await data.send(Ping(b"keepalive-1"))
            arrived: list[Event] = []
            with trio.move_on_after(10):
                while True:
                    arrived += await raw_events(data)
            assert not [e for e in arrived if isinstance(e, Pong)], arrived
            got = [e for e in await raw_events(worker) if isinstance(e, Ping)]
            assert got[0].payload == b"keepalive-1"  # it reached the worker, which said nothing
            await data.close(1001, "keepalive: no pong within 10 s")
            got_close = await closed_with(worker)
            assert (got_close.code, got_close.reason) == (1001, "keepalive: no pong within 10 s")
            await closed_with(data)
            await hub.close()

    run(main)
