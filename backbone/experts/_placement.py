"""Placement: which worker link serves which (layer, expert).

The hub's session list (followed by a ``SessionWatcher``; any ``SessionSource``, such as the
emulated workers of ``_ceiling.py``) is the single source of who holds what. A session is
routed to only if the digest it announces for its slices is the digest of this model's own
weights for them; a session that announces other weights is rejected,
one caught delivering wrong work is quarantined, and neither is routed to again. The route
table is rebuilt when the session list changes or a link is dropped.

An expert several live sessions hold (the hub's planner makes replicas of the most demanded)
goes, in each layer's call, to the holder with the fewest rows so far in that call (``spread``),
so replicas share the load instead of the first holder taking it all.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import TypeVar

import grpc

from backbone.experts._links import Link, SessionSource
from backbone.experts._weights import ExpertWeights
from kvasir_rpc import Route, announced_mismatch, get_logger, session_pb2, slices_digest

__all__ = ["Placement", "spread"]

log = get_logger("backbone.placement")

H = TypeVar("H")


def spread(routes: Sequence[tuple[int, int]], holders: Mapping[int, Sequence[H]]) -> list[H | None]:
    """Where each route goes: ``routes`` are (expert, rows) in order, ``holders`` each expert's
    live holders in the order they joined. The largest routes are placed first, each with the
    holder that has the fewest rows so far (the earliest joined on a tie, so one holder takes
    all as before); None for an expert no one holds. No route is split: an expert's rows go
    to one worker per call."""
    load: dict[int, int] = {}  # rows so far, by id() of the holder
    chosen: list[H | None] = [None] * len(routes)
    for i in sorted(range(len(routes)), key=lambda i: -routes[i][1]):
        expert, rows = routes[i]
        options = holders.get(expert, ())
        if not options:
            continue
        best = min(options, key=lambda h: load.get(id(h), 0))  # min keeps the first of equals
        load[id(best)] = load.get(id(best), 0) + rows
        chosen[i] = best
    return chosen


class Placement:
    """Routes (layer, expert) to live worker links; thread-safe."""

    def __init__(self, watcher: SessionSource, weights: ExpertWeights) -> None:
        self.watcher = watcher
        self._weights = weights
        self._digests: dict[tuple[int, int], bytes] = {}
        self._links: dict[str, Link] = {}
        self._rejected: set[str] = set()
        # Replaced, never mutated: decode threads read it without the lock.
        self.quarantined: frozenset[str] = frozenset()
        self._seen_version = -1
        self._routes: dict[int, dict[int, list[Link]]] = {}  # layer -> expert -> holders
        self._lock = threading.Lock()
        # Sessions whose worker turned this backbone away because it served its maximum of
        # backbones (RESOURCE_EXHAUSTED from the hub): linked again after a backoff, not never.
        self._busy_until: dict[str, tuple[float, float]] = {}  # sid -> (retry at, backoff s)
        self.busy_refusals = 0
        # Rows the router sent each expert this run, {layer: [rows by expert]}: reported to the
        # hub with the work (what it plans --experts auto workers' slices by).
        self._demand: dict[int, list[int]] = {}
        self._retry_at = float("inf")  # rebuild then even if the session list did not change

    def split(self, layer: int, routes: list[Route]) -> tuple[dict[Link, list[Route]], list[Route]]:
        """``(placed, local)``: the routes a live link serves, by link, and the rest."""
        with self._lock:
            self._refresh()
            table = self._routes.get(layer, {})
            counts = self._demand.get(layer)
            if counts is None:
                counts = self._demand.setdefault(layer, [0] * (self._weights.num_experts(layer) or 0))
            for r in routes:
                if r.expert < len(counts):
                    counts[r.expert] += len(r.token_idx)
        placed: dict[Link, list[Route]] = {}
        local: list[Route] = []
        live: dict[int, list[Link]] = {}
        died = False
        for r in routes:
            holders = table.get(r.expert, [])
            live[r.expert] = [link for link in holders if link.dead is None]
            died |= len(live[r.expert]) < len(holders)
        for r, link in zip(routes, spread([(r.expert, len(r.token_idx)) for r in routes], live)):
            if link is not None:
                placed.setdefault(link, []).append(r)
            else:
                local.append(r)
        if died:  # a link died since the routes were built: rebuild them (and see why) next time
            with self._lock:
                self._seen_version = -1
        return placed, local

    BUSY_RETRY_MIN_S = 2.0
    BUSY_RETRY_MAX_S = 30.0

    def drop(self, link: Link, error: BaseException) -> None:
        """A call on ``link`` was lost: the link is dead and routes are rebuilt without it. A
        worker that turned this backbone away because it serves its maximum of backbones (the
        hub's RESOURCE_EXHAUSTED) is said so in the log, counted, and linked again after a
        backoff (2 s, doubling to 30 s): its experts are computed here meanwhile."""
        link.fail(error)
        with self._lock:
            self._seen_version = -1
            self._if_busy(link)

    @staticmethod
    def _busy_error(link: Link) -> bool:
        error = link.dead
        return isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    def _if_busy(self, link: Link) -> None:
        """When ``link`` died of its worker being busy with other backbones: log it, count it,
        unlink it and set when to link again (lock held). A link can die so before any call is
        routed to it (its stream is refused at once), so the route rebuild checks too."""
        if not self._busy_error(link) or self._links.get(link.session_id) is not link:
            return
        del self._links[link.session_id]
        self.busy_refusals += 1
        _, last = self._busy_until.get(link.session_id, (0.0, 0.0))
        backoff = min(max(last * 2, self.BUSY_RETRY_MIN_S), self.BUSY_RETRY_MAX_S)
        self._busy_until[link.session_id] = (time.monotonic() + backoff, backoff)
        self._retry_at = min(self._retry_at, time.monotonic() + backoff)
        detail = str(link.dead.details())[:200]  # type: ignore[union-attr]
        log.warning("worker busy with other backbones; computing its experts here, trying it again later",
                    session_id=link.session_id, retry_in_s=backoff, detail=detail)
        threading.Thread(target=link.close, name=f"close-{link.session_id}", daemon=True).start()

    def demand(self) -> dict[int, list[int]]:
        """Rows routed to each expert so far in this run (remote or computed here), by layer."""
        with self._lock:
            return {layer: list(rows) for layer, rows in self._demand.items()}

    def quarantine(self, link: Link) -> bool:
        """Never route to ``link``'s session again; True the first time it is quarantined."""
        sid = link.session_id
        with self._lock:
            first = sid not in self.quarantined
            self.quarantined = self.quarantined | {sid}
            self._seen_version = -1
            dropped = self._links.pop(sid, None)
        link.fail(RuntimeError(f"session {sid} quarantined"))
        if first and dropped is not None:
            # Closing waits on the link's reader thread; the decode does not.
            threading.Thread(target=dropped.close, name=f"close-{sid}", daemon=True).start()
        return first

    def coverage(self) -> tuple[dict[int, set[int]], int]:
        """``({layer: experts a live link serves}, live links)`` as routing sees them now."""
        with self._lock:
            self._refresh()
            live = [link for link in self._links.values() if link.dead is None]
            return {layer: set(table) for layer, table in self._routes.items()}, len(live)

    def rejected(self) -> tuple[str, ...]:
        """Sessions whose announced weights are not this model's, sorted."""
        with self._lock:
            return tuple(sorted(self._rejected))

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()

    def _expected_digest(self, slices: dict[int, tuple[int, ...]]) -> bytes | None:
        """The digest a session holding ``slices`` of this model announces; None when the
        model has no such slices."""
        digests = {}
        for layer, experts in slices.items():
            num_experts = self._weights.num_experts(layer)
            if num_experts is None:
                return None
            for e in experts:
                if e >= num_experts:
                    return None
                key = (layer, e)
                if key not in self._digests:
                    self._digests[key] = self._weights.digest(layer, e)
                digests[key] = self._digests[key]
        return slices_digest(digests)

    def _other_function(self, s: session_pb2.Session) -> str:
        """Why the session's announced expert function is not this model's in one of its
        layers ("" when it is)."""
        functions = self._weights.functions
        announced = s.expert_function if s.HasField("expert_function") else None
        for sl in s.slices:
            mine = functions.get(sl.layer)
            why = announced_mismatch(announced, mine) if mine is not None else ""
            if why:
                return f"layer {sl.layer}: {why}"
        return ""

    def _refresh(self) -> None:
        """Rebuild the route table when the hub's session set changed (lock held)."""
        if self.watcher.version == self._seen_version and time.monotonic() < self._retry_at:
            return
        self._seen_version = self.watcher.version
        live = self.watcher.sessions()
        for link in list(self._links.values()):
            self._if_busy(link)
        for sid in list(self._links):
            if sid not in live:
                self._links.pop(sid).close()
        now = time.monotonic()
        self._retry_at = float("inf")
        for sid, s in sorted(live.items(), key=lambda kv: (kv[1].connected_since_unix_ms, kv[0])):
            if sid in self._links or sid in self._rejected or sid in self.quarantined:
                continue
            retry_at = self._busy_until.get(sid, (0.0, 0.0))[0]
            if retry_at > now:  # a busy worker: look again when its retry is due
                self._retry_at = min(self._retry_at, retry_at)
                continue
            expected = self._expected_digest({sl.layer: tuple(sl.experts) for sl in s.slices})
            if expected is None or expected != s.weights_digest:
                log.warning("session weights do not match this model; not routing to it", session_id=sid,
                            wallet=s.wallet)
                self._rejected.add(sid)
                continue
            why = self._other_function(s)
            if why:
                log.warning("session computes another expert function than this model's; not routing to it",
                            session_id=sid, wallet=s.wallet, detail=why)
                self._rejected.add(sid)
                continue
            self._links[sid] = self.watcher.connect(s)
        routes: dict[int, dict[int, list[Link]]] = {}
        for link in list(self._links.values()):
            if link.dead is not None:  # one refused as it was made (a busy worker) is seen here
                self._if_busy(link)
                continue
            for layer, experts in link.slices.items():
                for e in experts:
                    routes.setdefault(layer, {}).setdefault(e, []).append(link)
        self._routes = routes
