"""The numpy worker's pieces against the torch ones they stand in for (issue 33), in process: the
expert kernel for every expert function (within float32 rounding of a float64 reference, and
through the backbone's own row checks and audits), the wire codec, the exact dequantizing
tables, the request checks, and a whole call through each servicer. No assertion depends on
how a BLAS rounds: products are compared with a stated tolerance, and only element-wise
conversions (IEEE casts, table look-ups, products by powers of two or by one scale) are
compared bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvasir_rpc import (
    DTYPE_TO_WIRE,
    WIRE_DTYPE_NAMES,
    DispatchInputError,
    ExpertFunction,
    RowChecker,
    TensorCodecError,
    audit_rows,
    bfloat16_bits,
    decode_array,
    decode_tensor,
    dequantize_block_fp8,
    dequantize_block_fp8_np,
    dequantize_mxfp4,
    dequantize_mxfp4_np,
    encode_tensor,
    expert_forward_np,
    expert_forward_projections,
    expert_pb2,
    fp8_e4m3_values,
    quantize_block_fp8,
    quantize_mxfp4,
    round_to_dtype,
    serialize_dispatch_response,
    serialize_array_response,
    tensor_pb2,
    validate_dispatch,
    validate_dispatch_np,
)
from kvasir_rpc._function import CLAMPED_GLU, CLAMPED_SWIGLU

H, I = 48, 24  # hidden and intermediate widths of the random experts

FUNCTIONS = {
    "silu": ExpertFunction(),
    "gelu": ExpertFunction(activation="gelu"),
    "gelu_pytorch_tanh": ExpertFunction(activation="gelu_pytorch_tanh"),
    "relu2": ExpertFunction(activation="relu2"),
    "silu-transposed-biases": ExpertFunction(transposed=True, bias=True),
    "clamped-glu": ExpertFunction(gate=CLAMPED_GLU, activation="silu", limit=1.5),
    "gpt-oss": ExpertFunction(gate=CLAMPED_SWIGLU, activation="", alpha=1.702, limit=1.5, interleaved=True,
                              transposed=True, bias=True),
}


def _expert(fn: ExpertFunction, seed: int, rows: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(2 * I, H, generator=g) * 0.3
    down = torch.randn(H, I, generator=g) * 0.3
    if fn.transposed:
        gate_up, down = gate_up.T.contiguous(), down.T.contiguous()
    return {"x": torch.randn(rows, H, generator=g) * 2, "w": torch.rand(rows, generator=g), "gate_up": gate_up,
            "down": down, "b_gu": torch.randn(2 * I, generator=g) * 0.1, "b_d": torch.randn(H, generator=g) * 0.1}


def _np_forward(fn: ExpertFunction, e: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    biases = (e["b_gu"].numpy(), e["b_d"].numpy()) if fn.bias else None
    return expert_forward_np(e["x"].numpy(), e["gate_up"].numpy(), e["down"].numpy(), fn, e["w"].numpy(), biases)


def _torch_forward(fn: ExpertFunction, e: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    biases = (e["b_gu"].to(dtype), e["b_d"].to(dtype)) if fn.bias else None
    return expert_forward_projections(e["x"].to(dtype), e["gate_up"].to(dtype), e["down"].to(dtype), fn,
                                      e["w"].to(dtype), biases)


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_each_expert_function_is_the_torch_kernels_within_float32_rounding(name):
    fn = FUNCTIONS[name]
    e = _expert(fn, seed=len(name))
    y, p = _np_forward(fn, e)
    exact_y, exact_p = _torch_forward(fn, e, torch.float64)  # the same function, rounded far less
    assert y.dtype == p.dtype == np.float32 and y.shape == (7, H) and p.shape == (7, 2 * I)
    # A float32 dot product of n terms errs by at most about n * 2^-24 of the sum of magnitudes;
    # the values here are O(1) to O(10): 1e-4 is far above the rounding, far below any mistake.
    np.testing.assert_allclose(p, exact_p.numpy(), rtol=0, atol=1e-4)
    np.testing.assert_allclose(y, exact_y.numpy(), rtol=0, atol=1e-4)
    torch_y, _ = _torch_forward(fn, e, torch.float32)
    np.testing.assert_allclose(y, torch_y.numpy(), rtol=0, atol=2e-4)


def test_an_unknown_activation_and_missing_biases_are_refused_in_words():
    from kvasir_rpc import check_function_np

    with pytest.raises(ValueError, match="not computed without torch"):
        check_function_np(ExpertFunction(activation="xielu"))
    fn = FUNCTIONS["gpt-oss"]
    e = _expert(fn, seed=1)
    with pytest.raises(ValueError, match="has biases; none were given"):
        expert_forward_np(e["x"].numpy(), e["gate_up"].numpy(), e["down"].numpy(), fn, e["w"].numpy(), None)


class _Weights:
    """One layer of experts as the row checks read them (the backbone's ExpertWeights)."""

    def __init__(self, experts: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 biases: dict[int, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        self.experts, self.bias = experts, biases

    def num_experts(self, layer: int) -> int:
        return len(self.experts)

    def get(self, layer: int, expert: int, *, keep: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        return self.experts[expert]

    def biases(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.bias is None else self.bias[expert]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["silu", "clamped-glu", "gpt-oss"])
def test_the_backbones_row_checks_and_audits_accept_the_numpy_answers(name, dtype):
    # An honest worker computing in float32 whatever the model's dtype, its answer rounded once
    # to the wire dtype: every row passes the checks and the audit of a backbone holding the
    # weights in the model's dtype.
    fn = FUNCTIONS[name]
    experts = {k: _expert(fn, seed=10 + k, rows=16) for k in range(2)}
    for e in experts.values():  # the model's weights and rows, as the backbone holds and sends them
        for key in ("gate_up", "down", "b_gu", "b_d", "x", "w"):
            e[key] = e[key].to(dtype).float()
    held = {k: (e["gate_up"].to(dtype), e["down"].to(dtype)) for k, e in experts.items()}
    biases = {k: (e["b_gu"].to(dtype), e["b_d"].to(dtype)) for k, e in experts.items()} if fn.bias else None
    checker = RowChecker(_Weights(held, biases))
    for k, e in experts.items():
        y, p = _np_forward(fn, e)
        partials = torch.from_numpy(y).to(dtype)  # the wire's rounding (tested bit for bit below)
        projections = torch.from_numpy(p).to(dtype)
        x, w = e["x"].to(dtype), e["w"].to(dtype)
        verdict = checker.check(0, fn, x, w, torch.full((16,), k, dtype=torch.long), partials, projections)
        assert verdict.passed, verdict
        audit = audit_rows(partials, x, held[k][0], held[k][1], fn, w, list(range(16)),
                           biases[k] if biases else None)
        assert audit.passed, audit


def test_a_wrong_numpy_answer_fails_the_row_checks():
    fn = FUNCTIONS["silu"]
    e = _expert(fn, seed=3, rows=8)
    y, p = _np_forward(fn, e)
    checker = RowChecker(_Weights({0: (e["gate_up"], e["down"])}, None))
    y[3] *= 1.01
    verdict = checker.check(0, fn, e["x"], e["w"], torch.zeros(8, dtype=torch.long), torch.from_numpy(y),
                            torch.from_numpy(p))
    assert not verdict.passed and verdict.row == 3


SPECIALS = [0.0, -0.0, 1.0, -2.5, 3.0e38, -3.4e38, 1e-40, float("inf"), float("-inf"), float("nan"),
            1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-9, 65504.0, 70000.0, 2.0**-25]


def _values(seed: int, n: int = 4096) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.tensor(SPECIALS), torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 6, (n,),
                                                                                               generator=g)])


def test_bfloat16_and_float16_rounding_is_torchs_cast_bit_for_bit():
    # An IEEE conversion, not a BLAS: rounding to nearest, ties to even; a NaN stays a NaN (which
    # NaN torch writes depends on its kernel: its vectorized cast and its scalar one differ).
    x = _values(0)
    nan = x.isnan().numpy()
    bits = bfloat16_bits(x.numpy())
    assert np.array_equal(bits[~nan], x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)[~nan])
    assert ((bits[nan] & 0x7FFF) > 0x7F80).all()
    for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        stored, widened = round_to_dtype(x.numpy(), name)
        want = x.to(dtype)
        assert np.array_equal(np.asarray(stored)[~nan].view(np.uint8), want[~nan].view(torch.uint8).numpy())
        np.testing.assert_array_equal(widened, want.float().numpy())  # NaN where NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64])
