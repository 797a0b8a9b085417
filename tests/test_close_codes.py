"""Refusals by code (docs/PROTOCOL.md, section 7), without sockets.

* The table: every ``CloseCode`` has a class (``close_class``), the ranges say the class of
  codes no table names, and the spec's table lists every private code with its class.
* The hub's refusals, each through ``serve_connection`` on a WebSocket over memory streams:
  a hello that breaks the rules (4100), answers another challenge (4201) or comes too late
  (4200); a quarantined wallet (4101), slices outside the model (4102), encryption policies
  that do not meet (4103), each sent as 4008 when the same wallet is refused so again (what
  a worker of the first codes stops on); the caps (4202, 4203, 4204) and the rate (4205).
* The gateway's closes of its own: no hub (4206), a pairing gone (4210).
* The worker acts on the code alone: ``run_tunnel`` and ``request_plan`` on a fake hub stop
  with one line on a permanent code (during the handshake or after it), dial again after a
  retry code, and name the gateway or the hub from how they were started, not from the URL.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import trio
import trio.testing
from helpers import ROOT

from kvasir_rpc import (
    CloseCode,
    HubHandshake,
    ModelShape,
    Wallet,
    WebSocket,
    WorkerHandshake,
    WsClosed,
    address_key,
    close_class,
    leaf_exception,
    remote_host,
)
from kvasir_rpc.protocol import TUNNEL_SUBPROTOCOL

MEMBERS = {name: code for name, code in vars(CloseCode).items() if name.isupper() and isinstance(code, int)}
WHY_LIMIT = 123  # the bytes a close reason may take (RFC 6455 5.5.1)


# -- the table -------------------------------------------------------------------------------


def test_every_code_has_one_name_and_a_class_its_range_gives() -> None:
    assert len(set(MEMBERS.values())) == len(MEMBERS)
    for name, code in MEMBERS.items():
        kind = close_class(code)
        if 4100 <= code < 4200:
            assert kind == "permanent", name
        elif 4200 <= code < 4300:
            assert kind == "retry", name
        elif code < 4000:
            assert kind in ("closed", "retry"), name  # RFC 6455's own: nothing of theirs is final
        else:  # the first private codes, 4000-4099: 4008 and 4010 only
            assert code in (CloseCode.REFUSED, CloseCode.REPLAN), name
    assert close_class(CloseCode.REFUSED) == "permanent"
    assert close_class(CloseCode.REPLAN) == "replan"
    assert close_class(CloseCode.NORMAL) == close_class(CloseCode.GOING_AWAY) == "closed"


def test_the_ranges_decide_for_codes_no_table_names() -> None:
    classes: dict[str, set[int]] = {}
    for code in range(1000, 5000):
        classes.setdefault(close_class(code), set()).add(code)
    assert classes["permanent"] == {4008, *range(4100, 4200)}
    assert classes["replan"] == {4010}
    assert classes["closed"] == {1000, 1001}
    assert len(classes["retry"]) == 4000 - 100 - 1 - 1 - 2  # everything else, unknown codes included


def test_the_names_are_public() -> None:
    import kvasir_rpc

    assert kvasir_rpc.close_class is close_class and "close_class" in kvasir_rpc.__all__
    assert "CloseClass" in kvasir_rpc.__all__ and kvasir_rpc.CloseClass is not None


def test_the_spec_lists_every_private_code_with_its_class() -> None:
    doc = (ROOT / "docs" / "PROTOCOL.md").read_text()
    section = doc[doc.index("## 7. Close codes"):doc.index("## 8. Gateway")]
    for name, code in MEMBERS.items():
        row = re.search(rf"^\| {code} \|(.*)$", section, re.MULTILINE)
        if row is None:
            assert code < 4000, f"{name} ({code}) is not in PROTOCOL.md's table of close codes"
            continue
        assert f"| {close_class(code)} |" in row[0], (name, row[0])


# -- the hub's refusals ----------------------------------------------------------------------

REMOTE = "198.51.100.7:50000"


def _run(fn: Callable[[], Awaitable[None]]) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def _hub(**config: object):  # type: ignore[no-untyped-def]
    from relay.hub._registry import SessionRegistry
    from relay.hub._sessions import HubConfig, _Hub

    rate = config.pop("rate", None)
    return _Hub(HubConfig(**config), Wallet.generate(), SessionRegistry(), rate=rate)  # type: ignore[arg-type]


def _worker(wallet: Wallet, slices: dict[int, list[int]] | None = None, **kw: object) -> WorkerHandshake:
    return WorkerHandshake(wallet, slices=slices or {0: [0, 1]}, weights_digest=bytes(32), device="cpu",
                           **kw)  # type: ignore[arg-type]


async def _dial(hub, hs: WorkerHandshake | None, *, remote: str = REMOTE,  # type: ignore[no-untyped-def]
                hello: Callable[[bytes], bytes] | None = None) -> tuple[int, str]:
    """One worker WebSocket to ``hub.serve_connection`` over memory streams: the hub's close
    (code, reason) for the hello ``hs`` makes (edited by ``hello``; none sent without ``hs``)."""
    client, server = trio.testing.memory_stream_pair()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            async def serve() -> None:
                ws = WebSocket(server, max_message_bytes=1 << 22, keepalive_s=15.0, idle_timeout_s=25.0)
                await hub.serve_connection(ws, remote)

            nursery.start_soon(serve)
            ws = WebSocket(client, max_message_bytes=1 << 22, keepalive_s=15.0, idle_timeout_s=25.0, client=True)
            try:
                challenge = await ws.receive_message()
                assert isinstance(challenge, bytes)
                if hs is not None:
                    data = hs.receive_challenge(challenge)
                    await ws.send_message(hello(data) if hello else data)
                got = await ws.receive_message()
                raise AssertionError(f"not refused: {got!r:.60}")
            except WsClosed as exc:
                return exc.code, exc.reason
            finally:
                nursery.cancel_scope.cancel()


def _refused(got: tuple[int, str], code: int, words: str) -> None:
    assert got[0] == code and words in got[1], got
    assert len(got[1].encode()) <= WHY_LIMIT


def test_the_hub_refuses_a_quarantined_wallet_4101_then_4008_for_a_worker_of_the_first_codes(monkeypatch) -> None:
    import relay.hub._sessions as sessions

    async def main() -> None:
        hub = _hub()
        liar, other = Wallet.generate(), Wallet.generate()
        until = time.time_ns() // 1_000_000 + 3_600_000
        hub.registry.ban(liar.address, until)
        hub.registry.ban(other.address, until)
        first = await _dial(hub, _worker(liar))
        _refused(first, CloseCode.QUARANTINED, "wallet quarantined by this hub until")
        # The same wallet again: only a worker that does not know 4101 dials again unchanged,
        # and such a worker stops on 4008 alone. Same reason, same class.
        again = await _dial(hub, _worker(liar))
        assert again == (CloseCode.REFUSED, first[1])
        _refused(await _dial(hub, _worker(other)), CloseCode.QUARANTINED, "quarantined")  # another wallet: its own code
        monkeypatch.setattr(sessions, "FIRST_TABLE_MEMORY_S", 0.0)  # long after: the code again
        _refused(await _dial(hub, _worker(liar)), CloseCode.QUARANTINED, "quarantined")

    _run(main)


def test_the_hub_refuses_slices_outside_its_model_4102_and_policies_that_do_not_meet_4103() -> None:
    async def main() -> None:
        hub = _hub(model_shape=ModelShape(layers=2, experts=4))
        wallet = Wallet.generate()
        _refused(await _dial(hub, _worker(wallet, {1: [0, 4]})), CloseCode.OUTSIDE_MODEL, "not in the model served")
        _refused(await _dial(hub, _worker(wallet, {1: [0, 4]})), CloseCode.REFUSED, "not in the model served")
        off = _hub(e2e="off")
        _refused(await _dial(off, _worker(Wallet.generate(), require_encryption=True)), CloseCode.E2E_MISMATCH,
                 "--e2e off")

    _run(main)


def test_the_hub_refuses_a_hello_that_breaks_the_rules_4100_every_time() -> None:
    from kvasir_rpc import session_pb2

    def flip_signature(data: bytes) -> bytes:
        hello = session_pb2.SessionHello.FromString(data)
        hello.signature = bytes([hello.signature[0] ^ 1]) + hello.signature[1:]
        return hello.SerializeToString()

    async def main() -> None:
        hub, wallet = _hub(), Wallet.generate()
        for _ in range(2):  # never 4008: a worker of the first codes retried it (1008), and still does
            _refused(await _dial(hub, _worker(wallet), hello=flip_signature), CloseCode.HELLO_INVALID, "bad signature")

    _run(main)


def test_the_hub_refuses_a_hello_for_another_challenge_4201_and_none_in_time_4200() -> None:
    async def main() -> None:
        hub = _hub(handshake_timeout_s=3.0)
        elsewhere = _worker(Wallet.generate())
        stale = elsewhere.receive_challenge(HubHandshake(Wallet.generate()).challenge())
        _refused(await _dial(hub, _worker(Wallet.generate()), hello=lambda _: stale), CloseCode.HELLO_STALE,
                 "stale challenge")
        _refused(await _dial(hub, None), CloseCode.HANDSHAKE_TIMEOUT, "handshake timed out")

    _run(main)


def test_the_hub_caps_say_which_4202_4203_4204() -> None:
    address = address_key(remote_host(REMOTE))

    async def main() -> None:
        wallet = Wallet.generate()
        hub = _hub(max_sessions_per_wallet=1)
        hub._hold(wallet.address, "203.0.113.9")
        _refused(await _dial(hub, _worker(wallet)), CloseCode.WALLET_CAP, "too many sessions for this wallet")
        hub = _hub(max_sessions_per_address=1)
        hub._hold("another wallet", address)
        _refused(await _dial(hub, _worker(wallet)), CloseCode.ADDRESS_CAP, "too many sessions from this address")
        hub = _hub(max_sessions=1)
        hub._hold("another wallet", "203.0.113.9")
        _refused(await _dial(hub, _worker(wallet)), CloseCode.HUB_FULL, "the hub holds its most sessions (1)")

    _run(main)


def test_the_hub_refuses_new_sessions_too_fast_4205_the_wait_in_the_reason() -> None:
    from relay.hub._admission import SessionRate, SessionRateLimits, Standing

    async def main() -> None:
        rate = SessionRate(SessionRateLimits(address_burst=1.0, address_per_minute=1.0))
        assert rate.admit(address_key(remote_host(REMOTE)), Standing.NEW) is None  # the address's one token
        hub = _hub(rate=rate)
        code, why = await _dial(hub, _worker(Wallet.generate()))
        _refused((code, why), CloseCode.RATE_LIMITED, "come too fast")
        assert re.search(r"retry in \d+ s$", why), why  # for people; the worker backs off on the code alone

    _run(main)


# -- the gateway's closes --------------------------------------------------------------------


class _Closed:
    """What a gateway's WebSocket was closed with."""

    def __init__(self) -> None:
        self.closes: list[tuple[int, str]] = []

    async def close(self, code: int, reason: str = "") -> None:
        self.closes.append((code, reason))


