"""Links from the backbone to the swarm: the hub's live session list (WatchSessions) and one
Dispatch stream per worker session, with per-call bookkeeping in one place (``Link``: the
transport underneath is the subclass's; ``backbone/experts/_ceiling.py`` has one without a
wire)."""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol, TypeAlias

import grpc
import torch

from backbone.experts._deadlines import RttEstimator, StragglerPolicy
from kvasir_rpc import (
    TARGET_KEY_METADATA,
    bearer,
    expert_pb2,
    get_logger,
    serialize_dispatch_request,
    session_pb2,
    session_pb2_grpc,
    slices_from_proto,
    target_key,
)

__all__ = ["Answer", "CallRecord", "ComputedPartials", "DispatchCall", "Link", "SessionSource", "SessionWatcher",
           "WorkerLink"]

log = get_logger("backbone.links")

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.max_send_message_length", 256 << 20),
    # The tunnel carries one connection per session: never open a second one.
    ("grpc.use_local_subchannel_pool", 1),
]


@dataclasses.dataclass(frozen=True)
class DispatchCall:
    """One call's inputs as the Dispatcher built them, before any wire: what a worker is asked
    to compute. Assignment ``i`` of segment order is row ``row_index[i]`` of ``rows`` (row
    ``i`` when ``row_index`` is empty: no row was routed twice)."""

    layer: int
    rows: torch.Tensor  # [distinct, H] in the wire dtype
    weights: torch.Tensor  # [assignments] routing weights
    segments: list[tuple[int, int]]  # (expert, rows), in order
    row_index: list[int] | tuple[()]
    projections: bool  # the answer carries the projections (row checks)


@dataclasses.dataclass(frozen=True)
class ComputedPartials:
    """An answer computed in this process (an emulated worker's, ``_ceiling.py``): the partials
    [assignments, H] and, when the call asked for them, the projections [assignments, 2I],
    both in the wire dtype, as tensors: nothing was serialized."""

    partials: torch.Tensor
    projections: torch.Tensor | None


# What a call's future resolves to: a worker's message, or partials computed in this process.
Answer: TypeAlias = expert_pb2.ExpertPartials | ComputedPartials


@dataclasses.dataclass
class CallRecord:
    """One remote call: which worker, which layer and rows, when it left, until when it is
    awaited and when its answer came (``time.perf_counter_ns``)."""

    call_id: int
    session_id: str
    layer: int
    rows: int
    sent_ns: int
    future: Future[Answer]
    # The serialized request as sent, call_id included: what the worker is paid for if the
    # answer is accepted.
    request_bytes: int = 0
    deadline_ns: int = 0  # past it the call is late: computed here, its answer dropped
    answered_ns: int = 0  # 0 until the answer arrives


def _as_sent(request: bytes) -> bytes:
    return request


class Link:
    """The backbone's side of one worker session, whatever carries its calls: the calls in
    flight, their deadlines and round trips, the misses, and the error that ended it.

    ``submit`` registers a call and hands it to the transport (``_transmit``, the subclass's)
    and returns at once; the transport calls ``answered`` when an answer arrives, which
    resolves the call's future, and ``fail`` when it breaks: every pending call fails with the
    error and the link is dead for good (the caller recomputes and stops routing here).

    The link measures the round trip of every call answered in time (``RttEstimator``) and gives
    each call its deadline from it; ``misses`` counts late calls since the last one
    answered in time.
    """

    def __init__(self, session: session_pb2.Session) -> None:
        self.session_id = session.session_id
        self.wallet = session.wallet
        self.slices = slices_from_proto(session.slices)
        # Whether every answer row is checked before it is used (the worker returns what the
        # row checks need); otherwise only sampled audits stand behind its answers.
        self.row_checked = session.projections
        # Rows of this session's work earlier backbone runs accepted (the hub keeps the count):
        # it has earned its audits down for them (AuditRates).
        self.prior_rows = int(session.work_rows)
        self._pending: dict[int, CallRecord] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.dead: BaseException | None = None
        self._rtt = RttEstimator()
        self.misses = 0

    def submit(self, assignments: int, call: DispatchCall, policy: StragglerPolicy) -> CallRecord:
        """Send ``call`` (``assignments`` rows) with its deadline from ``policy`` and this
        link's round trips; the record's future resolves to the answer or an exception."""
        fut: Future[Answer] = Future()
        with self._lock:
            call_id = next(self._ids)
            sent_ns = time.perf_counter_ns()
            rec = CallRecord(call_id, self.session_id, call.layer, assignments, sent_ns, fut,
                             deadline_ns=sent_ns + int(self._rtt.deadline_s(policy, assignments) * 1e9))
            if self.dead is not None:
                fut.set_exception(self.dead)
                return rec
            self._pending[call_id] = rec
        self._transmit(rec, call)
        return rec

    def _transmit(self, rec: CallRecord, call: DispatchCall) -> None:
        """Carry ``call`` to the worker (setting ``rec.request_bytes`` to what was sent)."""
        raise NotImplementedError

    def answered(self, call_id: int, answer: Answer) -> None:
        """The answer to call ``call_id`` arrived: resolve its future (an answer to no call
        pending, one already failed, is dropped)."""
        now = time.perf_counter_ns()
        with self._lock:
            rec = self._pending.pop(call_id, None)
            if rec is not None:
                rec.answered_ns = now
                # Measured where it arrives, not where the decode gets to it. A late
                # answer is not: a stall must not teach the link to be waited on longer.
                if now <= rec.deadline_ns:
                    self._rtt.observe((now - rec.sent_ns) / 1e9, rec.rows)
        if rec is not None:
            rec.future.set_result(answer)

    def note_miss(self) -> int:
        """A call of this link was late; the late calls in a row so far."""
        with self._lock:
            self.misses += 1
            return self.misses

    def note_on_time(self) -> None:
        """A call of this link was answered in time."""
        with self._lock:
            self.misses = 0

    def round_trip(self) -> tuple[float | None, float]:
        """``(srtt, rttvar)`` in seconds; srtt None before the first answer."""
        with self._lock:
            return self._rtt.srtt, self._rtt.rttvar

    def fail(self, error: BaseException) -> None:
        """Mark the link dead for good (first error wins) and fail every pending call with it."""
        with self._lock:
            if self.dead is None:
                self.dead = error
            pending, self._pending = self._pending, {}
        for rec in pending.values():
            if not rec.future.done():
                rec.future.set_exception(error)

    def close(self) -> None:
        """Release the transport."""
        raise NotImplementedError


