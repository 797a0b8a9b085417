"""What the hub's status page and ``/api/status`` show: a plain object fed snapshots of the
registry, the work desk and the receipt loop, with an injectable clock (no trio, no I/O).

``sample()`` runs every ``SAMPLE_S`` (the HTTP server's own task): it records the swarm's
throughput in a bounded ring (``HISTORY_POINTS``, about five minutes) and each live session's
rows so far, from which its recent rate comes. ``snapshot()`` builds the JSON document; the
layers x experts map of holders is recomputed only when the live set changed (the registry's
generation), so a poll costs a copy of the session list, not a pass over every expert.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

import numpy as np

from kvasir_rpc import ModelShape, format_kvr
from kvasir_rpc.protocol import AEAD_NAMES
from relay.hub._receipts import ReceiptSenderStats
from relay.hub._registry import SessionRegistry, SessionStats
from relay.hub._work_desk import WorkDeskStats

__all__ = ["HISTORY_POINTS", "RATE_WINDOW", "SAMPLE_S", "StatusBoard"]

SAMPLE_S = 2.0
# About five minutes of throughput at SAMPLE_S.
HISTORY_POINTS = 150
# A session's rows/s is its rows' growth over its last RATE_WINDOW samples (about 10 s):
# the backbone reports work about once a second, so a single sample's rate jumps.
RATE_WINDOW = 6


@dataclasses.dataclass(frozen=True)
class _Point:
    t: float  # the wall clock (unix seconds)
    mono: float  # the monotonic clock, for rates
    rows: int
    tunnel_bytes: int
    work_bytes: int


def _runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """Sorted unique ids as runs of consecutive ids, (first, last) each."""
    if not len(ids):
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1)
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((breaks, [len(ids) - 1]))
    return list(zip(ids[starts].tolist(), ids[ends].tolist(), strict=True))


class StatusBoard:
    """The hub's status, for people: see the module's docstring.

    ``desk`` and ``sender`` return the work desk's and the receipt loop's counters (None: the
    hub keeps no work records). ``clock`` is monotonic seconds, ``wall`` unix seconds; tests
    pass fakes. Not thread-safe: call ``sample`` and ``snapshot`` from one thread (the hub's
    event loop); the registry they read is thread-safe."""

    def __init__(self, registry: SessionRegistry, *, hub_key: str, shape: ModelShape | None = None,
                 desk: Callable[[], WorkDeskStats] | None = None,
                 sender: Callable[[], ReceiptSenderStats] | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.hub_key = hub_key
        self.shape = shape
        self._desk = desk
        self._sender = sender
        self._clock = clock
        self._wall = wall
        self._started = clock()
        self._history: collections.deque[_Point] = collections.deque(maxlen=HISTORY_POINTS + 1)
        # session id -> its last RATE_WINDOW (monotonic time, rows) samples; live sessions only.
        self._rows: dict[str, collections.deque[tuple[float, int]]] = {}
        self._map_generation = -1
        self._seen = (0, 0)  # the largest grid sessions' slices have shown (layers, experts)
        self._map: dict[str, object] = {}

    # -- sampling ----------------------------------------------------------------------

    def sample(self) -> None:
        """Record the swarm's throughput now, and each live session's rows."""
        now = self._clock()
        totals = self.registry.totals()
        desk = self._desk() if self._desk is not None else None
        self._history.append(_Point(t=self._wall(), mono=now, rows=desk.work_rows if desk else 0,
                                    tunnel_bytes=totals.bytes_to_worker + totals.bytes_from_worker,
                                    work_bytes=desk.work_bytes if desk else 0))
        live = self.registry.statistics()
        for s in live:
            self._rows.setdefault(s.session_id, collections.deque(maxlen=RATE_WINDOW)).append((now, s.work_rows))
        ids = {s.session_id for s in live}
        for sid in [sid for sid in self._rows if sid not in ids]:
            del self._rows[sid]

    def rows_per_s(self, session_id: str) -> float:
        """The session's rows per second over its recent samples; 0 before two samples."""
        samples = self._rows.get(session_id)
        if not samples or len(samples) < 2:
            return 0.0
        (t0, r0), (t1, r1) = samples[0], samples[-1]
        return (r1 - r0) / (t1 - t0) if t1 > t0 else 0.0

    def history(self) -> list[dict[str, float]]:
        """Throughput between consecutive samples, oldest first: rows/s of accepted work,
        tunnel bytes/s (both directions), work bytes/s; at most HISTORY_POINTS points."""
        points = list(self._history)
        out = []
        for a, b in zip(points, points[1:], strict=False):
            dt = b.mono - a.mono
            if dt <= 0:
                continue
            out.append({"t": round(b.t, 3), "rows_per_s": (b.rows - a.rows) / dt,
                        "bytes_per_s": (b.tunnel_bytes - a.tunnel_bytes) / dt,
                        "work_bytes_per_s": (b.work_bytes - a.work_bytes) / dt})
        return out

    # -- the document ------------------------------------------------------------------

    def model(self, sessions: list[SessionStats]) -> dict[str, object]:
        """The model's grid: from the hub's --model/--layers/--experts ("config"), else the
        smallest that holds every slice a session has held while this board ran ("sessions":
        a worker that leaves does not shrink the map, its experts show as local-only), else
        none."""
        if self.shape is not None:
            return {"layers": self.shape.layers, "experts": self.shape.experts, "source": "config"}
        layers, experts = self._seen
        for s in sessions:
            for layer, ids in s.slices.items():
                if len(ids):
                    layers = max(layers, layer + 1)
                    experts = max(experts, int(ids.to_array().max()) + 1)
        self._seen = (layers, experts)
        return {"layers": layers, "experts": experts, "source": "sessions" if layers else "none"}

    def expert_map(self, sessions: list[SessionStats], generation: int) -> dict[str, object]:
        """For each layer x expert, how many live sessions hold it (0: none does, so the
        backbone computes it itself). Recomputed only when ``generation`` changed."""
        if generation == self._map_generation:
            return self._map
        model = self.model(sessions)
        layers, experts = int(model["layers"]), int(model["experts"])  # type: ignore[call-overload]
        holders = np.zeros((layers, experts), dtype=np.int64)
        # Who holds what, for the page's hover: session id -> [[layer, first, last], ...] (runs
        # of consecutive expert ids, both ends included), on the map's grid.
        runs: dict[str, list[list[int]]] = {}
        for s in sessions:
            held = runs.setdefault(s.session_id, [])
            for layer, ids in sorted(s.slices.items()):
                if layer < layers and len(ids):
                    arr = ids.to_array()
                    arr = arr[arr < experts]
                    holders[layer, arr] += 1  # a set: each id once
                    held.extend([layer, int(a), int(b)] for a, b in _runs(arr))
        self._map = {"generation": generation, "layers": layers, "experts": experts, "source": model["source"],
                     "holders": holders.tolist(), "holder_runs": runs}
        self._map_generation = generation
        return self._map

    def backbones(self) -> list[dict[str, object]]:
        """The backbones heard from lately (their work reports): kind, load, and where their
        expert rows ran (the share computed by workers, here by choice, here after a lost call)."""
        out = []
        for run_id, age_s, st in self.registry.backbones():
            rows = st.remote_rows + st.local_rows + st.fallback_rows
            out.append({"run": run_id[:12], "kind": st.kind or "generate", "running": st.running,
                        "waiting": st.waiting, "remote_rows": st.remote_rows, "local_rows": st.local_rows,
                        "fallback_rows": st.fallback_rows, "worker_busy_refusals": st.worker_busy_refusals,
                        "remote_share": round(st.remote_rows / rows, 4) if rows else None,
                        "fallback_share": round(st.fallback_rows / rows, 4) if rows else None,
                        "seen_s_ago": round(age_s, 1)})
        return out

    def demand(self) -> dict[str, object]:
        """What the backbones route to (their reports, decayed: a half-life of ``half_life_s``),
        on the expert map's grid: rows per (layer, expert), and the share of all rows that go to
        experts no live session holds (the backbones compute those themselves)."""
        grid = self._map
        layers, experts = int(grid.get("layers", 0)), int(grid.get("experts", 0))  # type: ignore[call-overload]
        rows = np.zeros((layers, experts), dtype=np.float64)
        for (layer, e), v in self.registry.demand.snapshot().items():
            if layer < layers and e < experts:
                rows[layer, e] = v
        holders = np.asarray(grid.get("holders", np.zeros((layers, experts))), dtype=np.int64)
        total = float(rows.sum())
        uncovered = float(rows[holders == 0].sum()) if total else 0.0
        return {"half_life_s": self.registry.demand.half_life_s, "rows": np.round(rows, 1).tolist(),
                "uncovered_share": round(uncovered / total, 4) if total else 0.0, "total_rows": round(total, 1)}

    def _session(self, s: SessionStats) -> dict[str, object]:
        return {
            "session_id": s.session_id,
            "wallet": s.wallet,
            "device": s.device,
            "model_type": s.model_type,
            "encrypted": s.encrypted,
            "aead": AEAD_NAMES.get(s.aead, str(s.aead)) if s.encrypted else None,
            "via": "gateway" if s.via_gateway else "direct",
            # "rows": every row of its answers can be checked; "sampled": sampled audits only.
            "checks": "rows" if s.projections else "sampled",
            "connected_since_unix_ms": s.connected_since_unix_ms,
            "rtt_ms": None if s.rtt_ms is None else round(s.rtt_ms, 3),
            "calls": s.work_calls,
            "rows": s.work_rows,
            "rows_per_s": round(self.rows_per_s(s.session_id), 3),
            "bytes_to_worker": s.bytes_to_worker,
            "bytes_from_worker": s.bytes_from_worker,
            "work_bytes": s.work_bytes,
            "credited_bytes": s.credited_bytes,
            "credited_nano_kvr": s.credited_nano_kvr,
            "credited_kvr": format_kvr(s.credited_nano_kvr),
            "layers": len(s.slices),
            "experts": sum(len(ids) for ids in s.slices.values()),
            # Backbones its tunnel carries now, at most at once, and turned away (all channels busy).
            "backbones": s.backbone_connections,
            "backbones_max": s.tunnel_channels,
            "backbones_refused": s.connections_refused_busy,
            # Rows the backbones sent it but computed themselves (lost, refused or late calls).
            "fallback_rows": s.fallback_rows,
            "fallback_share": round(s.fallback_rows / (s.work_rows + s.fallback_rows), 4)
            if s.work_rows + s.fallback_rows else None,
        }

    def links(self, sender: ReceiptSenderStats | None) -> dict[str, object]:
        """Where the hub's receipts and workers come through: the ledger (its address, the
        receipts waiting for it, when it last answered) and each gateway link's state."""
        ledger = None if sender is None else {
            "address": sender.ledger, "pending_receipts": sender.pending,
            "last_answer_unix_ms": sender.last_answer_unix_ms or None, "last_error": sender.last_error or None}
        gateways = [{"gateway": g.gateway, "state": g.state, "since_unix_ms": g.since_unix_ms,
                     "last_error": g.last_error or None, "connects": g.connects, "pairs_live": g.pairs_live,
                     "pairs_served": g.pairs_served} for g in self.registry.gateway_links]
        return {"ledger": ledger, "gateways": gateways}

    @staticmethod
    def quarantines(desk: WorkDeskStats | None) -> list[dict[str, object]]:
        """The latest quarantines, newest first."""
        if desk is None:
            return []
        return [dataclasses.asdict(q) for q in reversed(desk.recent_quarantines)]

    def snapshot(self) -> dict[str, object]:
        """The status document (``/api/status``): plain JSON types, no secrets (addresses of
        wallets and of the hub's key are public; tokens, targets and remote addresses are
        left out)."""
        totals = self.registry.totals()  # its generation read before the sessions: never newer than them
        sessions = self.registry.statistics()
        generation = totals.generation
        desk = self._desk() if self._desk is not None else None
        sender = self._sender() if self._sender is not None else None
        history = self.history()
        return {
            "now_unix_ms": int(self._wall() * 1000),
            "hub": {"key": self.hub_key, "uptime_s": round(self._clock() - self._started, 3)},
            "model": self.model(sessions),
            "totals": {
                "sessions": len(sessions),
                "sessions_opened": totals.opened,
                "sessions_closed": sum(totals.closed.values()),
                "bytes_to_worker": totals.bytes_to_worker,
                "bytes_from_worker": totals.bytes_from_worker,
                "work_bytes": desk.work_bytes if desk else 0,
                "work_calls": desk.work_calls if desk else 0,
                "work_rows": desk.work_rows if desk else 0,
                "quarantines": sum(desk.quarantines.values()) if desk else 0,
                "quarantines_by_violation": dict(sorted(desk.quarantines.items())) if desk else {},
                "work_refused": desk.refused if desk else 0,
                "receipts_acked": sender.acked if sender else 0,
                "credited_bytes": sender.credited_bytes if sender else 0,
                "credited_nano_kvr": sender.credited_nano_kvr if sender else 0,
                "credited_kvr": format_kvr(sender.credited_nano_kvr if sender else 0),
                # Dropped for good by the ledger; refusals that left a receipt pending (each resend
                # counts again); receipt passes that could not reach the ledger. (How many receipts
                # are pending now is the contribution store's, not in the loop's counters.)
                "receipts_rejected": sender.rejected if sender else 0,
                "receipts_refused": sender.refused if sender else 0,
                "ledger_errors": sender.ledger_errors if sender else 0,
                "receipts_loop": sender is not None,
                "sessions_closed_by": dict(sorted(totals.closed.items())),
                "rows_per_s": history[-1]["rows_per_s"] if history else 0.0,
                "bytes_per_s": history[-1]["bytes_per_s"] if history else 0.0,
            },
            "sessions": [self._session(s) for s in sessions],
            "quarantines": self.quarantines(desk),
            "links": self.links(sender),
            "expert_map": self.expert_map(sessions, generation),
            "demand": self.demand(),
            "backbones": self.backbones(),
            "history": {"interval_s": SAMPLE_S, "points": history},
        }
