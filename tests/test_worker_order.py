"""The worker computes a call's experts in the order that reuses the CPU's cache (the
previous same-layer call's last experts first) and answers the same bits as in any order."""

from __future__ import annotations

import pytest
import torch

from kvasir_rpc import ExpertFunction, encode_tensor, expert_forward, expert_pb2, get_activation
from worker import _service
from worker._service import ExpertServicer, LoadedExperts

H, I = 32, 24


def _servicer() -> ExpertServicer:
    g = torch.Generator().manual_seed(5)
    weights = {(layer, e): (torch.randn(2 * I, H, generator=g), torch.randn(H, I, generator=g))
               for layer in (0, 1) for e in range(6)}
    experts = LoadedExperts(weights, function=ExpertFunction(), hidden_size=H, dtype=torch.float32,
                            device=torch.device("cpu"), model_type="qwen3_moe", weights_digest=bytes(32))
    return ExpertServicer(experts, "0" * 64)


def _call(layer: int, segments: list[tuple[int, int]], seed: int) -> tuple[expert_pb2.DispatchRequest, torch.Tensor,
                                                                              torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = sum(n for _, n in segments)
    hidden, weights = torch.randn(rows, H, generator=g), torch.rand(rows, generator=g)
    req = expert_pb2.DispatchRequest(call_id=seed, layer=layer, hidden=encode_tensor(hidden),
                                     weights=encode_tensor(weights),
                                     segments=[expert_pb2.ExpertSegment(expert=e, rows=n) for e, n in segments])
    return req, hidden, weights


def _expected(sv: ExpertServicer, layer: int, segments, hidden, weights) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out, start = [], 0
    for e, n in segments:
        gate_up, down = sv.experts.weights[(layer, e)]
        out.append(expert_forward(hidden[start:start + n], gate_up, down, get_activation("silu"), weights[start:start + n]))
        start += n
    return torch.cat(out)


def test_same_layer_calls_alternate_their_order_and_answer_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    sv = _servicer()
    by_ptr = {gu.data_ptr(): key for key, (gu, _) in sv.experts.weights.items()}
    computed: list[tuple[int, int]] = []
    real = _service.expert_forward_projections

    def spy(x, gate_up, down, fn, w, biases=None):  # type: ignore[no-untyped-def]
        computed.append(by_ptr[gate_up.data_ptr()])
        return real(x, gate_up, down, fn, w, biases)

    monkeypatch.setattr(_service, "expert_forward_projections", spy)
    calls = [
        (0, [(0, 3), (1, 5), (2, 1), (4, 7)]),  # group A, layer 0: as sent
        (0, [(0, 2), (2, 4), (3, 1), (4, 6)]),  # group B, layer 0: 4 and 2 (A's last) first, 0, then 3
        (1, [(1, 2), (5, 3)]),  # another layer: as sent
        (1, [(1, 1), (5, 1)]),  # its next group: reversed
        (1, []),  # an empty call answers [0, H]
    ]
    orders = []
    for seed, (layer, segments) in enumerate(calls):
        computed.clear()
        req, hidden, weights = _call(layer, segments, seed)
        req.projections = True
        got, projections = sv._compute(req)
        orders.append([e for _, e in computed])
        if segments:
            assert torch.equal(got, _expected(sv, layer, segments, hidden, weights))
            # The projections, in segment order whatever the order computed: [x @ gate_up^T].
            starts = [sum(n for _, n in segments[:i]) for i in range(len(segments))]
            want = torch.cat([hidden[s:s + n] @ sv.experts.weights[(layer, e)][0].T
                              for (e, n), s in zip(segments, starts)])
            assert torch.allclose(projections, want, rtol=1e-5, atol=1e-6)
        else:
            assert got.shape == (0, H)
    assert orders == [[0, 1, 2, 4], [4, 2, 0, 3], [1, 5], [5, 1], []]
