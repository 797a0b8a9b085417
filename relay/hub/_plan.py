"""Where a new worker is needed (``--experts auto``): the hub's planner, sans I/O.

The backbones report the rows their routers send each expert (``ReportWorkRequest.demand``,
cumulative per run); ``Demand`` turns them into a rate that forgets slowly (a half-life of
``half_life_s``). ``plan_slice`` picks a worker's experts from that and from what the live
sessions and the plans handed out recently already cover: first the experts no one holds
(most demanded first), then the ones with the most demand per holder, until the worker's
capacity is used. Ties go by a per-worker salt, so two workers planned at once on an empty
swarm with no demand yet do not pick the same experts: the second is planned with the first's
plan counted (``Reservations``), so between them they cover the model. Plans count after
live sessions, never as coverage: a stranger's planning hellos (free wallets) cannot steer
workers away from experts no one serves.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import numpy as np

__all__ = ["Demand", "Reservations", "pick_mover", "plan_slice"]


class Demand:
    """Rows routed to each (layer, expert), as a decayed sum (rows, forgetting half of what it
    saw every ``half_life_s``). Thread-safe: the gRPC threads report, the trio thread plans."""

    def __init__(self, half_life_s: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.half_life_s = half_life_s
        self._clock = clock
        self._lock = threading.Lock()
        self._level: dict[tuple[int, int], float] = {}
        self._at = clock()
        # The last cumulative counts of each run, so a report sent twice adds nothing.
        self._runs: dict[str, dict[tuple[int, int], int]] = {}

    def _decay(self) -> None:
        now = self._clock()
        factor = 0.5 ** ((now - self._at) / self.half_life_s) if self.half_life_s > 0 else 0.0
        self._at = now
        if factor < 1.0:
            self._level = {k: v * factor for k, v in self._level.items() if v * factor > 1e-9}

    def report(self, run_id: str, demand: Iterable[tuple[int, list[int]]], *, max_runs: int = 4096) -> None:
        """A run's cumulative rows by (layer, [rows per expert]); only what grew counts."""
        with self._lock:
            self._decay()
            seen = self._runs.setdefault(run_id, {})
            for layer, rows in demand:
                for expert, total in enumerate(rows):
                    key = (int(layer), expert)
                    grew = int(total) - seen.get(key, 0)
                    if grew > 0:
                        seen[key] = int(total)
                        self._level[key] = self._level.get(key, 0.0) + grew
            while len(self._runs) > max_runs:  # the oldest run's counts go; its demand stays
                del self._runs[next(iter(self._runs))]

    def snapshot(self) -> dict[tuple[int, int], float]:
        with self._lock:
            self._decay()
            return dict(self._level)


class Reservations:
    """Plans handed out recently, counted until the worker that got one joins with a session
    (``release``) or ``ttl_s`` passes (it loads for minutes, or never comes back). At most
    ``max_plans`` are kept (the oldest go first), each as arrays of expert ids: a stranger's
    planning hellos, one per fresh wallet, cost the hub bounded memory."""

    def __init__(self, ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic, *,
                 max_plans: int = 256) -> None:
        self.ttl_s = ttl_s
        self.max_plans = max_plans
        self._clock = clock
        self._held: dict[str, tuple[float, dict[int, np.ndarray]]] = {}

    def add(self, wallet: str, slices: Mapping[int, Iterable[int]]) -> None:
        self._held.pop(wallet, None)  # a wallet planned again: its new plan is the newest
        self._held[wallet] = (self._clock() + self.ttl_s,
                              {int(k): np.fromiter(v, dtype=np.uint32) for k, v in slices.items()})
        while len(self._held) > self.max_plans:
            del self._held[next(iter(self._held))]

    def release(self, wallet: str) -> bool:
        """``wallet`` joined: its plan is held by its session now. True if it had one."""
        return self._held.pop(wallet, None) is not None

    def live(self) -> list[dict[int, list[int]]]:
        now = self._clock()
        self._held = {w: h for w, h in self._held.items() if h[0] > now}
        return [{k: v.tolist() for k, v in slices.items()} for _, slices in self._held.values()]


def _replicas(slices_list: Iterable[Mapping[int, Iterable[int]]]) -> dict[tuple[int, int], int]:
    replicas: dict[tuple[int, int], int] = {}
    for slices in slices_list:
        for layer, experts in slices.items():
            for e in experts:
                replicas[(int(layer), int(e))] = replicas.get((int(layer), int(e)), 0) + 1
    return replicas


def plan_slice(candidates: Mapping[int, Iterable[int]], capacity: int, *,
               held: Iterable[Mapping[int, Iterable[int]]], demand: Mapping[tuple[int, int], float],
               salt: str, reserved: Iterable[Mapping[int, Iterable[int]]] = ()) -> dict[int, tuple[int, ...]]:
    """Up to ``capacity`` of the experts in ``candidates`` (what the worker's checkpoint holds,
    from its planning hello) for a new worker: ``{layer: experts}``.

    ``held``: the slices of the live sessions; ``reserved``: the plans handed out recently
    (workers loading). Experts no live session holds come first, the least reserved of them
    first, then by demand (most first); then the covered ones by demand per holder. What live
    sessions hold decides before any plan: a plan is only a worker's word that it will come, so
    strangers' planning hellos cannot make an uncovered expert look covered. Demand unseen (no
    backbone has reported) counts as equal. Ties break by a hash of ``salt`` (the worker's
    wallet) with the expert, so workers with the same view choose apart."""
    replicas = _replicas(held)
    plans = _replicas(reserved)
    seen = sum(demand.values())
    ranked = []
    for layer, experts in candidates.items():
        for e in experts:
            key = (int(layer), int(e))
            want = demand.get(key, 0.0) if seen > 0 else 1.0
            n, r = replicas.get(key, 0), plans.get(key, 0)
            tie = hashlib.sha256(f"{salt}/{key[0]}/{key[1]}".encode()).digest()[:8]
            # Uncovered first (n == 0), then the most demand per holder (loading ones counted);
            # within equals, the tie.
            ranked.append((n > 0, r if n == 0 else 0, -want / (n + r + 1), -want, tie, key))
    ranked.sort()
    chosen: dict[int, list[int]] = {}
    for *_, (layer, e) in ranked[:max(capacity, 0)]:
        chosen.setdefault(layer, []).append(e)
    return {layer: tuple(sorted(es)) for layer, es in sorted(chosen.items())}


def pick_mover(held: Mapping[str, Mapping[int, Iterable[int]]], movable: Iterable[str],
               demand: Mapping[tuple[int, int], float]) -> str | None:
    """The session to ask to plan again, or None: only when the backbones route rows to
    experts no session holds, one of ``movable`` (sessions that took the hub's plan) whose
    every expert some other session holds too, so that moving it uncovers nothing; of those,
    the one whose experts carry the least demand."""
    replicas = _replicas(held.values())
    if not any(v > 0 and replicas.get(key, 0) == 0 for key, v in demand.items()):
        return None
    best: tuple[float, str] | None = None
    for sid in sorted(movable):
        mine = held.get(sid)
        if not mine:
            continue
        keys = [(int(layer), int(e)) for layer, experts in mine.items() for e in experts]
        if all(replicas.get(k, 0) >= 2 for k in keys):
            load = sum(demand.get(k, 0.0) for k in keys)
            if best is None or load < best[0]:
                best = (load, sid)
    return None if best is None else best[1]
