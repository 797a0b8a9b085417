"""The hub's receipt loop keeps the event loop free: every database write runs in a worker
thread, and a session's final counters are saved exactly once, at shutdown too.

In-process, no ledger (``ledger_target`` None): the store is a real SQLite file; a subclass
notes which thread each write ran on.
"""

from __future__ import annotations

import pathlib
import sqlite3
import threading
from collections.abc import Iterator

import pytest
import trio

from kvasir_rpc import HelloInfo, Wallet
from relay.hub._contributions import ContributionStore
from relay.hub._receipts import ReceiptSender
from relay.hub._registry import SessionRegistry, SessionStats

WALLET = Wallet.generate().address


class WatchedStore(ContributionStore):
    """A ContributionStore that notes the thread of every ``record`` and, when ``gate`` is
    set, holds each ended-session write until the gate opens (at most 5 s)."""

    def __init__(self, path: pathlib.Path) -> None:
        super().__init__(path)
        self.calls: list[tuple[str, bool, list[str]]] = []
        self.gate: threading.Event | None = None

    def record(self, stats: list[SessionStats], *, ended: bool = False) -> None:
        self.calls.append((threading.current_thread().name, ended, [s.session_id for s in stats]))
        if ended and self.gate is not None and not self.gate.wait(5):
            raise AssertionError("the gate stayed shut: the event loop was blocked while the store wrote")
        super().record(stats, ended=ended)

    def ended_writes(self) -> list[tuple[str, list[str]]]:
        return [(thread, ids) for thread, ended, ids in self.calls if ended]


@pytest.fixture
def store(tmp_path: pathlib.Path) -> Iterator[WatchedStore]:
    s = WatchedStore(tmp_path / "hub.sqlite")
    yield s
    s.close()


def hello() -> HelloInfo:
    return HelloInfo(wallet=WALLET, slices={0: (1, 2)}, weights_digest=b"d" * 32, device="cpu",
                     model_type="qwen3_moe", worker_version="test")


def connect(registry: SessionRegistry, sid: str, to_worker: int = 0) -> None:
    registry.add(sid, hello(), target="127.0.0.1:1", remote="127.0.0.1:2")
    registry.count_bytes(sid, to_worker=to_worker, from_worker=to_worker // 2)


def ended_row(store: ContributionStore, sid: str) -> tuple[int, int | None] | None:
    with sqlite3.connect(store.path) as db:
        return db.execute("SELECT bytes_to_worker, ended_unix_ms FROM sessions WHERE session_id = ?",
                          (sid,)).fetchone()


def make(store: ContributionStore, **kw) -> tuple[SessionRegistry, ReceiptSender]:  # type: ignore[no-untyped-def]
    registry = SessionRegistry()
    sender = ReceiptSender(store, registry, Wallet.generate(), None, **kw)
    registry.on_removed.append(sender.session_ended)
    return registry, sender


def test_a_session_that_ends_is_saved_off_the_event_loop_once(store: WatchedStore) -> None:
    registry, sender = make(store)

    async def main() -> None:
        loop_thread = threading.current_thread().name
        connect(registry, "s1", 1000)
        registry.remove("s1")  # the hook runs here, on the event loop's thread
        assert store.calls == [] and ended_row(store, "s1") is None
        assert sender.statistics().ended_queued == 1
        await sender.flush()
        await sender.flush()
        [(thread, ids)] = store.ended_writes()
        assert ids == ["s1"] and thread != loop_thread
        assert all(thread != loop_thread for thread, _, _ in store.calls)

    trio.run(main)
    row = ended_row(store, "s1")
    assert row is not None and row[0] == 1000 and row[1] is not None
    stats = sender.statistics()
    assert (stats.ended_recorded, stats.ended_queued, stats.flushes) == (1, 0, 2)


def test_the_event_loop_runs_while_the_store_writes(store: WatchedStore) -> None:
    # The store's write waits for a gate only a task on the event loop opens: were the write
    # on the loop, it would hold the loop and the gate would stay shut (AssertionError, 5 s).
    registry, sender = make(store)
    store.gate = threading.Event()

    async def open_gate() -> None:
        while not store.ended_writes():
            await trio.sleep(0.001)
        store.gate.set()  # type: ignore[union-attr]

    async def main() -> None:
        connect(registry, "s1", 10)
        registry.remove("s1")
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(open_gate)
                await sender.flush()

    trio.run(main)
    assert sender.statistics().ended_recorded == 1 and ended_row(store, "s1") is not None


def test_the_loop_wakes_for_an_ended_session_and_close_saves_the_late_ones(store: WatchedStore) -> None:
    registry, sender = make(store, interval_s=3600)

    async def main() -> None:
        connect(registry, "early", 5)
        connect(registry, "late", 7)
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender.run)
                registry.remove("early")  # wakes the loop long before its hour
                while sender.statistics().ended_recorded < 1:
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
        # The loop has stopped (its last flush is done); a session ends during shutdown.
        registry.remove("late")

    trio.run(main)
    # Saved live by a flush, but not yet as ended.
    assert ended_row(store, "late") == (7, None) and sender.statistics().ended_queued == 1
    sender.close()  # what the hub's main does once trio.run has returned
    sender.close()
    assert [ids for _, ids in store.ended_writes()] == [["early"], ["late"]]
    row = ended_row(store, "late")
    assert row is not None and row[1] is not None
    assert sender.statistics().ended_recorded == 2


def test_a_failed_write_keeps_the_final_counters_for_the_next_pass(store: WatchedStore,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    registry, sender = make(store)
    connect(registry, "s1", 3)
    registry.remove("s1")
    real = ContributionStore.record

    def full_disk(self, stats, *, ended=False):  # type: ignore[no-untyped-def]
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(ContributionStore, "record", full_disk)
    with pytest.raises(sqlite3.OperationalError):
        trio.run(sender.flush)
    assert sender.statistics().ended_queued == 1
    monkeypatch.setattr(ContributionStore, "record", real)
    trio.run(sender.flush)
    assert sender.statistics().ended_recorded == 1 and ended_row(store, "s1") is not None