def test_the_gateway_closes_a_worker_with_no_hub_4206_and_a_late_hub_data_path_4210() -> None:

    from relay.gateway._gateway import Gateway, GatewayConfig

    class GoneHub:
        async def send_message(self, message: str) -> None:
            raise WsClosed(1006, "gone")

    async def main() -> None:
        gateway = Gateway(GatewayConfig(hub_token="t" * 32))
        worker = _Closed()
        await gateway._serve_worker(worker, "198.51.100.1:1")  # type: ignore[arg-type]
        assert worker.closes == [(CloseCode.NO_HUB, "no hub connected")]
        gateway._control = GoneHub()  # type: ignore[assignment]
        worker = _Closed()
        await gateway._serve_worker(worker, "198.51.100.1:2")  # type: ignore[arg-type]
        assert worker.closes == [(CloseCode.NO_HUB, "hub went away")]
        hub_data = _Closed()
        await gateway._serve_data(hub_data, "no-such-pairing")  # type: ignore[arg-type]
        assert hub_data.closes == [(CloseCode.PAIRING_GONE, "pairing gone")]
        assert {close_class(c) for c in (CloseCode.NO_HUB, CloseCode.PAIRING_GONE)} == {"retry"}

    _run(main)


# -- the worker acts on the code --------------------------------------------------------------

