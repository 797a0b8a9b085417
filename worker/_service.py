"""ExpertService: the worker's pure function (rows, expert ids, weights) -> partials."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent import futures

import grpc
import torch

from kvasir_rpc import (
    NO_PORT_SHARING,
    DispatchInputError,
    ExpertFunction,
    NeverUnknown,
    QuantizedWeights,
    TensorCodecError,
    bind_grpc,
    decode_tensor,
    enable_reflection,
    expert_forward_projections,
    expert_pb2,
    expert_pb2_grpc,
    get_logger,
    segment_order,
    serialize_dispatch_response,
    slices_digest,
    slices_to_proto,
    threads_initializer,
    validate_dispatch,
)

__all__ = ["ExpertServicer", "LoadedExperts", "add_to_server", "serve_experts"]

log = get_logger("worker.service")

MAX_ROWS_PER_CALL = 1 << 16


# The default bound of a worker's cache of dequantized experts (--dequantized-cache-mb).
DEFAULT_DEQUANTIZED_CACHE_BYTES = 256 << 20


class LoadedExperts:
    """The expert weights this worker serves, on its compute device."""

    def __init__(
        self,
        weights: Mapping[tuple[int, int], tuple[torch.Tensor, torch.Tensor] | QuantizedWeights],
        *,
        function: ExpertFunction,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        model_type: str,
        weights_digest: bytes,
        expert_digests: Mapping[tuple[int, int], bytes] | None = None,
        biases: Mapping[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
        dequantized_cache_bytes: int = DEFAULT_DEQUANTIZED_CACHE_BYTES,
    ) -> None:
        self.weights = dict(weights)
        # Quantized experts' weights as computed with, the most recently used first kept, up to
        # this many bytes: dequantizing costs tens of times an expert's forward at small batches
        # (an FP8 expert 8.7 ms against 0.34 ms for one row at Qwen3-30B-A3B's widths), so hot experts stay ready.
        self.dequantized_cache_bytes = dequantized_cache_bytes
        self._dequantized: collections.OrderedDict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = \
            collections.OrderedDict()
        self._dequantized_bytes = 0
        self._cache_lock = threading.Lock()
        # Per (layer, expert), where the function has biases: (gate_up_bias, down_bias).
        self.biases = dict(biases or {})
        # Per (layer, expert): what a session announcing only some of the slices digests.
        self.expert_digests = dict(expert_digests or {})
        self.function = function  # what each expert computes (announced in the hello)
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.model_type = model_type
        self.weights_digest = weights_digest

    def matrices(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up, down)`` to compute with: as held, or dequantized (from the cache when there)."""
        held = self.weights[(layer, expert)]
        if not isinstance(held, QuantizedWeights):
            return held
        key = (layer, expert)
        with self._cache_lock:
            ready = self._dequantized.get(key)
            if ready is not None:
                self._dequantized.move_to_end(key)
                return ready
        ready = held.dequantize()  # outside the lock: calls of other experts go on meanwhile
        size = sum(t.numel() * t.element_size() for t in ready)
        with self._cache_lock:
            if size <= self.dequantized_cache_bytes and key not in self._dequantized:
                self._dequantized[key] = ready
                self._dequantized_bytes += size
                while self._dequantized_bytes > self.dequantized_cache_bytes:
                    _, old = self._dequantized.popitem(last=False)
                    self._dequantized_bytes -= sum(t.numel() * t.element_size() for t in old)
        return ready

    @property
    def dequantized_bytes(self) -> int:
        """Bytes of dequantized weights the cache holds now."""
        with self._cache_lock:
            return self._dequantized_bytes

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


def add_to_server(servicer: ExpertServicer, server: grpc.Server) -> None:
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


