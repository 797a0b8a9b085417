"""A call's segments, without torch (the kernel and the numpy worker share them): the order a
worker computes them in, and the error of a call that does not fit the worker."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DispatchInputError", "check_call_rows", "segment_order", "segment_starts"]


def segment_order(last: tuple[int, list[int]], layer: int, experts: list[int]) -> list[int]:
    """The order to compute a call's segments in (indices into ``experts``), given ``last``:
    the layer of the call computed before and its experts in the order computed. When that
    call was of the same layer (the backbone's next micro-batch group), the experts it
    computed last come first, most recent first, while their weights may still be in the
    CPU's last-level cache; otherwise as sent. Same-layer calls so alternate their order.
    Each segment's partials are the same bits in any order (they are placed by index); only
    the memory traffic changes: an expert of Qwen3-30B-A3B's widths in float32 is 19 MB, and
    streaming the weights of every expert once per group is most of a decode's expert time
    at 16 rows an expert. Two groups of 4 experts x 16 rows, one core: 78 against 69 ms a
    pair of calls. A worker computes in this order, and so do the backbone's emulated workers
    (``kvasir bench``'s fabric-free ceiling)."""
    last_layer, done = last
    if layer != last_layer or not done:
        return list(range(len(experts)))
    recency = {x: r for r, x in enumerate(reversed(done))}
    return sorted(range(len(experts)), key=lambda i: (recency.get(experts[i], len(done)), i))


def segment_starts(segments: Sequence[tuple[int, int]]) -> list[int]:
    """Each segment's first assignment: the running sum of the rows before it."""
    starts, start = [], 0
    for _, rows in segments:
        starts.append(start)
        start += rows
    return starts


def check_call_rows(*, rows: int, segments: Sequence[tuple[int, int]], max_rows: int, weights_shape: Sequence[int],
                    index_size: int | None = None, index_max: int | None = None) -> int:
    """The checks of a call's rows that do not depend on the array library (the torch and the
    numpy worker's ``validate_dispatch`` share them): ``rows`` hidden rows, the segments'
    assignments (``index_size`` entries of ``row_index`` naming rows up to ``index_max``, when
    the call sends each distinct row once), the weights' shape. The rows the segments cover;
    raises DispatchInputError."""
    covered = sum(n for _, n in segments)
    if max(rows, covered) > max_rows:
        raise DispatchInputError(f"{max(rows, covered)} rows in one call, at most {max_rows}")
    if index_size is None:
        if covered != rows:
            raise DispatchInputError(f"segments cover {covered} rows, hidden has {rows}")
    else:
        if index_size != covered:
            raise DispatchInputError(f"row_index has {index_size} entries, segments cover {covered} rows")
        if covered and index_max is not None and index_max >= rows:
            raise DispatchInputError(f"row_index names row {index_max}, hidden has {rows} rows")
    if len(weights_shape) != 1 or weights_shape[0] != covered:
        raise DispatchInputError(f"weights must have shape [{covered}], got {list(weights_shape)}")
    if any(n == 0 for _, n in segments):
        raise DispatchInputError("a segment has zero rows")
    return covered


class DispatchInputError(ValueError):
    """A dispatch request that does not fit the worker: wrong shape, dtype or expert."""

    def __init__(self, message: str, *, precondition: bool = False) -> None:
        super().__init__(message)
        # True when the request is well formed but asks for an expert the worker does not
        # hold (FAILED_PRECONDITION), False for malformed input (INVALID_ARGUMENT).
        self.precondition = precondition