class WorkerLink(Link):
    """A long-lived ``Dispatch`` stream to one worker session through the hub: each call
    serialized (``serialize_dispatch_request``) and queued on the stream, a reader thread
    handing each answer to ``answered``. When the stream fails the link fails with the
    stream's RpcError.

    ``token`` is the backbone token shared with the hub: the stream presents the session's
    target key (``kvasir_rpc.target_key``), without which the hub does not splice it.
    """

    _SENTINEL = object()

    def __init__(self, session: session_pb2.Session, *, token: str) -> None:
        super().__init__(session)
        self.target = session.target
        self._channel = grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        # Dispatch with requests serialized here (serialize_dispatch_request): their bytes go
        # out as they are.
        self._dispatch = self._channel.stream_stream(
            "/kvasir.v1.ExpertService/Dispatch", request_serializer=_as_sent,
            response_deserializer=expert_pb2.DispatchResponse.FromString)
        self._requests: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._responses = self._dispatch(
            self._iter_requests(), metadata=((TARGET_KEY_METADATA, target_key(token, self.session_id)),))
        self._reader = threading.Thread(target=self._read, name=f"link-{self.session_id}", daemon=True)
        self._reader.start()

    def _iter_requests(self):  # type: ignore[no-untyped-def]
        while True:
            item = self._requests.get()
            if item is self._SENTINEL:
                return
            yield item

    def _transmit(self, rec: CallRecord, call: DispatchCall) -> None:
        request = serialize_dispatch_request(rec.call_id, call.layer, call.rows, call.weights, call.segments,
                                             call.row_index, call.projections)
        rec.request_bytes = len(request)
        self._requests.put(request)

    def _read(self) -> None:
        error: BaseException
        try:
            for resp in self._responses:
                self.answered(resp.partials.call_id, resp.partials)
            error = ConnectionError(f"worker {self.session_id} ended its Dispatch stream")
        except grpc.RpcError as exc:
            error = exc
        self.fail(error)

    def close(self) -> None:
        self._requests.put(self._SENTINEL)
        self._responses.cancel()
        self._channel.close()
        self._reader.join(timeout=5)


class SessionSource(Protocol):
    """Where a ``Placement`` learns the sessions to route to and links to them: the hub's
    (``SessionWatcher``), or emulated workers in this process (``_ceiling.py``)."""

    @property
    def version(self) -> int:
        """Changes whenever the session set does."""
        ...

    def sessions(self) -> dict[str, session_pb2.Session]: ...

    def connect(self, session: session_pb2.Session) -> Link:
        """A link to ``session``."""
        ...


