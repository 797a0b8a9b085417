"""The worker's experts computed with numpy, for a machine without torch (``--compute numpy``;
the default where torch is not installed): the same slices, digest, expert function and
ExpertService as the torch worker's (``_service``), each expert held in float32 and computed
by ``kvasir_rpc.expert_forward_np``. Its answers are not bitwise torch's; they pass the
backbone's row checks and audits, which bound exactly this difference (docs/PROTOCOL.md 11)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from kvasir_rpc import (
    WIRE_DTYPE_NAMES,
    DispatchInputError,
    ExpertFunction,
    ExpertIndex,
    NpExpert,
    NpExpertReader,
    SpecError,
    check_function_np,
    decode_array,
    expert_forward_np,
    expert_pb2,
    parse_expert_spec,
    segment_starts,
    serialize_array_response,
    slices_digest,
    slices_to_proto,
    validate_dispatch_np,
)
from worker._serving import MAX_ROWS_PER_CALL, HeldSlices, LoadProgress, ServicerBase

__all__ = ["DEVICE", "NumpyExperts", "NumpyServicer", "load_experts_np"]

#: What a numpy worker announces as its device (hello, Describe, the hub's status page).
DEVICE = "cpu (numpy)"


class NumpyExperts(HeldSlices):
    """The expert weights this worker serves, in float32 (``NpExpert``), and what it announces:
    the expert function, the model's dtype by name, the digests."""

    def __init__(self, weights: Mapping[tuple[int, int], NpExpert], *, function: ExpertFunction, hidden_size: int,
                 dtype: str, model_type: str, weights_digest: bytes) -> None:
        self.weights = dict(weights)
        self.expert_digests = {k: w.digest for k, w in self.weights.items()}
        self.function = function
        self.hidden_size = hidden_size
        self.dtype = dtype  # the model's, by torch's name: what the rows come in (or narrower for float32)
        self.device = DEVICE
        self.model_type = model_type
        self.weights_digest = weights_digest

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights.values())


def load_experts_np(index: ExpertIndex, spec: str, *,
                    progress: Callable[[LoadProgress], None] | None = None) -> NumpyExperts:
    """``worker._load.load_experts`` without torch: read only the named slices (block FP8 and
    MXFP4 dequantized as torch's worker does, to the same digest). Raises CheckpointError (a
    format or dtype numpy does not compute, missing tensors), SpecError (``spec`` does not
    parse or names nothing the checkpoint has) and ValueError (an expert function numpy does
    not compute)."""
    info = index.info
    wanted = parse_expert_spec(spec, info.num_layers, info.num_experts)
    reader = NpExpertReader(index)
    check_function_np(index.function)
    todo = [(layer, e) for layer, experts in wanted.items() for e in experts if index.has(layer, e)]
    per_expert = 3 * info.intermediate_size * info.hidden_size * 4  # held in float32
    if progress is not None:
        progress(LoadProgress(0, len(todo), 0, per_expert * len(todo)))
    weights: dict[tuple[int, int], NpExpert] = {}
    done = 0
    for i, key in enumerate(todo):
        weights[key] = reader.load(*key)
        done += weights[key].nbytes
        if progress is not None:
            progress(LoadProgress(i + 1, len(todo), done, max(done, per_expert * len(todo))))
    if not weights:
        raise SpecError(f"SPEC {spec!r} names no expert that {index.model_dir} has")
    return NumpyExperts(weights, function=index.function, hidden_size=info.hidden_size, dtype=info.dtype_name,
                        model_type=info.model_type,
                        weights_digest=slices_digest({k: w.digest for k, w in weights.items()}))


@dataclasses.dataclass(frozen=True)
class NpAnswer:
    """A call's partials [rows, H] and projections [rows, 2I], float32, to go back in ``dtype``."""

    partials: np.ndarray
    projections: np.ndarray
    dtype: str


class NumpyServicer(ServicerBase[NpAnswer]):
    """ExpertService computed with numpy: see ``ServicerBase``."""

    experts: NumpyExperts

    def __init__(self, experts: NumpyExperts, wallet: str, *, echo: bool = False) -> None:
        super().__init__(experts, wallet, echo=echo)

    def Describe(self, request, context):  # type: ignore[no-untyped-def]
        e = self.experts
        return expert_pb2.DescribeResponse(
            wallet=self.wallet, slices=slices_to_proto(e.slices), weights_digest=e.weights_digest, device=e.device,
            model_type=e.model_type, hidden_size=e.hidden_size,
            dtype=WIRE_DTYPE_NAMES[e.dtype])  # type: ignore[arg-type]

    def _serialize(self, req: expert_pb2.DispatchRequest, computed: NpAnswer, micros: int) -> bytes:
        return serialize_array_response(req.call_id, computed.partials, computed.dtype, micros,
                                        computed.projections if req.projections else None)

    def _compute(self, req: expert_pb2.DispatchRequest) -> NpAnswer:
        """The call's partials and projections, in float32, to go back in the dtype the hidden
        rows came in."""
        e = self.experts
        hidden, hidden_dtype = decode_array(req.hidden)  # [rows, H] float32
        weights, weights_dtype = decode_array(req.weights)  # [assignments]
        segments = [(s.expert, s.rows) for s in req.segments]
        # Deduplicated rows: each distinct row once, one index per assignment.
        index = np.asarray(req.row_index, dtype=np.int64) if len(req.row_index) else None
        validate_dispatch_np(hidden, hidden_dtype, weights, weights_dtype, segments, hidden_size=e.hidden_size,
                             dtype=e.dtype, max_rows=MAX_ROWS_PER_CALL, row_index=index)
        missing = [x for x, _ in segments if (req.layer, x) not in e.weights]
        if missing:
            raise DispatchInputError(
                f"layer {req.layer}: this worker does not hold experts {missing}", precondition=True
            )
        if self.echo:
            self.calls += 1
            self.rows += index.size if index is not None else hidden.shape[0]
            echoed = hidden if index is None else hidden[index]
            return NpAnswer(echoed, echoed[:, :0], hidden_dtype)
        starts = segment_starts(segments)
        experts = [x for x, _ in segments]
        order = self._order(req.layer, experts)
        out: list[np.ndarray] = [hidden] * len(segments)  # each replaced by its segment's partials
        proj: list[np.ndarray] = [hidden] * len(segments)  # and by its projections
        for i in order:
            (expert, rows), s0 = segments[i], starts[i]
            held = e.weights[(req.layer, expert)]
            x = hidden[s0 : s0 + rows] if index is None else hidden[index[s0 : s0 + rows]]
            out[i], proj[i] = expert_forward_np(x, held.gate_up, held.down, e.function,
                                                weights[s0 : s0 + rows].astype(np.float32, copy=False), held.biases)
        self._last = (req.layer, [experts[i] for i in order])
        if not out:  # a call with no assignments is valid: its partials are [0, hidden_size]
            partials, projections = np.zeros((0, e.hidden_size), np.float32), np.zeros((0, 0), np.float32)
        else:
            partials = np.concatenate(out) if len(out) > 1 else out[0]
            projections = (np.concatenate(proj) if len(proj) > 1 else proj[0]) if req.projections else proj[0][:0]
        self.calls += 1
        self.rows += sum(rows for _, rows in segments)
        return NpAnswer(partials, projections, hidden_dtype)

