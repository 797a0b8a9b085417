"""What serving ExpertService takes whatever computes the experts (torch: ``_service``; numpy:
``_numpy``), without torch: the held slices and their shares among sessions, the turns the
backbones take, the Dispatch stream and its draining, the gRPC server."""

from __future__ import annotations

import abc
import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any, Generic, TypeVar

import grpc

from kvasir_rpc import (
    NO_PORT_SHARING,
    DispatchInputError,
    NeverUnknown,
    TensorCodecError,
    bind_grpc,
    enable_reflection,
    expert_pb2,
    expert_pb2_grpc,
    segment_order,
    slices_digest,
)

__all__ = ["DEFAULT_DEQUANTIZED_CACHE_BYTES", "MAX_ROWS_PER_CALL", "HeldSlices", "LoadProgress", "ServicerBase",
           "Turns", "add_to_server", "serve_experts"]

MAX_ROWS_PER_CALL = 1 << 16

# The default bound of a worker's cache of dequantized experts (--dequantized-cache-mb).
DEFAULT_DEQUANTIZED_CACHE_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class LoadProgress:
    """How far loading the experts is: experts and bytes read so far, of the totals. The total
    bytes are the config's (gate, up and down of ``intermediate × hidden`` each), known
    before the first read; the done bytes are those of the tensors actually read."""

    experts_done: int
    experts_total: int
    bytes_done: int
    bytes_total: int