HUB_KEY = Wallet.generate()


class FakeHub:
    """What ``worker._tunnel``'s ``open_websocket`` dials instead of a socket: for each dial, a
    hub over memory streams (the library's WebSocket at both ends) that challenges, reads the
    hello, accepts it when ``accept``, then closes with ``code``. ``dials`` counts the dials,
    ``heard`` the worker's own close codes (a refusal of its own)."""

    def __init__(self, code: int, *, accept: bool = False, reason: str = "refused for a test",
                 live_s: float = 1.0) -> None:
        self.code, self.accept, self.reason, self.live_s = code, accept, reason, live_s
        self.dials = 0
        self.heard: list[int] = []

    async def _serve(self, stream: trio.abc.Stream) -> None:
        ws = WebSocket(stream, max_message_bytes=1 << 20, keepalive_s=15.0, idle_timeout_s=25.0)
        hs = HubHandshake(HUB_KEY, tunnel_channels=0)
        try:
            await ws.send_message(hs.challenge())
            hello = await ws.receive_message()
        except WsClosed as exc:
            self.heard.append(exc.code)
            return
        assert isinstance(hello, bytes)
        if self.accept:
            info = hs.receive_hello(hello)
            await ws.send_message(hs.accept(f"s{self.dials}-test" if info.expert_capacity == 0 else "plan",
                                            {0: (0,)} if info.expert_capacity else None))
            await trio.sleep(self.live_s)
        await ws.close(self.code, self.reason)

    @contextlib.asynccontextmanager
    async def open(self, url: str, ssl_context: object = None, *, subprotocols: list[str] = (),  # type: ignore[assignment]
                   **_: object) -> AsyncIterator[WebSocket]:
        self.dials += 1
        client, server = trio.testing.memory_stream_pair()
        try:
            async with trio.open_nursery() as nursery:
                served = trio.Event()

                async def serve() -> None:
                    try:
                        await self._serve(server)
                    finally:
                        served.set()

                nursery.start_soon(serve)
                ws = WebSocket(client, max_message_bytes=1 << 20, keepalive_s=15.0, idle_timeout_s=25.0,
                               client=True)
                ws.subprotocol = TUNNEL_SUBPROTOCOL if TUNNEL_SUBPROTOCOL in subprotocols else None
                try:
                    yield ws
                finally:
                    await ws.close(1000)
                    with trio.CancelScope(shield=True), trio.move_on_after(5):
                        await served.wait()  # the hub reads what was sent
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # as the worker's own open_websocket: an error comes out as itself
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise


