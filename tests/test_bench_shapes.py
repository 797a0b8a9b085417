"""``kvasir bench --shape NAME``: the table of real releases' widths, the wire bytes counted
with the serializers the backbone and the worker use, the memory arithmetic, the flag's
parsing, and one quick run end to end."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import subprocess
import sys

import pytest
import torch

from kvasir.bench import (
    DECODE_MODEL,
    HIDDEN,
    INTER,
    RELEASED_BYTES_PER_PARAM,
    SHAPE_ALL,
    SHAPE_BATCH,
    SHAPE_BATCHES,
    SHAPES,
    SWARM_SIZES,
    WIRE_CALL_ID,
    WIRE_COMPUTE_MICROS,
    WIRE_DTYPES,
    WIRE_LAYER,
    ReleaseShape,
    call_bytes,
    memory_figures,
    shape_segments,
    shape_table,
    shape_wire,
    shapes_named,
    wire_figures,
)
from kvasir.cli import build_parser, main
from kvasir_rpc import encode_tensor, expert_pb2

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Small enough that every figure can be worked out by hand.
SMALL = ReleaseShape("small", ("Small-1",), hidden=64, intermediate=24, moe_layers=3, experts=8, top_k=2,
                     released="bfloat16")


def _protobufs_own(hidden: int, inter: int, segments: list[tuple[int, int]], dtype: torch.dtype,
                   checked: bool) -> tuple[bytes, bytes]:
    """The call and its answer as protobuf itself serializes them (an oracle independent of
    ``serialize_dispatch_*``)."""
    rows = sum(r for _, r in segments)
    x = torch.zeros(rows, hidden, dtype=dtype)
    request = expert_pb2.DispatchRequest(
        call_id=WIRE_CALL_ID, layer=WIRE_LAYER, hidden=encode_tensor(x),
        segments=[expert_pb2.ExpertSegment(expert=e, rows=r) for e, r in segments],
        weights=encode_tensor(torch.zeros(rows, dtype=dtype)), projections=checked)
    partials = expert_pb2.ExpertPartials(call_id=WIRE_CALL_ID, partials=encode_tensor(x),
                                         compute_micros=WIRE_COMPUTE_MICROS)
    if checked:
        partials.projections.CopyFrom(encode_tensor(torch.zeros(rows, 2 * inter, dtype=dtype)))
    return request.SerializeToString(), expert_pb2.DispatchResponse(partials=partials).SerializeToString()


@pytest.mark.parametrize("dtype", WIRE_DTYPES)
@pytest.mark.parametrize("segments", [[(0, 1)], [(0, 2), (1, 3)], shape_segments(SHAPE_BATCH)])
def test_call_bytes_are_what_protobuf_writes(dtype: str, segments: list[tuple[int, int]]) -> None:
    got = call_bytes(SMALL.hidden, SMALL.intermediate, segments, dtype)
    off = _protobufs_own(SMALL.hidden, SMALL.intermediate, segments, getattr(torch, dtype), checked=False)
    on = _protobufs_own(SMALL.hidden, SMALL.intermediate, segments, getattr(torch, dtype), checked=True)
    assert (got.request, got.response) == (len(off[0]), len(off[1]))
    assert (got.request_checked, got.response_checked) == (len(on[0]), len(on[1]))
    assert got.rows == sum(r for _, r in segments)


@pytest.mark.parametrize("dtype", WIRE_DTYPES)
def test_call_bytes_are_the_payload_and_a_few_bytes_of_framing(dtype: str) -> None:
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    h, i = SMALL.hidden, SMALL.intermediate
    for rows in (1, 5, SHAPE_BATCH):
        c = call_bytes(h, i, shape_segments(rows), dtype)
        # The request: each row and its routing weight; the answer: each row's partials.
        assert 0 < c.request - rows * (h + 1) * size < 64
        assert 0 < c.response - rows * h * size < 32
        # Row checks: the request's flag (2 bytes); the answer's projections, [rows, 2I], and their header.
        assert c.request_checked - c.request == 2
        assert 0 < c.response_checked - c.response - rows * 2 * i * size < 16


def test_wire_figures_per_row_per_token_and_per_model() -> None:
    call = call_bytes(SMALL.hidden, SMALL.intermediate, [(0, 2), (1, 3)], "float32")
    f = wire_figures(SMALL, call)
    for suffix, req, resp in (("", call.request, call.response),
                              ("_row_checks", call.request_checked, call.response_checked)):
        per_row = (req + resp) / 5
        assert f[f"request_bytes{suffix}"] == req and f[f"response_bytes{suffix}"] == resp
        assert f[f"bytes_per_row{suffix}"] == pytest.approx(per_row, abs=0.005)
        assert f[f"bytes_per_token_per_layer{suffix}"] == pytest.approx(2 * per_row, abs=0.05)  # top-2
        assert f[f"bytes_per_token{suffix}"] == pytest.approx(3 * 2 * per_row, abs=0.5)  # 3 MoE layers
    assert f["rows_per_call"] == 5
    wire = shape_wire(SMALL)
    assert set(wire) == set(WIRE_DTYPES) and all(set(w) == {f"b{b}" for b in SHAPE_BATCHES} for w in wire.values())
    # bfloat16 halves the payload, not the framing.
    half = wire["bfloat16"]["b1"]["bytes_per_row"] / wire["float32"]["b1"]["bytes_per_row"]
    assert 0.5 < half < 0.55


def test_shape_segments_spread_rows_over_the_experts() -> None:
    assert shape_segments(1) == [(0, 1)]
    assert shape_segments(SHAPE_BATCH, 2) == [(0, SHAPE_BATCH // 2), (1, SHAPE_BATCH // 2)]
    assert shape_segments(5, 2) == [(0, 3), (1, 2)]
    assert shape_segments(7, 3) == [(0, 3), (1, 2), (2, 2)]


def test_the_table_of_shapes_is_consistent() -> None:
    assert list(SHAPES) == ["deepseek-v3", "qwen3-235b-a22b", "gpt-oss-120b", "qwen3-30b-a3b"]
    for name, s in SHAPES.items():
        assert s.name == name and name == name.lower() and name != SHAPE_ALL
        assert s.releases and all(r.strip() for r in s.releases)
        assert min(s.hidden, s.intermediate, s.moe_layers, s.experts, s.top_k) > 0
        assert s.top_k < s.experts
        assert s.released in RELEASED_BYTES_PER_PARAM
        assert s.expert_params == 3 * s.hidden * s.intermediate
    releases = [r for s in SHAPES.values() for r in s.releases]
    assert len(releases) == len(set(releases))
    # The rest of the bench says its expert is Qwen3-30B-A3B's: the same widths as here.
    q = SHAPES["qwen3-30b-a3b"]
    assert (q.hidden, q.intermediate) == (HIDDEN, INTER)
    assert (DECODE_MODEL["hidden_size"], DECODE_MODEL["moe_intermediate_size"]) == (HIDDEN, INTER)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.hidden = 1  # type: ignore[misc]


def test_shapes_named() -> None:
    assert shapes_named(SHAPE_ALL) == list(SHAPES.values())
    assert shapes_named("gpt-oss-120b") == [SHAPES["gpt-oss-120b"]]
    with pytest.raises(ValueError, match="no shape named 'llama'; one of: deepseek-v3, .*, all"):
        shapes_named("llama")


def test_memory_figures() -> None:
    m = memory_figures(SHAPES["deepseek-v3"])
    per = 3 * 7168 * 2048
    assert m["bytes_per_expert"] == {"bfloat16": 2 * per, "float32": 4 * per, "released": per + 4 * per // 16384}
    assert m["experts_in_model"] == 58 * 256
    assert m["model_bytes"]["bfloat16"] == 58 * 256 * 2 * per  # type: ignore[index]
    workers = m["per_worker"]
    assert list(workers) == [str(n) for n in SWARM_SIZES]  # type: ignore[call-overload]
    for n, w in workers.items():  # type: ignore[attr-defined]
        assert w["experts"] == math.ceil(58 * 256 / int(n))
        assert w["bfloat16_bytes"] == w["experts"] * 2 * per
    gpt = memory_figures(SHAPES["gpt-oss-120b"])["bytes_per_expert"]
    assert gpt["released"] == math.ceil(3 * 2880 * 2880 * 17 / 32)  # type: ignore[index]


def test_shape_table_of_a_result() -> None:
    point = {"p50_ms": 2.0, "p90_ms": 3.0, "rows_s": 500.0}
    result = {"shape": {**dataclasses.asdict(SMALL), "expert_params": SMALL.expert_params},
              "wire": shape_wire(SMALL), "memory": memory_figures(SMALL),
              "dispatch": {"gateway": {str(b): point for b in SHAPE_BATCHES},
                           "inprocess": {str(b): {**point, "p50_ms": 1.0, "rows_s": 1000.0} for b in SHAPE_BATCHES}},
              "ratios": {f"gateway_over_inprocess_rows_s_b{b}": 0.5 for b in SHAPE_BATCHES},
              "figures": {"worker_rss_bytes": 300_000_000, "worker_weights_bytes": 2 * 4 * SMALL.expert_params}}
    lines = shape_table(result).splitlines()
    assert lines[0].startswith("small (Small-1): hidden 64, expert intermediate 24, 3 MoE layers of 8 experts, top-2")
    one = wire_figures(SMALL, call_bytes(64, 24, [(0, 1)], "float32"))
    row = next(line for line in lines if line.split()[:1] == ["float32"])
    assert row.split()[1] == f"{one['bytes_per_row']:,.0f}"
    assert any("300 MB resident" in line for line in lines)
    assert lines[-1].split() == ["batch", str(SHAPE_BATCH), "(2", "experts)", "2.0", "3.0", "500", "1.0", "1,000",
                                 "0.5"]


def test_shape_flag_takes_the_names_and_refuses_others(capsys: pytest.CaptureFixture[str]) -> None:
    for name in (*SHAPES, SHAPE_ALL):
        assert build_parser().parse_args(["bench", "--shape", name, "--quick"]).shape == name
    assert build_parser().parse_args(["bench"]).shape is None
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--shape", "llama-70b"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --shape: invalid choice: 'llama-70b'" in err
    assert all(f"'{name}'" in err for name in (*SHAPES, SHAPE_ALL)), err


@pytest.mark.integration
def test_quick_shape_bench_end_to_end() -> None:
    out = subprocess.run([sys.executable, "-m", "kvasir", "bench", "--shape", "qwen3-30b-a3b", "--quick", "--json"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout)
    assert set(result) >= {"compute", "quick", "batches", "machine", "shapes", "units", "swarm_sizes"}
    assert result["quick"] is True and list(result["shapes"]) == ["qwen3-30b-a3b"]
    shape = result["shapes"]["qwen3-30b-a3b"]
    assert set(shape) == {"shape", "wire", "memory", "dispatch", "ratios", "figures"}
    assert shape["shape"]["hidden"] == 2048 and shape["shape"]["top_k"] == 8
    for dtype in WIRE_DTYPES:
        for batch in SHAPE_BATCHES:
            assert all(v > 0 for v in shape["wire"][dtype][f"b{batch}"].values())
    assert shape["memory"]["bytes_per_expert"]["bfloat16"] == 3 * 2048 * 768 * 2
    for path in ("gateway", "inprocess"):
        for batch in SHAPE_BATCHES:
            point = shape["dispatch"][path][str(batch)]
            assert point["p50_ms"] > 0 and point["p90_ms"] >= point["p50_ms"] and point["rows_s"] > 0
            assert point["calls"] >= 3
    # The worker's answers were the size the wire figures count (the bench checks it) and
    # the request the size call_bytes gives for layer 0 (proto3 leaves the zero out: 2 bytes).
    big = shape["dispatch"]["gateway"][str(SHAPE_BATCH)]
    assert big["request_bytes"] == shape["wire"]["float32"][f"b{SHAPE_BATCH}"]["request_bytes_row_checks"] - 2
    assert all(v > 0 for v in shape["ratios"].values()) and set(shape["ratios"]) == {
        f"gateway_over_inprocess_rows_s_b{b}" for b in SHAPE_BATCHES}
    assert shape["figures"]["worker_rss_bytes"] > shape["figures"]["worker_weights_bytes"] > 0
    assert "qwen3-30b-a3b (Qwen3-30B-A3B): hidden 2048" in out.stderr
