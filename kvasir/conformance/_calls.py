"""The calls the check sends a worker: seeded random DispatchRequests over the experts it
announced, each with what the reference needs to judge its answer (``_Call``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvasir_rpc import expert_pb2

# Rows of the packed call's hidden, and how each of its experts picks from them.
_PACKED_PICKS = ((0, 1, 3), (1, 2), (0, 3))


@dataclasses.dataclass(frozen=True)
class _Call:
    """One DispatchRequest and what the reference needs to judge its answer."""

    name: str
    request: expert_pb2.DispatchRequest
    layer: int
    hidden: torch.Tensor  # [n, H] as sent
    weights: torch.Tensor  # [assignments]
    segments: tuple[tuple[int, int], ...]  # (expert, rows), in order
    row_index: torch.Tensor | None  # [assignments] int64 when packed


def _make_call(name: str, call_id: int, layer: int, hidden: torch.Tensor, weights: torch.Tensor,
               segments: Sequence[tuple[int, int]], row_index: Sequence[int] = (), projections: bool = False) -> _Call:
    import torch

    from kvasir_rpc import encode_tensor, expert_pb2

    req = expert_pb2.DispatchRequest(
        call_id=call_id, layer=layer, hidden=encode_tensor(hidden), weights=encode_tensor(weights),
        segments=[expert_pb2.ExpertSegment(expert=e, rows=n) for e, n in segments], row_index=list(row_index),
        projections=projections)
    index = torch.tensor(list(row_index), dtype=torch.long) if row_index else None
    return _Call(name, req, layer, hidden, weights, tuple(segments), index)


def _pick_layer(slices: Mapping[int, Sequence[int]]) -> tuple[int, tuple[int, ...]]:
    """The layer with the most announced experts (the lowest on a tie), and up to three of them."""
    layer = max(sorted(slices), key=lambda k: len(slices[k]))
    return layer, tuple(slices[layer][:3])


def plan_calls(slices: Mapping[int, Sequence[int]], hidden_size: int, dtype: torch.dtype, seed: int,
               projections: bool = False) -> list[_Call]:
    """Seeded random calls over announced experts: one of several experts with several rows
    each, one of a single row, and a packed one (``row_index``) when the worker holds two or
    more experts of a layer. Inputs are float32 normals cast to the model's dtype. With
    ``projections`` (the worker announced them) every call asks for them."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def rand_rows(n: int) -> torch.Tensor:
        return torch.randn(n, hidden_size, generator=gen).to(dtype)

    def rand_weights(n: int) -> torch.Tensor:
        return torch.rand(n, generator=gen).to(dtype)

    layer, experts = _pick_layer(slices)
    counts = (3, 2, 4)[: len(experts)]
    segs = list(zip(experts, counts))
    calls = [
        _make_call("several experts", 1, layer, rand_rows(sum(counts)), rand_weights(sum(counts)), segs,
                   projections=projections),
        _make_call("one row", 2, layer, rand_rows(1), rand_weights(1), [(experts[-1], 1)], projections=projections),
    ]
    if len(experts) >= 2:
        picks = _PACKED_PICKS[: len(experts)]
        index = [i for p in picks for i in p]
        calls.append(_make_call("packed (row_index)", 3, layer, rand_rows(1 + max(index)),
                                rand_weights(len(index)), [(e, len(p)) for e, p in zip(experts, picks)], index,
                                projections=projections))
    return calls
