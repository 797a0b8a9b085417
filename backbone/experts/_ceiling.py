"""The fabric-free ceiling of a decode placement (``generate --ceiling-worker``, benchmarks only).

The backbone's remote path with only the fabric taken out. Kept, as a hub's workers get it:
the Dispatcher (``Placement`` routing each expert to the worker that holds it, one call per
worker per layer with its rows deduplicated, the experts placed here and the shared expert
computed while the calls are in flight, deadlines and hedging, every answer's row checks and
sampled audits) and the decode around it (micro-batch groups, ``--groups auto`` included).
Replaced: the serialization of requests and answers, gRPC, the hub, the gateway, TLS, the
WebSocket tunnel, the latency proxy and the worker processes, by a thread per emulated
worker in this process, handed the call's tensors as they are (``Link._transmit``) and
answering with tensors (``ComputedPartials``).

Each emulated worker holds its own copy of its experts, read from the checkpoint as a worker
reads them (a quantized checkpoint's experts dequantized once, where a worker keeps them
quantized and caches dequantized ones), and computes one call at a time in arrival order,
as a worker's turns do, with the worker's kernel (``expert_forward_projections``) in the order
a worker computes segments, its thread given the backbone's torch thread count (a local
swarm's workers have ``KVASIR_THREADS`` as the backbone has) and pinned to ``cpus`` (Linux;
a benchmark gives it the cores its real workers had). The request checks a worker runs on a
call are left out: the Dispatcher's calls are valid by construction.

The round trip is ``kvasir.latency``'s: each call reaches its worker ``rtt/2`` after it left,
each answer the backbone ``rtt/2`` after it was computed, and calls in flight overlap (the
delay pipelines, it does not take turns).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch

from backbone.experts._links import CallRecord, ComputedPartials, DispatchCall, Link
from kvasir_rpc import (
    ExpertIndex,
    SpecError,
    expert_digest,
    expert_forward_projections,
    get_logger,
    parse_expert_spec,
    segment_order,
    session_pb2,
    slices_digest,
    slices_to_proto,
    threads_initializer,
)

__all__ = ["EmulatedLink", "EmulatedRoundTrip", "EmulatedSwarm", "EmulatedWorker"]

log = get_logger("backbone.ceiling")


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


@dataclasses.dataclass(frozen=True)
class EmulatedRoundTrip:
    """A link of round trip ``rtt_s``, as ``kvasir.latency`` makes one: a message sent at
    ``clock()`` is due ``rtt_s / 2`` later, whatever else is in flight. ``wait_until(t)``
    returns once ``clock()`` has reached ``t`` (both injectable: tests run them fake)."""

    rtt_s: float
    clock: Callable[[], float] = time.monotonic
    wait_until: Callable[[float], None] = _sleep_until

    def __post_init__(self) -> None:
        if not self.rtt_s >= 0:
            raise ValueError(f"a round trip is 0 s or more, got {self.rtt_s}")

    def due(self) -> float:
        """When a message sent now arrives."""
        return self.clock() + self.rtt_s / 2


class EmulatedWorker:
    """A worker holding ``spec``'s experts of the checkpoint ``index``, in this process: a
    compute thread takes its calls in arrival order, and a delivery thread hands each answer
    to its link once due (``trip``). ``session`` is what a hub would list for it. ``close``
    ends both threads (calls still queued are not answered). Raises SpecError when ``spec``
    does not parse or names no expert the checkpoint has."""

    def __init__(self, name: str, index: ExpertIndex, spec: str, trip: EmulatedRoundTrip, *,
                 cpus: frozenset[int] | None = None) -> None:
        self.name = name
        self.trip = trip
        self.cpus = cpus
        info = index.info
        self.function = index.function
        self.dtype = info.dtype
        self._experts: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._biases: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        digests: dict[tuple[int, int], bytes] = {}
        for layer, experts in parse_expert_spec(spec, info.num_layers, info.num_experts).items():
            for e in experts:
                if not index.has(layer, e):
                    continue
                gate_up, down = index.load_quantized(layer, e).dequantize() if index.quantized else index.load(layer, e)
                bias = index.biases(layer, e)
                self._experts[(layer, e)] = (gate_up, down)
                if bias is not None:
                    self._biases[(layer, e)] = bias
                digests[(layer, e)] = expert_digest(gate_up, down, *(bias or ()))
        if not self._experts:
            raise SpecError(f"SPEC {spec!r} names no expert that {index.model_dir} has")
        slices: dict[int, list[int]] = {}
        for layer, e in sorted(self._experts):
            slices.setdefault(layer, []).append(e)
        self.session = session_pb2.Session(
            session_id=name, wallet=name, slices=slices_to_proto(slices), weights_digest=slices_digest(digests),
            device="cpu", model_type=info.model_type, projections=True, expert_function=self.function.to_proto())
        # The layer of the last call computed and its experts in the order computed (_order).
        self._last: tuple[int, list[int]] = (-1, [])
        self._calls: queue.SimpleQueue[tuple[float, int, DispatchCall, Link] | None] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[tuple[float, int, ComputedPartials, Link] | None] = queue.SimpleQueue()
        same_threads = threads_initializer()  # the backbone's torch thread count, as a swarm's workers have

        def start() -> None:
            same_threads()
            if cpus and hasattr(os, "sched_setaffinity"):
                try:
                    os.sched_setaffinity(0, cpus)  # 0: this thread alone (Linux)
                except OSError as exc:  # the figures then hold cores the real workers did not have
                    log.warning("emulated worker not pinned", worker=name, cpus=sorted(cpus), error=str(exc))

        self._threads = [threading.Thread(target=loop, args=(start,), name=f"{name}-{what}", daemon=True)
                         for loop, what in ((self._compute_loop, "compute"), (self._deliver_loop, "deliver"))]
        for t in self._threads:
            t.start()

    def put(self, call_id: int, call: DispatchCall, link: Link) -> None:
        """Send ``call`` to this worker; its answer (or the error computing it) goes to ``link``."""
        self._calls.put((self.trip.due(), call_id, call, link))

    def compute(self, call: DispatchCall) -> ComputedPartials:
        """``call``'s partials [assignments, H] and projections [assignments, 2I] (None when the
        call did not ask for them), in the dtype its rows came in, as a worker computes them."""
        hidden = call.rows.to(self.dtype)  # rows sent narrower than the model are widened, as a worker does
        index = torch.tensor(call.row_index, dtype=torch.long) if len(call.row_index) else None
        starts, start = [], 0
        for _, rows in call.segments:
            starts.append(start)
            start += rows
        experts = [e for e, _ in call.segments]
        out: list[torch.Tensor] = [hidden] * len(call.segments)
        proj: list[torch.Tensor] = [hidden] * len(call.segments)
        order = self._order(call.layer, experts)
        with torch.inference_mode():
            for i in order:
                (expert, rows), s0 = call.segments[i], starts[i]
                gate_up, down = self._experts[(call.layer, expert)]
                x = hidden[s0 : s0 + rows] if index is None else hidden[index[s0 : s0 + rows]]
                out[i], proj[i] = expert_forward_projections(x, gate_up, down, self.function,
                                                             call.weights[s0 : s0 + rows],
                                                             self._biases.get((call.layer, expert)))
            self._last = (call.layer, [experts[i] for i in order])
            if not out:
                return ComputedPartials(hidden.new_empty((0, hidden.shape[1])),
                                        hidden.new_empty((0, 0)) if call.projections else None)
            partials = torch.cat(out) if len(out) > 1 else out[0]
            projections = (torch.cat(proj) if len(proj) > 1 else proj[0]) if call.projections else None
            wire = call.rows.dtype
            if partials.dtype != wire:
                partials = partials.to(wire)
                projections = projections.to(wire) if projections is not None else None
        return ComputedPartials(partials, projections)

    def _order(self, layer: int, experts: list[int]) -> list[int]:
        """The order a worker computes a call's segments in: ``kvasir_rpc.segment_order``."""
        return segment_order(self._last, layer, experts)

    def _compute_loop(self, start: Callable[[], None]) -> None:
        start()
        while (item := self._calls.get()) is not None:
            due, call_id, call, link = item
            self.trip.wait_until(due)
            try:
                answer = self.compute(call)
            except Exception as exc:  # a worker aborts its stream: every call in flight is lost
                link.fail(ConnectionError(f"emulated worker {self.name}: call {call_id}: {exc!r}"))
                continue
            self._answers.put((self.trip.due(), call_id, answer, link))
        self._answers.put(None)

    def _deliver_loop(self, start: Callable[[], None]) -> None:
        start()
        while (item := self._answers.get()) is not None:
            due, call_id, answer, link = item
            self.trip.wait_until(due)
            link.answered(call_id, answer)

    def close(self, timeout: float = 5.0) -> None:
        self._calls.put(None)
        for t in self._threads:
            t.join(timeout=timeout)