def test_decode_array_reads_what_decode_tensor_reads(dtype):
    t = (_values(1, 64)[:80] * 100).to(dtype) if not dtype.is_floating_point else _values(1, 64)[:80].to(dtype)
    msg = encode_tensor(t.reshape(8, 10))
    values, name = decode_array(msg)
    assert name == str(dtype).removeprefix("torch.") and WIRE_DTYPE_NAMES[name] == DTYPE_TO_WIRE[dtype]
    want = decode_tensor(msg)
    widened = want.float().numpy() if dtype.is_floating_point else want.numpy()
    np.testing.assert_array_equal(values, widened)
    assert values.shape == (8, 10) and (values.dtype == np.float32) == dtype.is_floating_point


@pytest.mark.parametrize("msg", [
    tensor_pb2.Tensor(dtype=99, shape=[1], data=b"\0" * 4),
    tensor_pb2.Tensor(dtype=tensor_pb2.D_TYPE_FLOAT32, shape=[2, 3], data=b"\0" * 20),
    tensor_pb2.Tensor(dtype=tensor_pb2.D_TYPE_BFLOAT16, shape=[1 << 20, 1 << 12], data=b""),
    tensor_pb2.Tensor(dtype=tensor_pb2.D_TYPE_BFLOAT16, shape=[0, 1 << 40], data=b""),
])
def test_decode_array_refuses_what_decode_tensor_refuses(msg):
    with pytest.raises(TensorCodecError) as torch_side:
        decode_tensor(msg)
    with pytest.raises(TensorCodecError) as numpy_side:
        decode_array(msg)
    assert str(numpy_side.value) == str(torch_side.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_projections", [True, False])
def test_a_numpy_answer_serializes_as_the_torch_answer_of_the_same_values(dtype, with_projections):
    g = torch.Generator().manual_seed(7)
    partials, projections = torch.randn(5, H, generator=g), torch.randn(5, 2 * I, generator=g)
    got = serialize_array_response(77, partials.numpy(), str(dtype).removeprefix("torch."), 1234,
                                   projections.numpy() if with_projections else None)
    want = serialize_dispatch_response(77, partials.to(dtype), 1234, projections.to(dtype) if with_projections
                                       else None)
    assert got == want
    parsed = expert_pb2.DispatchResponse.FromString(got)
    assert parsed.partials.call_id == 77 and parsed.partials.HasField("projections") == with_projections
    empty = serialize_array_response(0, np.zeros((0, H), np.float32), "bfloat16", 0, np.zeros((0, 0), np.float32))
    assert empty == serialize_dispatch_response(0, torch.zeros(0, H, dtype=torch.bfloat16), 0,
                                                torch.zeros(0, 0, dtype=torch.bfloat16))


def test_the_fp8_table_is_torchs_cast_of_every_code():
    want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(fp8_e4m3_values(), want)  # NaN at the two NaN codes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_block_fp8_and_mxfp4_dequantize_as_the_torch_worker_does_bit_for_bit(dtype):
    # Element-wise: a table's value times one float32 scale (or a power of two), rounded once.
    name = str(dtype).removeprefix("torch.")
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(64, 96, generator=g) * 0.05).to(dtype)
    q, scale = quantize_block_fp8(w, block=16)
    stored, _ = dequantize_block_fp8_np(q.view(torch.uint8).numpy(), scale.numpy(), name)
    want = dequantize_block_fp8(q, scale, dtype)
    assert np.array_equal(np.asarray(stored).view(np.uint8), want.contiguous().view(torch.uint8).numpy())
    blocks, scales = quantize_mxfp4(torch.randn(64, 96, generator=g).to(dtype))  # [in, out]
    scales[0, 0] = 255  # the largest exponent byte, as transformers keeps it: 2^127 and a factor 2
    stored, widened = dequantize_mxfp4_np(blocks.numpy(), scales.numpy(), name)
    want = dequantize_mxfp4(blocks, scales, dtype)
    assert stored.shape == tuple(want.shape) == (64, 96)
    assert np.array_equal(np.asarray(stored).view(np.uint8), want.contiguous().view(torch.uint8).numpy())
    np.testing.assert_array_equal(widened, want.float().numpy())