@pytest.fixture
def fake_hub(monkeypatch):  # type: ignore[no-untyped-def]
    import worker._tunnel as tunnel

    def make(code: int, **kw: object) -> FakeHub:
        hub = FakeHub(code, **kw)  # type: ignore[arg-type]
        monkeypatch.setattr(tunnel, "open_websocket", hub.open)
        return hub

    return make


def _tunnel(hub: FakeHub, *, url: str = "ws://hub.example:8765", gateway: bool = False, pinned: str | None = None,
            for_s: float = 120.0):  # type: ignore[no-untyped-def]
    """Run ``run_tunnel`` against ``hub`` for ``for_s`` fake seconds: (the TunnelRefused line or
    None, the holder)."""
    from worker._tunnel import TunnelHolder, TunnelRefused, run_tunnel

    holder = TunnelHolder(url)
    out: list[str] = []

    async def main() -> None:
        wallet = Wallet.generate()
        with trio.move_on_after(for_s):
            try:
                await run_tunnel(url, lambda: _worker(wallet, expected_hub_key=pinned), "/nonexistent.sock",
                                 holder=holder, gateway=gateway)
            except BaseException as exc:  # noqa: BLE001 - a group holding TunnelRefused
                refused = leaf_exception(exc)
                if not isinstance(refused, TunnelRefused):
                    raise
                out.append(str(refused))

    _run(main)
    return (out[0] if out else None), holder


@pytest.mark.parametrize("code", [CloseCode.QUARANTINED, CloseCode.OUTSIDE_MODEL, CloseCode.REFUSED, 4150])
def test_a_permanent_code_in_the_handshake_stops_the_worker_with_one_line(fake_hub, code) -> None:
    hub = fake_hub(code, reason="hello: layer 9 is not in the model served (2 layers)")
    line, _ = _tunnel(hub)
    assert hub.dials == 1
    assert line is not None and "\n" not in line, line
    assert line == ("worker: the hub refused this worker at ws://hub.example:8765: hello: layer 9 is not in the "
                    f"model served (2 layers); dialling again unchanged would get the same answer (close code {code})")


@pytest.mark.parametrize("code", [CloseCode.RATE_LIMITED, CloseCode.WALLET_CAP, CloseCode.HANDSHAKE_TIMEOUT,
                                  CloseCode.POLICY_VIOLATION, CloseCode.TRY_AGAIN_LATER, 4050, 4350])
