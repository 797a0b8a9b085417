"""The hub's session registry: the single source of who is connected and what they hold.

Written from the trio thread, read from gRPC handler threads, so every access holds one
lock. Byte counters are plain ints bumped under the lock; ``statistics()`` returns frozen
snapshots that metrics and SessionService read.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvasir_rpc import ExpertSet, HelloInfo, session_pb2, slices_to_proto
from relay.hub._plan import Demand, Reservations

if TYPE_CHECKING:
    from relay.hub._gateway_link import GatewayLinkState

__all__ = ["RegistryTotals", "SessionChange", "SessionRegistry", "SessionStats"]


@dataclasses.dataclass(frozen=True)
class SessionStats:
    session_id: str
    wallet: str
    slices: dict[int, ExpertSet]
    weights_digest: bytes
    device: str
    model_type: str
    connected_since_unix_ms: int
    bytes_to_worker: int
    bytes_from_worker: int
    target: str
    remote_address: str
    work_bytes: int = 0
    encrypted: bool = False
    # The AEAD sealing the tunnel when encrypted (a TunnelAead value; 0: ChaCha20-Poly1305).
    aead: int = 0
    # Through a gateway (False: the worker dialled the hub directly).
    via_gateway: bool = False
    # The last keepalive round trip (a sealed heartbeat's, or a WebSocket ping's); None
    # until the first is measured.
    rtt_ms: float | None = None
    # Accepted calls and rows behind work_bytes (the backbone's work reports, over its runs).
    work_calls: int = 0
    work_rows: int = 0
    # What the ledger credited for this session's receipts: the cumulative bytes of its
    # latest credited receipt, and the nano-KVR of all of them.
    credited_bytes: int = 0
    credited_nano_kvr: int = 0
    # The worker returns projections when asked: each row of its answers can be checked.
    projections: bool = False
    # The expert function it announced, serialized (b"": unset).
    expert_function: bytes = b""
    # Backbone connections its tunnel carries at once (1: the plain tunnel), carries now, and
    # turned away because every channel was in use.
    tunnel_channels: int = 1
    backbone_connections: int = 0
    connections_refused_busy: int = 0
    # Rows the backbones sent it but computed themselves (lost, refused or late calls), summed
    # over their runs: its fallback share is fallback_rows / (work_rows + fallback_rows).
    fallback_rows: int = 0

    def to_proto(self) -> session_pb2.Session:
        s = session_pb2.Session(
            session_id=self.session_id,
            wallet=self.wallet,
            slices=slices_to_proto(self.slices),
            weights_digest=self.weights_digest,
            device=self.device,
            model_type=self.model_type,
            connected_since_unix_ms=self.connected_since_unix_ms,
            bytes_to_worker=self.bytes_to_worker,
            bytes_from_worker=self.bytes_from_worker,
            target=self.target,
            remote_address=self.remote_address,
            work_bytes=self.work_bytes,
            encrypted=self.encrypted,
            aead=self.aead,  # type: ignore[arg-type]
            via_gateway=self.via_gateway,
            rtt_ms=self.rtt_ms or 0.0,
            work_calls=self.work_calls,
            work_rows=self.work_rows,
            credited_bytes=self.credited_bytes,
            credited_nano_kvr=self.credited_nano_kvr,
            projections=self.projections,
            tunnel_channels=self.tunnel_channels,
            backbone_connections=self.backbone_connections,
            connections_refused_busy=self.connections_refused_busy,
        )
        if self.expert_function:
            s.expert_function.MergeFromString(self.expert_function)
        return s


@dataclasses.dataclass(frozen=True)
class RegistryTotals:
    """Counters over the hub's life (live and ended sessions), for metrics:
    ``closed`` is by the reason the session ended (see ``SessionRegistry.remove``)."""

    opened: int
    closed: dict[str, int]
    bytes_to_worker: int
    bytes_from_worker: int
    # Bumped on every add and remove: a cache of what depends on the live set (the expert
    # map) is good while it is unchanged.
    generation: int


@dataclasses.dataclass(frozen=True)
class SessionChange:
    """One change a watcher is told of. Kept as the compact snapshot until the watcher sends
    it: the proto expands every slice, and a watcher's queue may hold one per live session."""

    kind: session_pb2.SessionEvent.Kind
    stats: SessionStats | None = None  # None for SYNCED

    def to_proto(self) -> session_pb2.SessionEvent:
        if self.stats is None:
            return session_pb2.SessionEvent(kind=self.kind)
        return session_pb2.SessionEvent(kind=self.kind, session=self.stats.to_proto())