def _bad_calls() -> list[tuple[str, dict]]:  # type: ignore[type-arg]
    ok = {"hidden": torch.zeros(3, H), "weights": torch.ones(3), "segments": [(0, 2), (1, 1)], "row_index": None}
    return [
        ("shape", {**ok, "hidden": torch.zeros(3, H + 1)}),
        ("dtype", {**ok, "hidden": torch.zeros(3, H, dtype=torch.int32)}),
        ("cover", {**ok, "segments": [(0, 2)]}),
        ("index-count", {**ok, "row_index": torch.tensor([0, 1])}),
        ("index-range", {**ok, "row_index": torch.tensor([0, 1, 3])}),
        ("weights-shape", {**ok, "weights": torch.ones(2)}),
        ("weights-int", {**ok, "weights": torch.ones(3, dtype=torch.int64)}),
        ("zero-rows", {**ok, "segments": [(0, 3), (1, 0)]}),
        ("nan", {**ok, "hidden": torch.full((3, H), float("nan"))}),
        ("inf-weight", {**ok, "weights": torch.tensor([1.0, float("inf"), 1.0])}),
        ("too-many", {**ok, "hidden": torch.zeros(9, H), "weights": torch.ones(9), "segments": [(0, 9)]}),
    ]


@pytest.mark.parametrize(("what", "call"), _bad_calls(), ids=[n for n, _ in _bad_calls()])
def test_validate_dispatch_np_refuses_as_validate_dispatch_does(what, call):
    kw = {"hidden_size": H, "max_rows": 8}
    with pytest.raises(DispatchInputError) as torch_side:
        validate_dispatch(call["hidden"], call["weights"], call["segments"], dtype=torch.float32,
                          row_index=call["row_index"], **kw)
    hidden, hidden_dtype = decode_array(encode_tensor(call["hidden"]))
    weights, weights_dtype = decode_array(encode_tensor(call["weights"]))
    index = call["row_index"].numpy() if call["row_index"] is not None else None
    with pytest.raises(DispatchInputError) as numpy_side:
        validate_dispatch_np(hidden, hidden_dtype, weights, weights_dtype, call["segments"], dtype="float32",
                             row_index=index, **kw)
    assert str(numpy_side.value) == str(torch_side.value)