def serve_experts(servicer: ExpertServicer, addresses: Sequence[str], *, sessions: int) -> grpc.Server:
    """The started gRPC server of ``servicer`` (ExpertService and reflection) on each of
    ``addresses`` ("unix:PATH", "HOST:PORT"), with a thread for each of ``sessions`` Dispatch
    streams; what a handler lets out is answered by NeverUnknown (never UNKNOWN). Raises
    ListenError naming an address that cannot be bound."""
    server = grpc.server(
        # Carry --threads into the pool's threads (see threads_initializer). A backbone keeps
        # one Dispatch stream open per session, and each holds a thread for its life.
        futures.ThreadPoolExecutor(max_workers=7 + sessions, thread_name_prefix="expert",
                                   initializer=threads_initializer()),
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


class ExpertServicer(expert_pb2_grpc.ExpertServiceServicer):
    """Serves ``Dispatch`` (a stream of batched calls, each answer yielded as its serialized
    DispatchResponse: register it with ``add_to_server``) and ``Describe``.

    Bad input aborts the stream with INVALID_ARGUMENT (malformed) or FAILED_PRECONDITION (an
    expert this worker does not hold); the caller recomputes what it had in flight.
    ``drain()`` lets calls being computed finish, then refuses new ones with UNAVAILABLE.
    """

    def __init__(self, experts: LoadedExperts, wallet: str, *, echo: bool = False) -> None:
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

    def _order(self, layer: int, experts: list[int]) -> list[int]:
        """The order to compute a call's segments in: ``kvasir_rpc.segment_order``."""
        return segment_order(self._last, layer, experts)

    def drain(self, timeout: float) -> bool:
        """Stop taking calls; wait until none is being computed. True if drained in time."""
        self._draining.set()
        with self._idle:
            return self._idle.wait_for(lambda: self._computing == 0, timeout=timeout)

    def Describe(self, request, context):  # type: ignore[no-untyped-def]
        from kvasir_rpc import DTYPE_TO_WIRE

        e = self.experts
        return expert_pb2.DescribeResponse(
            wallet=self.wallet,
            slices=slices_to_proto(e.slices),
            weights_digest=e.weights_digest,
            device=str(e.device),
            model_type=e.model_type,
            hidden_size=e.hidden_size,
            dtype=DTYPE_TO_WIRE[e.dtype],
        )

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
                    partials, projections = self._compute(req)
                finally:
                    self.turns.give_back()
                micros = (time.perf_counter_ns() - t0) // 1000
                # Serialized here, its payload copied once (see add_to_server).
                answer = serialize_dispatch_response(req.call_id, partials, micros,
                                                     projections if req.projections else None)
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

    def _compute(self, req: expert_pb2.DispatchRequest) -> tuple[torch.Tensor, torch.Tensor]:
        """The call's partials, [rows, hidden_size], and their projections, [rows, 2 x
        intermediate] (what the caller's row checks need), both in the dtype the hidden rows
        came in."""
        e = self.experts
        hidden = decode_tensor(req.hidden)
        weights = decode_tensor(req.weights)
        segments = [(s.expert, s.rows) for s in req.segments]
        # Deduplicated rows: each distinct row once, one index per assignment.
        index = torch.tensor(req.row_index, dtype=torch.long) if len(req.row_index) else None
        validate_dispatch(
            hidden, weights, segments, hidden_size=e.hidden_size, dtype=e.dtype, max_rows=MAX_ROWS_PER_CALL,
            row_index=index,
        )
        missing = [x for x, _ in segments if (req.layer, x) not in e.weights]
        if missing:
            raise DispatchInputError(
                f"layer {req.layer}: this worker does not hold experts {missing}", precondition=True
            )
        if self.echo:
            # The fabric's cost alone: partials of exactly the expected shape and wire dtype
            # (each assignment's input row, in the wire dtype it came in).
            self.calls += 1
            self.rows += index.numel() if index is not None else hidden.shape[0]
            echoed = hidden if index is None else hidden[index]
            return echoed, echoed[:, :0]
        wire_dtype = hidden.dtype
        # Activations sent narrower than the model are widened here; partials go back narrow.
        hidden = hidden.to(device=e.device, dtype=e.dtype)
        weights = weights.to(e.device)
        starts = []
        start = 0
        for _, rows in segments:
            starts.append(start)
            start += rows
        experts = [x for x, _ in segments]
        order = self._order(req.layer, experts)
        out: list[torch.Tensor] = [hidden] * len(segments)  # each replaced by its segment's partials
        proj: list[torch.Tensor] = [hidden] * len(segments)  # and by its projections
        with torch.inference_mode():
            for i in order:
                (expert, rows), s0 = segments[i], starts[i]
                gate_up, down = e.matrices(req.layer, expert)
                x = hidden[s0 : s0 + rows] if index is None else hidden[index[s0 : s0 + rows]]
                out[i], proj[i] = expert_forward_projections(x, gate_up, down, e.function, weights[s0 : s0 + rows],
                                                             e.biases.get((req.layer, expert)))
            self._last = (req.layer, [experts[i] for i in order])
            if not out:  # a call with no assignments is valid: its partials are [0, hidden_size]
                partials, projections = hidden.new_empty((0, e.hidden_size)), hidden.new_empty((0, 0))
            else:
                partials = torch.cat(out) if len(out) > 1 else out[0]
                projections = (torch.cat(proj) if len(proj) > 1 else proj[0]) if req.projections else proj[0][:0]
            if wire_dtype != partials.dtype:
                partials = partials.to(wire_dtype)
                projections = projections.to(wire_dtype)
        self.calls += 1
        self.rows += start
        return partials, projections