@dataclasses.dataclass
class _Entry:
    hello: HelloInfo
    since_ms: int
    target: str
    remote: str
    to_worker: int = 0
    from_worker: int = 0
    work_bytes: int = 0
    work_calls: int = 0
    work_rows: int = 0
    encrypted: bool = False
    aead: int = 0
    via_gateway: bool = False
    rtt_ms: float | None = None
    credited_bytes: int = 0
    credited_nano_kvr: int = 0
    credited_seq: int = 0  # the latest credited receipt's seq: an older or repeated one adds nothing
    connections: int = 0  # backbone connections spliced now
    refused_busy: int = 0  # turned away: every channel in use
    # Rows computed by the backbones instead (their reports, cumulative per run), by run id;
    # runs pushed out of the (bounded) map leave their last count in fallback_folded.
    fallback_runs: dict[str, int] = dataclasses.field(default_factory=dict)
    fallback_folded: int = 0
    # Ends the session from any thread, with a reason and a close code for the worker.
    kick: Callable[[str, int], None] | None = None


class SessionRegistry:
    """Thread-safe map session id -> live session, with watchers notified of changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, _Entry] = {}
        self._watchers: set[queue.SimpleQueue[SessionChange | None]] = set()
        # wallet -> refused until (unix ms): quarantined wallets may not open sessions.
        self._bans: dict[str, int] = {}
        # Called with the final SessionStats of each session that ends (outside the lock).
        self.on_removed: list[Callable[[SessionStats], None]] = []
        # Called with each keepalive round trip measured, in seconds (outside the lock).
        self.on_rtt: list[Callable[[float], None]] = []
        self._opened = 0
        self._closed: dict[str, int] = {}
        self._ended_to = 0
        self._ended_from = 0
        self._generation = 0
        # What the swarm needs, for --experts auto (relay.hub._plan): the rows the backbones route
        # to each expert (reported with their work), and the slices suggested recently.
        self.demand = Demand()
        self.reservations = Reservations()
        # Each backbone run's last status (its work reports carry one), by run id, with when.
        self._backbones: dict[str, tuple[float, session_pb2.BackboneStatus]] = {}
        # The hub's gateway links (relay.hub._gateway_link.GatewayLinkState), for its page; added
        # and updated on the hub's event loop, read there.
        self.gateway_links: list[GatewayLinkState] = []

    def _stats(self, sid: str, e: _Entry) -> SessionStats:
        h = e.hello
        return SessionStats(
            session_id=sid,
            wallet=h.wallet,
            slices=h.slices,
            weights_digest=h.weights_digest,
            device=h.device,
            model_type=h.model_type,
            connected_since_unix_ms=e.since_ms,
            bytes_to_worker=e.to_worker,
            bytes_from_worker=e.from_worker,
            target=e.target,
            remote_address=e.remote,
            work_bytes=e.work_bytes,
            encrypted=e.encrypted,
            aead=e.aead,
            via_gateway=e.via_gateway,
            rtt_ms=e.rtt_ms,
            work_calls=e.work_calls,
            work_rows=e.work_rows,
            credited_bytes=e.credited_bytes,
            credited_nano_kvr=e.credited_nano_kvr,
            projections=h.projections,
            expert_function=h.expert_function,
            tunnel_channels=max(h.tunnel_channels, 1),
            backbone_connections=e.connections,
            connections_refused_busy=e.refused_busy,
            fallback_rows=e.fallback_folded + sum(e.fallback_runs.values()),
        )

    def _notify(self, kind: session_pb2.SessionEvent.Kind, stats: SessionStats) -> None:
        change = SessionChange(kind, stats)
        for w in self._watchers:
            w.put(change)

    def add(self, session_id: str, hello: HelloInfo, *, target: str, remote: str,
            kick: Callable[[str, int], None] | None = None, encrypted: bool = False, via_gateway: bool = False,
            aead: int = 0) -> bool:
        """A session is live. True when its wallet joined with a plan the hub handed out
        (``--experts auto``): the plan stops counting as a reservation in the same step as the
        session starts counting, so a worker planned meanwhile sees it one way or the other."""
        with self._lock:
            entry = _Entry(hello=hello, since_ms=time.time_ns() // 1_000_000, target=target, remote=remote,
                           kick=kick, encrypted=encrypted, via_gateway=via_gateway, aead=aead)
            self._sessions[session_id] = entry
            self._opened += 1
            self._generation += 1
            self._notify(session_pb2.SessionEvent.KIND_ADDED, self._stats(session_id, entry))
            return self.reservations.release(hello.wallet)

    def remove(self, session_id: str, reason: str = "unknown") -> None:
        """End a live session; ``reason`` (a short word: "worker", "keepalive", "kicked"...)
        is what metrics count it under. Nothing happens for a session not live."""
        with self._lock:
            entry = self._sessions.pop(session_id, None)
            if entry is None:
                return
            stats = self._stats(session_id, entry)
            self._closed[reason] = self._closed.get(reason, 0) + 1
            self._ended_to += entry.to_worker
            self._ended_from += entry.from_worker
            self._generation += 1
            self._notify(session_pb2.SessionEvent.KIND_REMOVED, stats)
        for hook in self.on_removed:
            hook(stats)

    def count_bytes(self, session_id: str, *, to_worker: int = 0, from_worker: int = 0) -> None:
        with self._lock:
            entry = self._sessions.get(session_id)
            if entry is not None:
                entry.to_worker += to_worker
                entry.from_worker += from_worker

    def get(self, session_id: str) -> SessionStats | None:
        """The live session's snapshot, or None."""
        with self._lock:
            e = self._sessions.get(session_id)
            return None if e is None else self._stats(session_id, e)

    def set_work(self, session_id: str, work_bytes: int, calls: int = 0, rows: int = 0) -> None:
        """The session's accepted work so far (what its receipts pay): its bytes, and the
        calls and rows behind them. Counts never go down."""
        with self._lock:
            e = self._sessions.get(session_id)
            if e is not None:
                e.work_bytes = max(e.work_bytes, work_bytes)
                e.work_calls = max(e.work_calls, calls)
                e.work_rows = max(e.work_rows, rows)

    #: Backbone runs whose fallback counts a session keeps apart (the rest are folded).
    MAX_FALLBACK_RUNS = 64

    def note_fallback(self, session_id: str, run_id: str, rows: int) -> None:
        """Backbone run ``run_id`` computed ``rows`` of the session's rows itself so far (its
        work report's cumulative count: an older or repeated one adds nothing)."""
        with self._lock:
            e = self._sessions.get(session_id)
            if e is None:
                return
            e.fallback_runs[run_id] = max(e.fallback_runs.get(run_id, 0), rows)
            if len(e.fallback_runs) > self.MAX_FALLBACK_RUNS:
                e.fallback_folded += e.fallback_runs.pop(next(iter(e.fallback_runs)))

    #: A backbone not heard from for this long is gone from ``backbones()``.
    BACKBONE_GONE_S = 15.0
    MAX_BACKBONES = 1024

    def note_backbone(self, run_id: str, status: session_pb2.BackboneStatus) -> None:
        """A backbone run's status, from its latest work report."""
        now = time.monotonic()
        with self._lock:
            self._backbones[run_id] = (now, status)
            if len(self._backbones) > self.MAX_BACKBONES:  # the longest silent ones go first
                for rid, _ in sorted(self._backbones.items(), key=lambda kv: kv[1][0])[:-self.MAX_BACKBONES]:
                    del self._backbones[rid]

    def backbones(self) -> list[tuple[str, float, session_pb2.BackboneStatus]]:
        """The backbones heard from in the last BACKBONE_GONE_S: (run id, seconds since, status)."""
        now = time.monotonic()
        with self._lock:
            self._backbones = {rid: v for rid, v in self._backbones.items() if now - v[0] <= self.BACKBONE_GONE_S}
            return [(rid, now - t, st) for rid, (t, st) in sorted(self._backbones.items())]

    def note_connection(self, session_id: str, *, opened: int = 0, refused_busy: int = 0) -> None:
        """A backbone connection spliced (``opened`` 1) or ended (-1), or turned away because
        every channel of the tunnel was in use (``refused_busy`` 1)."""
        with self._lock:
            e = self._sessions.get(session_id)
            if e is not None:
                e.connections = max(e.connections + opened, 0)
                e.refused_busy += refused_busy

    def set_rtt(self, session_id: str, rtt_s: float) -> None:
        """The session's latest keepalive round trip, in seconds (also handed to ``on_rtt``)."""
        with self._lock:
            e = self._sessions.get(session_id)
            if e is None:
                return
            e.rtt_ms = rtt_s * 1000.0
        for hook in self.on_rtt:
            hook(rtt_s)

    def credit(self, session_id: str, seq: int, cumulative_bytes: int, nano_kvr: int) -> None:
        """The ledger credited receipt ``seq`` of a live session: ``cumulative_bytes`` in all
        so far, ``nano_kvr`` for this receipt. A seq not above the last one counted adds
        nothing (the ledger answers a receipt sent again with the same credit)."""
        with self._lock:
            e = self._sessions.get(session_id)
            if e is None or seq <= e.credited_seq:
                return
            e.credited_seq = seq
            e.credited_bytes = max(e.credited_bytes, cumulative_bytes)
            e.credited_nano_kvr += nano_kvr

    def totals(self) -> RegistryTotals:
        """Counters over the hub's life: sessions opened and closed (by reason), tunnel bytes
        of live and ended sessions."""
        with self._lock:
            to = self._ended_to + sum(e.to_worker for e in self._sessions.values())
            frm = self._ended_from + sum(e.from_worker for e in self._sessions.values())
            return RegistryTotals(opened=self._opened, closed=dict(self._closed), bytes_to_worker=to,
                                  bytes_from_worker=frm, generation=self._generation)

    def kick(self, session_id: str, reason: str, code: int = 1008) -> bool:
        """End a live session (its worker is told ``reason``, with close ``code``: 1008 by
        default, 4101 for a quarantine, 4010 to ask a planned worker to plan again). False if
        it is not live."""
        with self._lock:
            e = self._sessions.get(session_id)
            kick = None if e is None else e.kick
        if kick is None:
            return False
        kick(reason, code)
        return True

    def ban(self, wallet: str, until_unix_ms: int) -> None:
        with self._lock:
            self._bans[wallet] = max(until_unix_ms, self._bans.get(wallet, 0))

    def banned_until(self, wallet: str) -> int | None:
        """Until when (unix ms) ``wallet`` is refused, or None."""
        now = time.time_ns() // 1_000_000
        with self._lock:
            until = self._bans.get(wallet)
            if until is not None and until <= now:
                del self._bans[wallet]
                until = None
            return until

    def statistics(self) -> list[SessionStats]:
        """A frozen snapshot of every live session, oldest first."""
        with self._lock:
            items = [self._stats(sid, e) for sid, e in self._sessions.items()]
        return sorted(items, key=lambda s: (s.connected_since_unix_ms, s.session_id))

    def watch(self) -> queue.SimpleQueue[SessionChange | None]:
        """A queue that first gets ADDED for each live session and SYNCED, then every change;
        None when the registry closes. Each change becomes a proto only as it is sent."""
        q: queue.SimpleQueue[SessionChange | None] = queue.SimpleQueue()
        with self._lock:
            for sid, e in self._sessions.items():
                q.put(SessionChange(session_pb2.SessionEvent.KIND_ADDED, self._stats(sid, e)))
            q.put(SessionChange(session_pb2.SessionEvent.KIND_SYNCED))
            self._watchers.add(q)
        return q

    def unwatch(self, q: queue.SimpleQueue[SessionChange | None]) -> None:
        with self._lock:
            self._watchers.discard(q)

    def close_watchers(self) -> None:
        with self._lock:
            for w in self._watchers:
                w.put(None)
            self._watchers.clear()