def test_a_narrow_wire_is_taken_for_a_float32_model_only():
    hidden, name = decode_array(encode_tensor(torch.zeros(2, H, dtype=torch.bfloat16)))
    validate_dispatch_np(hidden, name, np.ones(2, np.float32), "float32", [(0, 2)], hidden_size=H, dtype="float32",
                         max_rows=8)
    with pytest.raises(DispatchInputError, match="hidden must be torch.float16, got torch.bfloat16"):
        validate_dispatch_np(hidden, name, np.ones(2, np.float32), "float32", [(0, 2)], hidden_size=H,
                             dtype="float16", max_rows=8)


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_a_call_through_the_numpy_servicer_is_the_torch_servicers_within_rounding(wire):
    from kvasir_rpc import NpExpert
    from worker._numpy import NumpyExperts, NumpyServicer
    from worker._service import ExpertServicer, LoadedExperts

    fn = FUNCTIONS["gpt-oss"]
    made = {(2, k): _expert(fn, seed=20 + k) for k in range(3)}
    torch_experts = LoadedExperts({k: (e["gate_up"], e["down"]) for k, e in made.items()}, function=fn,
                                  biases={k: (e["b_gu"], e["b_d"]) for k, e in made.items()}, hidden_size=H,
                                  dtype=torch.float32, device=torch.device("cpu"), model_type="gpt_oss",
                                  weights_digest=b"d" * 32, expert_digests={k: b"e" * 32 for k in made})
    np_experts = NumpyExperts({k: NpExpert(e["gate_up"].numpy(), e["down"].numpy(), (e["b_gu"].numpy(),
                                                                                      e["b_d"].numpy()), b"e" * 32)
                               for k, e in made.items()}, function=fn, hidden_size=H, dtype="float32",
                              model_type="gpt_oss", weights_digest=b"d" * 32)
    assert np_experts.slices == torch_experts.slices == {2: (0, 1, 2)}
    assert np_experts.shares(3) == torch_experts.shares(3)
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(4, H, generator=g).to(wire)
    req = expert_pb2.DispatchRequest(call_id=5, layer=2, hidden=encode_tensor(hidden),
                                     weights=encode_tensor(torch.rand(6, generator=g)),
                                     segments=[expert_pb2.ExpertSegment(expert=e, rows=n) for e, n in ((2, 3), (0, 3))],
                                     row_index=[0, 1, 3, 3, 2, 0], projections=True)
    answers = []
    for servicer in (ExpertServicer(torch_experts, "0" * 64), NumpyServicer(np_experts, "0" * 64)):
        (raw,) = list(servicer.Dispatch(iter([req]), None))
        answers.append(expert_pb2.DispatchResponse.FromString(raw).partials)
        assert servicer.calls == 1 and servicer.rows == 6
    (t, n) = answers
    assert n.call_id == 5 and n.partials.dtype == t.partials.dtype == DTYPE_TO_WIRE[wire]
    assert list(n.partials.shape) == [6, H] and list(n.projections.shape) == [6, 2 * I]
    atol = 1e-4 if wire == torch.float32 else 0.1  # a bfloat16 wire rounds each value to 8 bits
    for field in ("partials", "projections"):
        got, want = decode_tensor(getattr(n, field)).float(), decode_tensor(getattr(t, field)).float()
        assert torch.allclose(got, want, rtol=2**-7 if wire == torch.bfloat16 else 0, atol=atol), field