class SessionWatcher:
    """Follows the hub's WatchSessions stream in a thread and keeps the live set.

    ``token``: the backbone token shared with the hub. The watch presents it (the hub keeps
    an allowance of streams for it that strangers cannot take) and links are made with it.

    When the stream ends (the hub restarted or went away), the hub's sessions went with it:
    the live set empties, so the decode computes locally, and the watch is opened again,
    with a bounded backoff, until a hub answers; its snapshot brings the new sessions.

    A hub that refuses the token (UNAUTHENTICATED or PERMISSION_DENIED) is asked again too (it
    may be restarted with the right token file), but ``refusal`` keeps what it said until a
    watch is let in, and ``wait`` returns at once meanwhile: no number of sessions will come,
    and whoever waits for them must say why."""

    #: The hub's answers to a token it does not take: waiting cannot mend them.
    REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)

    RETRY_MIN_S = 0.1
    RETRY_MAX_S = 2.0

    def __init__(self, hub_address: str, *, token: str) -> None:
        self.token = token
        # Reconnect soon after a restarted hub listens again, not after gRPC's 120 s backoff.
        self._channel = grpc.insecure_channel(hub_address, options=[
            ("grpc.initial_reconnect_backoff_ms", int(self.RETRY_MIN_S * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(self.RETRY_MAX_S * 1000)),
        ])
        self._stub = session_pb2_grpc.SessionServiceStub(self._channel)
        self._cond = threading.Condition()
        self._sessions: dict[str, session_pb2.Session] = {}
        self._synced = False
        # The hub's details when it refused the token, until a watch is let in again.
        self._refusal: str | None = None
        self._let_in = False  # whether the hub ever answered a watch
        self._closed = threading.Event()
        self.version = 0
        self.resubscribes = 0
        self._call = self._stub.WatchSessions(session_pb2.WatchSessionsRequest(), metadata=bearer(token))
        self._thread = threading.Thread(target=self._run, name="session-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        backoff = self.RETRY_MIN_S
        while True:
            try:
                for resp in self._call:
                    backoff = self.RETRY_MIN_S
                    ev = resp.event
                    with self._cond:
                        self._refusal = None
                        self._let_in = True
                        if ev.kind == session_pb2.SessionEvent.KIND_ADDED:
                            self._sessions[ev.session.session_id] = ev.session
                        elif ev.kind == session_pb2.SessionEvent.KIND_REMOVED:
                            self._sessions.pop(ev.session.session_id, None)
                        elif ev.kind == session_pb2.SessionEvent.KIND_SYNCED:
                            self._synced = True
                        self.version += 1
                        self._cond.notify_all()
                if not self._closed.is_set():
                    log.warning("session watch ended by the hub; watching again")
            except grpc.RpcError as exc:
                if exc.code() in self.REFUSALS and not self._closed.is_set():
                    with self._cond:
                        if self._refusal is None:  # once per refusal, not once per retry
                            # Before any watch was let in, whoever waits for sessions says it in
                            # its own line; a hub that changes its token later must be heard.
                            (log.warning if self._let_in else log.info)(
                                "the hub refused this backbone's token; asking again", code=exc.code().name,
                                details=exc.details())
                        self._refusal = exc.details() or exc.code().name
                        self._cond.notify_all()
                elif not self._closed.is_set() and self._sessions:
                    log.warning("session watch ended; watching again", code=str(exc.code()), details=exc.details())
            with self._cond:
                if self._sessions:
                    self._sessions = {}
                    self.version += 1
                    self._cond.notify_all()
            if self._closed.wait(backoff):
                return
            backoff = min(backoff * 2, self.RETRY_MAX_S)
            with self._cond:
                if self._closed.is_set():
                    return
                self._call = self._stub.WatchSessions(session_pb2.WatchSessionsRequest(),
                                                      metadata=bearer(self.token))
                self.resubscribes += 1

    def sessions(self) -> dict[str, session_pb2.Session]:
        with self._cond:
            return dict(self._sessions)

    def connect(self, session: session_pb2.Session) -> WorkerLink:
        """A Dispatch stream to ``session`` through the hub, made with this watcher's token."""
        return WorkerLink(session, token=self.token)

    @property
    def refusal(self) -> str | None:
        """What the hub said when it last refused this backbone's token (its details), or None
        when it has not, or has let a watch in since."""
        with self._cond:
            return self._refusal

    def wait(self, predicate: Callable[[dict[str, session_pb2.Session]], bool], timeout: float) -> bool:
        """Wait until the hub has synced and ``predicate(sessions)`` holds, or time out. False
        at once while the hub refuses the token (``refusal`` says what it said)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._refusal is not None or (self._synced and predicate(self._sessions)),
                timeout=timeout) and self._refusal is None

    def close(self) -> None:
        with self._cond:
            self._closed.set()
            self._call.cancel()
        self._channel.close()
        self._thread.join(timeout=5)
