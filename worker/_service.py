"""ExpertService: the worker's pure function (rows, expert ids, weights) -> partials, computed
with torch (``worker._numpy`` computes it without)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Mapping

import torch

from kvasir_rpc import (
    DispatchInputError,
    ExpertFunction,
    QuantizedWeights,
    decode_tensor,
    expert_forward_projections,
    expert_pb2,
    get_logger,
    segment_starts,
    serialize_dispatch_response,
    slices_to_proto,
    threads_initializer,
    validate_dispatch,
)
# Re-exported: what serving takes whatever computes, here before it had a module of its own.
from worker._serving import (
    DEFAULT_DEQUANTIZED_CACHE_BYTES,
    MAX_ROWS_PER_CALL,
    HeldSlices,
    ServicerBase,
    Turns,
    add_to_server,
    serve_experts,
)

__all__ = ["DEFAULT_DEQUANTIZED_CACHE_BYTES", "MAX_ROWS_PER_CALL", "ExpertServicer", "LoadedExperts", "Turns",
           "add_to_server", "serve_experts"]

log = get_logger("worker.service")


class LoadedExperts(HeldSlices):
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


class ExpertServicer(ServicerBase[tuple[torch.Tensor, torch.Tensor]]):
    """ExpertService computed with torch (``kvasir_rpc.expert_forward_projections``, the
    backbone's own kernel): see ``ServicerBase``."""

    experts: LoadedExperts

    def __init__(self, experts: LoadedExperts, wallet: str, *, echo: bool = False) -> None:
        super().__init__(experts, wallet, echo=echo)

    def thread_initializer(self) -> Callable[[], None] | None:
        return threads_initializer()

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

    def _serialize(self, req: expert_pb2.DispatchRequest, computed: tuple[torch.Tensor, torch.Tensor],
                   micros: int) -> bytes:
        partials, projections = computed
        return serialize_dispatch_response(req.call_id, partials, micros, projections if req.projections else None)

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
        starts = segment_starts(segments)
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
        self.rows += sum(rows for _, rows in segments)
        return partials, projections