class EmulatedLink(Link):
    """The backbone's link to an ``EmulatedWorker``: a ``Link`` whose transport hands the
    call's tensors to the worker's thread; nothing is serialized (``request_bytes`` 0)."""

    def __init__(self, worker: EmulatedWorker) -> None:
        super().__init__(worker.session)
        self.worker = worker

    def _transmit(self, rec: CallRecord, call: DispatchCall) -> None:
        self.worker.put(rec.call_id, call, self)

    def close(self) -> None:
        pass  # the worker is its swarm's, closed with it


class EmulatedSwarm:
    """Emulated workers as a ``SessionSource``: the sessions a hub would list for them (one
    version, they never change) and a link to each. ``close`` ends their threads."""

    version = 1

    def __init__(self, workers: Sequence[EmulatedWorker]) -> None:
        self.workers = {w.name: w for w in workers}

    @classmethod
    def load(cls, model: str | os.PathLike[str], specs: Sequence[str], trip: EmulatedRoundTrip, *,
             cpus: frozenset[int] | None = None) -> EmulatedSwarm:
        """A worker ``ceiling-N`` for each expert SPEC of ``specs`` (as ``worker --experts``
        takes it) on checkpoint ``model``, each behind ``trip``, pinned to ``cpus``. Raises
        SpecError and CheckpointError."""
        index = ExpertIndex(pathlib.Path(model))
        workers: list[EmulatedWorker] = []
        try:
            for i, spec in enumerate(specs, 1):
                workers.append(EmulatedWorker(f"ceiling-{i}", index, spec, trip, cpus=cpus))
        except BaseException:
            for w in workers:
                w.close()
            raise
        return cls(workers)

    def sessions(self) -> dict[str, session_pb2.Session]:
        return {name: w.session for name, w in self.workers.items()}

    def connect(self, session: session_pb2.Session) -> EmulatedLink:
        return EmulatedLink(self.workers[session.session_id])

    def close(self) -> None:
        for w in self.workers.values():
            w.close()