class HeldSlices:
    """The (layer, expert) pairs a worker holds (``weights``' keys), their digest and each
    one's, as sessions announce them."""

    weights: Mapping[tuple[int, int], Any]
    weights_digest: bytes
    expert_digests: Mapping[tuple[int, int], bytes]

    @property
    def slices(self) -> dict[int, tuple[int, ...]]:
        return _slices_of(sorted(self.weights))

    def shares(self, n: int) -> list[tuple[dict[int, tuple[int, ...]], bytes]]:
        """The held (layer, expert) pairs, in order, split into ``n`` contiguous shares as
        equal as possible: ``(slices, weights digest)`` per share, for ``n`` sessions that
        each announce one share (so every pair is announced once and every session is routed
        work). Raises ValueError when ``n`` is not from 1 to the number of pairs held, or
        when the per-expert digests are unknown."""
        keys = sorted(self.weights)
        if not 1 <= n <= len(keys):
            raise ValueError(f"{n} sessions for {len(keys)} held experts: each session needs at least one")
        if n == 1:
            return [(self.slices, self.weights_digest)]
        if set(self.expert_digests) != set(keys):
            raise ValueError("per-expert digests are needed to split the slices among sessions")
        out = []
        for i in range(n):
            part = keys[i * len(keys) // n : (i + 1) * len(keys) // n]
            out.append((_slices_of(part), slices_digest({k: self.expert_digests[k] for k in part})))
        return out


def _slices_of(pairs: Sequence[tuple[int, int]]) -> dict[int, tuple[int, ...]]:
    """Sorted (layer, expert) pairs as {layer: experts}."""
    out: dict[int, list[int]] = {}
    for layer, expert in pairs:
        out.setdefault(layer, []).append(expert)
    return {k: tuple(v) for k, v in out.items()}


def _serialize_answer(answer: bytes | expert_pb2.DispatchResponse) -> bytes:
    return answer if isinstance(answer, bytes) else answer.SerializeToString()


def add_to_server(servicer: ServicerBase[Any], server: grpc.Server) -> None:
    """Register ``servicer`` as ``kvasir.v1.ExpertService`` on ``server``: the generated
    ``add_ExpertServiceServicer_to_server`` but for Dispatch's answers, which the servicer
    yields already serialized (``serialize_dispatch_response``) and pass through as they are."""
    handlers = {
        "Dispatch": grpc.stream_stream_rpc_method_handler(
            servicer.Dispatch, request_deserializer=expert_pb2.DispatchRequest.FromString,
            response_serializer=_serialize_answer),
        "Describe": grpc.unary_unary_rpc_method_handler(
            servicer.Describe, request_deserializer=expert_pb2.DescribeRequest.FromString,
            response_serializer=expert_pb2.DescribeResponse.SerializeToString),
    }
    name = expert_pb2.DESCRIPTOR.services_by_name["ExpertService"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


def serve_experts(servicer: ServicerBase[Any], addresses: Sequence[str], *, sessions: int) -> grpc.Server:
    """The started gRPC server of ``servicer`` (ExpertService and reflection) on each of
    ``addresses`` ("unix:PATH", "HOST:PORT"), with a thread for each of ``sessions`` Dispatch
    streams; what a handler lets out is answered by NeverUnknown (never UNKNOWN). Raises
    ListenError naming an address that cannot be bound."""
    server = grpc.server(
        # Carry --threads into the pool's threads (see threads_initializer). A backbone keeps
        # one Dispatch stream open per session, and each holds a thread for its life.
        futures.ThreadPoolExecutor(max_workers=7 + sessions, thread_name_prefix="expert",
                                   initializer=servicer.thread_initializer()),
        interceptors=[NeverUnknown()],
        options=[("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20),
                 NO_PORT_SHARING],
    )
    add_to_server(servicer, server)
    # Reflection reaches only those who reach the server: the key holder through the hub's target.
    enable_reflection(server, [expert_pb2.DESCRIPTOR.services_by_name["ExpertService"].full_name])
    for address in addresses:
        bind_grpc(server, address)
    server.start()
    return server


class Turns:
    """The experts compute one call at a time; the Dispatch streams waiting (one per backbone
    connection: each backbone its own) take turns in rotation. A stream's calls are computed
    one after another, so it has at most one call waiting, and a queue of the waiting streams,
    first come first served, gives every backbone a call for each call of any other: a fair
    share, whatever one of them sends. One stream alone never waits."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._waiting: collections.deque[object] = collections.deque()
        self.turns = 0
        self.waited = 0  # turns that had to wait for another stream's

    def take(self, stream: object) -> None:
        """Wait for ``stream``'s turn; ``give_back`` when its call is computed."""
        with self._cond:
            self._waiting.append(stream)
            if self._busy or self._waiting[0] is not stream:
                self.waited += 1
                self._cond.wait_for(lambda: not self._busy and self._waiting[0] is stream)
            self._waiting.popleft()
            self._busy = True
            self.turns += 1

    def give_back(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()




C = TypeVar("C")  # what a servicer's _compute gives its _serialize: a call's partials and projections


class ServicerBase(expert_pb2_grpc.ExpertServiceServicer, Generic[C], abc.ABC):
    """Serves ``Dispatch`` (a stream of batched calls, each answer yielded as its serialized
    DispatchResponse: register it with ``add_to_server``) and ``Describe``; a subclass says how
    a call is computed (``_compute``), serialized (``_serialize``) and described (``Describe``).

    Bad input aborts the stream with INVALID_ARGUMENT (malformed) or FAILED_PRECONDITION (an
    expert this worker does not hold); the caller recomputes what it had in flight.
    ``drain()`` lets calls being computed finish, then refuses new ones with UNAVAILABLE.
    """

    def __init__(self, experts: HeldSlices, wallet: str, *, echo: bool = False) -> None:
        self.experts = experts
        self.wallet = wallet
        # Benchmarks only (--echo-experts): answer with the input rows, uncomputed (wrong).
        self.echo = echo
        self._lock = threading.Lock()
        self._computing = 0
        self._idle = threading.Condition(self._lock)
        self._draining = threading.Event()
        self.calls = 0
        self.rows = 0
        # The layer of the last call computed and its experts in the order computed (_order).
        self._last: tuple[int, list[int]] = (-1, [])
        # Backbones served at once take turns at the experts (a multiplexed tunnel).
        self.turns = Turns()

    @abc.abstractmethod
    def _compute(self, req: expert_pb2.DispatchRequest) -> C:
        """The call's partials and projections. Raises DispatchInputError, TensorCodecError."""

    @abc.abstractmethod
    def _serialize(self, req: expert_pb2.DispatchRequest, computed: C, micros: int) -> bytes:
        """The serialized DispatchResponse of ``computed``, the projections only when asked for."""

    def thread_initializer(self) -> Callable[[], None] | None:
        """What each of the gRPC server's threads runs first (None: nothing)."""
        return None

    def _order(self, layer: int, experts: list[int]) -> list[int]:
        """The order to compute a call's segments in: ``kvasir_rpc.segment_order``."""
        return segment_order(self._last, layer, experts)

    def drain(self, timeout: float) -> bool:
        """Stop taking calls; wait until none is being computed. True if drained in time."""
        self._draining.set()
        with self._idle:
            return self._idle.wait_for(lambda: self._computing == 0, timeout=timeout)

    def Dispatch(self, request_iterator, context):  # type: ignore[no-untyped-def]
        stream = object()  # this stream's place in the turns
        for req in request_iterator:
            with self._lock:
                if self._draining.is_set():
                    context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining for shutdown; send elsewhere")
                self._computing += 1
            try:
                self.turns.take(stream)
                try:
                    t0 = time.perf_counter_ns()
                    computed = self._compute(req)
                finally:
                    self.turns.give_back()
                micros = (time.perf_counter_ns() - t0) // 1000
                # Serialized here, its payload copied once (see add_to_server).
                answer = self._serialize(req, computed, micros)
            except DispatchInputError as exc:
                code = grpc.StatusCode.FAILED_PRECONDITION if exc.precondition else grpc.StatusCode.INVALID_ARGUMENT
                context.abort(code, f"call {req.call_id}: {exc}")
            except TensorCodecError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"call {req.call_id}: {exc}")
            finally:
                with self._idle:
                    self._computing -= 1
                    self._idle.notify_all()
            yield answer