def test_a_retry_code_in_the_handshake_is_dialled_again_with_backoff(fake_hub, code) -> None:
    hub = fake_hub(code, reason="too many sessions for this wallet (at most 4 per wallet on this hub)")
    line, holder = _tunnel(hub, for_s=30.0)
    assert line is None and hub.dials >= 4, (line, hub.dials)  # 0.25 s doubling: at least 4 dials in 30 s
    assert holder.last_error == ("the hub at ws://hub.example:8765 refused the session: too many sessions for this "
                                 f"wallet (at most 4 per wallet on this hub) (close code {code})")


def test_after_a_live_session_a_permanent_code_stops_a_retry_code_backs_off_a_normal_close_redials(fake_hub) -> None:
    line, _ = _tunnel(fake_hub(CloseCode.QUARANTINED, accept=True, reason="quarantined: VIOLATION_ROW_CHECK"))
    assert line is not None and line.endswith("would get the same answer (close code 4101)"), line
    fast = fake_hub(CloseCode.NORMAL, accept=True, live_s=0.1)
    _tunnel(fast, for_s=20.0)
    slow = fake_hub(CloseCode.POLICY_VIOLATION, accept=True, live_s=0.1)
    _tunnel(slow, for_s=20.0)
    # Each session lasts 0.1 s: a normal close redials after 50 ms (0.15 s a dial), a retry
    # code after a backoff from its start (0.25 s x 0.5..1.5: 0.35 s a dial on average).
    assert fast.dials >= 100 and slow.dials < 0.7 * fast.dials, (fast.dials, slow.dials)


def test_the_workers_own_refusal_is_sent_with_its_code_and_stops_it(fake_hub) -> None:
    hub = fake_hub(CloseCode.NORMAL)
    line, _ = _tunnel(hub, pinned=Wallet.generate().address)
    assert hub.heard == [CloseCode.HUB_KEY_MISMATCH]
    assert line is not None and line.startswith("worker: this worker refused the hub at ws://hub.example:8765: "
                                                "unexpected hub key"), line
    assert line.endswith("(close code 4104)")


def test_the_worker_names_the_gateway_or_the_hub_from_its_flags_not_the_url(fake_hub) -> None:
    from worker._tunnel import _dial_failure

    url = "wss://gw.example/v1/worker"
    _, holder = _tunnel(fake_hub(CloseCode.NO_HUB, reason="no hub connected"), url=url, gateway=True, for_s=1.0)
    assert holder.last_error == "the gateway at wss://gw.example refused the session: no hub connected (close code 4206)"
    # A hub's address may end with the same path (a hub ignores it): still the hub, and --hub.
    hub_url = "ws://hub.example:8765/v1/worker"
    failure, hint = _dial_failure(hub_url, ConnectionRefusedError(), gateway=False)
    assert failure == f"cannot reach the hub at {hub_url}: connection refused" and "--hub" in hint
    failure, hint = _dial_failure(url, ConnectionRefusedError(), gateway=True)
    assert failure == "cannot reach the gateway at wss://gw.example: connection refused" and "--gateway" in hint


def test_asking_for_a_slice_stops_on_a_permanent_code_and_retries_a_retry_code(fake_hub) -> None:
    from worker._tunnel import TunnelRefused, request_plan

    def plan(hub: FakeHub, attempts: int = 3) -> str:
        wallet = Wallet.generate()

        async def main() -> None:
            await request_plan("ws://hub.example:8765", lambda: _worker(wallet, expert_capacity=1),
                               attempts=attempts, min_backoff_s=0.01)

        with pytest.raises(TunnelRefused) as refused:
            _run(main)
        return str(refused.value)

    permanent = fake_hub(CloseCode.QUARANTINED, reason="wallet quarantined by this hub until 2030-01-01 00:00:00 UTC")
    assert plan(permanent).endswith("dialling again unchanged would get the same answer (close code 4101)")
    assert permanent.dials == 1
    busy = fake_hub(CloseCode.RATE_LIMITED, reason="new wallets are joining this hub too fast; retry in 3 s")
    assert plan(busy).startswith("could not ask the hub at ws://hub.example:8765 for a slice in 3 tries: ")
    assert busy.dials == 3

    async def answered() -> dict[int, tuple[int, ...]]:
        from worker._tunnel import request_plan

        return await request_plan("ws://hub.example:8765", lambda: _worker(Wallet.generate(), expert_capacity=1))

    fake_hub(CloseCode.NORMAL, accept=True)
    assert trio.run(answered, clock=trio.testing.MockClock(autojump_threshold=0)) == {0: (0,)}
