"""Real releases' shapes (``kvasir bench --shape NAME``): the widths of released models
(SHAPES), to size a swarm: bytes on the wire per token, a worker's memory per expert, and
calls at those widths through the gateway path against the kernel alone.
"""

from __future__ import annotations

import math
import os
import pathlib
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

from kvasir.bench._checkpoint import make_bench_checkpoint
from kvasir.bench._streams import _RawStream, _summary

#: Bytes per parameter of the dtypes the experts of releases ship in. fp8 (e4m3): one byte, and
#: a float32 scale per 128 x 128 block (DeepSeek's and Kimi's ``weight_block_size``); mxfp4:
#: 4 bits, and a byte of scale per 32 (gpt-oss's experts). A worker here holds bfloat16,
#: float16 or float32 experts: an FP8 or MXFP4 release is served converted to bfloat16.
RELEASED_BYTES_PER_PARAM: dict[str, float] = {"bfloat16": 2.0, "fp8": 1 + 4 / (128 * 128), "mxfp4": (16 + 1) / 32}


@dataclass(frozen=True)
class ReleaseShape:
    """The routed experts' widths of released Mixture-of-Experts models, as their config.json
    gives them: what sizes the bytes on the wire, a worker's memory and its compute."""

    name: str  # what ``--shape`` takes
    releases: tuple[str, ...]  # the releases of exactly these widths
    hidden: int  # hidden_size: a row's width on the wire
    intermediate: int  # one routed expert's (moe_intermediate_size)
    moe_layers: int  # layers with routed experts
    experts: int  # routed experts per MoE layer
    top_k: int  # experts per token (num_experts_per_tok)
    released: str  # the dtype the experts ship in, a key of RELEASED_BYTES_PER_PARAM
    note: str = ""

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert: gate_up [2I, H] and down [H, I]."""
        return 3 * self.hidden * self.intermediate


#: Every shape ``--shape`` knows, in the order ``--shape all`` measures them.
SHAPES: dict[str, ReleaseShape] = {s.name: s for s in (
    ReleaseShape("deepseek-v3", ("DeepSeek-V3", "DeepSeek-R1"), hidden=7168, intermediate=2048, moe_layers=58,
                 experts=256, top_k=8, released="fp8",
                 note="61 layers, the first 3 dense; each MoE layer's shared expert stays on the backbone. Kimi K2 "
                      "has these widths (the per-row and per-expert figures hold) with 384 experts over 60 MoE "
                      "layers"),
    ReleaseShape("qwen3-235b-a22b", ("Qwen3-235B-A22B",), hidden=4096, intermediate=1536, moe_layers=94,
                 experts=128, top_k=8, released="bfloat16", note="FP8 releases exist"),
    ReleaseShape("gpt-oss-120b", ("gpt-oss-120b",), hidden=2880, intermediate=2880, moe_layers=36, experts=128,
                 top_k=4, released="mxfp4",
                 note="its own expert function: biases, gate/up interleaved and stored transposed, the clamped "
                      "SwiGLU (docs/PROTOCOL.md 11.2), measured as such"),
    ReleaseShape("qwen3-30b-a3b", ("Qwen3-30B-A3B",), hidden=2048, intermediate=768, moe_layers=48, experts=128,
                 top_k=8, released="bfloat16", note="FP8 releases exist"),
)}
SHAPE_ALL = "all"

#: The dtypes the wire figures are given in: a float32 model's, and bfloat16 (a bfloat16
#: model's, or a float32 one's with ``--wire-dtype bfloat16``).
WIRE_DTYPES = ("float32", "bfloat16")
# Varints as a running decode has them, so that proto3 leaves none out as zero: a call id in
# the thousands, a layer past the first, an answer computed in milliseconds.
WIRE_CALL_ID = 1000
WIRE_LAYER = 1
WIRE_COMPUTE_MICROS = 1000
#: The bench's checkpoint holds this many experts (one MoE layer); the large call spreads its
#: SHAPE_BATCH rows evenly over them, the small one is one row of expert 0.
SHAPE_EXPERTS = 2
SHAPE_BATCH = 256
SHAPE_BATCHES = (1, SHAPE_BATCH)
#: Swarm sizes for a worker's share of the model.
SWARM_SIZES = (16, 64, 256)
COMPUTE_NOTE = ("compute: float32 weights, rows and partials, one torch thread per process, row checks on (answers "
                "carry projections); the releases ship bfloat16, FP8 or MXFP4 experts, whose compute is not measured "
                "here (a CPU computes bfloat16 slower than float32, a GPU faster): the wire and memory figures are "
                "given in bfloat16 and float32")


def shapes_named(name: str) -> list[ReleaseShape]:
    """The shapes ``--shape NAME`` measures: that one, or every one in SHAPES for ``all``.
    Raises ValueError naming the choices for any other name."""
    if name == SHAPE_ALL:
        return list(SHAPES.values())
    if name not in SHAPES:
        raise ValueError(f"no shape named {name!r}; one of: {', '.join([*SHAPES, SHAPE_ALL])}")
    return [SHAPES[name]]


def shape_segments(rows: int, experts: int = SHAPE_EXPERTS) -> list[tuple[int, int]]:
    """``rows`` assignments spread over ``experts`` experts as evenly as they go, as the
    (expert, rows) segments of a call; one row is one segment."""
    n = max(1, min(rows, experts))
    return [(e, rows // n + (1 if e < rows % n else 0)) for e in range(n)]


@dataclass(frozen=True)
class CallBytes:
    """The serialized sizes of one Dispatch call of ``rows`` assignments and of its answer,
    with row checks off and on (then the request asks for projections and the answer
    carries them, [rows, 2I], in the wire dtype)."""

    rows: int
    request: int
    response: int
    request_checked: int
    response_checked: int


def call_bytes(hidden: int, inter: int, segments: Sequence[tuple[int, int]], dtype: str) -> CallBytes:
    """The sizes of a call of ``segments`` ((expert, rows) pairs) at widths ``hidden`` and
    ``inter``, with rows, routing weights, partials and projections in ``dtype`` (as a model
    of that dtype sends them; a float32 model on a bfloat16 wire keeps float32 weights, 2
    bytes more per row), as the backbone's and the worker's own serializers write them. The
    sizes do not depend on the values: the tensors are zeros. Raises TensorCodecError for a
    dtype the wire does not carry."""
    import torch

    from kvasir_rpc import serialize_dispatch_request, serialize_dispatch_response

    t = getattr(torch, dtype)
    rows = sum(r for _, r in segments)
    x, w, proj = torch.zeros(rows, hidden, dtype=t), torch.zeros(rows, dtype=t), torch.zeros(rows, 2 * inter, dtype=t)

    def request(checked: bool) -> int:
        return len(serialize_dispatch_request(WIRE_CALL_ID, WIRE_LAYER, x, w, segments, projections=checked))

    return CallBytes(rows=rows, request=request(False), request_checked=request(True),
                     response=len(serialize_dispatch_response(WIRE_CALL_ID, x, WIRE_COMPUTE_MICROS)),
                     response_checked=len(serialize_dispatch_response(WIRE_CALL_ID, x, WIRE_COMPUTE_MICROS, proj)))


def wire_figures(shape: ReleaseShape, call: CallBytes) -> dict[str, float]:
    """Bytes on the wire, request and answer, of calls of ``call``'s size: per assignment row,
    per token and layer (a token routed to top-k experts makes k assignments, each carrying its
    row), and per token through every MoE layer; with row checks off, and on (``_row_checks``).
    A token routed to several experts of one worker travels once in its request (``row_index``),
    so these are the most a token's requests carry."""
    out: dict[str, float] = {"rows_per_call": call.rows}
    for suffix, req, resp in (("", call.request, call.response),
                              ("_row_checks", call.request_checked, call.response_checked)):
        per_row = (req + resp) / call.rows
        out[f"request_bytes{suffix}"] = req
        out[f"response_bytes{suffix}"] = resp
        out[f"bytes_per_row{suffix}"] = round(per_row, 2)
        out[f"bytes_per_token_per_layer{suffix}"] = round(per_row * shape.top_k, 1)
        out[f"bytes_per_token{suffix}"] = round(per_row * shape.top_k * shape.moe_layers)
    return out


def shape_wire(shape: ReleaseShape) -> dict[str, dict[str, dict[str, float]]]:
    """:func:`wire_figures` in each of WIRE_DTYPES for a call of one row (``b1``: each of a
    token's experts in a call of its own) and one of SHAPE_BATCH rows (``b256``)."""
    return {dtype: {f"b{rows}": wire_figures(shape, call_bytes(shape.hidden, shape.intermediate,
                                                               shape_segments(rows), dtype))
                    for rows in SHAPE_BATCHES}
            for dtype in WIRE_DTYPES}


def memory_figures(shape: ReleaseShape) -> dict[str, object]:
    """What holding experts takes: bytes of one expert's gate_up and down in bfloat16, float32
    and as released; of every routed expert of the model; and of a worker's share in a swarm
    of N workers that holds the model once (whole experts, the model's over N rounded up).
    Weights only: a worker process holds its runtime besides (measured in the dispatch part)."""
    p = shape.expert_params
    per_expert = {"bfloat16": 2 * p, "float32": 4 * p,
                  "released": math.ceil(p * RELEASED_BYTES_PER_PARAM[shape.released])}
    count = shape.experts * shape.moe_layers
    per_worker = {}
    for n in SWARM_SIZES:
        held = math.ceil(count / n)
        per_worker[str(n)] = {"experts": held, **{f"{k}_bytes": v * held for k, v in per_expert.items()}}
    return {"params_per_expert": p, "bytes_per_expert": per_expert, "released": shape.released,
            "experts_in_model": count, "model_bytes": {k: v * count for k, v in per_expert.items()},
            "per_worker": per_worker}


def _timed(fn: Callable[[], object], *, most: int, budget_s: float, least: int = 3) -> list[float]:
    """Seconds of each of up to ``most`` calls of ``fn``, fewer once ``budget_s`` is spent
    (never fewer than ``least``)."""
    times: list[float] = []
    end = time.perf_counter() + budget_s
    for _ in range(most):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        if t1 > end and len(times) >= least:
            break
    return times


def shape_dispatch(shape: ReleaseShape, *, quick: bool = False,
                   say: Callable[[str], None] = print) -> dict[str, object]:
    """Calls at ``shape``'s widths through the gateway path (a TLS gateway, a hub, a worker
    of SHAPE_EXPERTS float32 experts of random weights, one Dispatch stream through the hub,
    serialized as the backbone serializes, row checks on) against the worker's kernel alone
    in this process on the same rows, at 1 row and SHAPE_BATCH rows a call: median and p90 ms
    per call, rows/s, and their ratios; the worker process's resident memory. Each answer's
    size is checked against :func:`call_bytes`' (SwarmError when it differs). The stream has a
    deadline, so a worker that stops answering ends the bench with a gRPC error."""
    import psutil
    import torch

    from kvasir.swarm import LocalSwarm, SwarmError
    from kvasir_rpc import (
        TARGET_KEY_METADATA,
        ExpertIndex,
        expert_forward,
        expert_pb2,
        serialize_dispatch_request,
        serialize_dispatch_response,
        target_key,
    )

    torch.set_num_threads(1)  # as the swarm's processes (LocalSwarm's KVASIR_THREADS)
    budget_s = 4.0 if quick else 15.0
    most = {1: 40 if quick else 300, SHAPE_BATCH: 8 if quick else 60}
    weights_bytes = SHAPE_EXPERTS * 4 * shape.expert_params
    out: dict[str, object] = {"experts": SHAPE_EXPERTS, "dtype": "float32", "row_checks": True}
    paths: dict[str, dict[str, dict[str, float]]] = {"gateway": {}, "inprocess": {}}
    with tempfile.TemporaryDirectory(prefix=f"kvasir-bench-{shape.name}-") as tmp, \
            LocalSwarm(pathlib.Path(tmp) / "swarm") as sw:
        say(f"{shape.name}: {SHAPE_EXPERTS} experts of random float32 weights ({weights_bytes / 1e6:.0f} MB), "
            "a TLS gateway, a hub and a worker")
        ckpt = make_bench_checkpoint(pathlib.Path(tmp) / "expert", experts=SHAPE_EXPERTS, inter=shape.intermediate,
                                     hidden=shape.hidden, gpt_oss=shape.name.startswith("gpt-oss"))
        sw.start_gateway()
        sw.start_hub(gateway=True)
        sw.start_worker("worker", ckpt, f"0:0-{SHAPE_EXPERTS - 1}", via="gateway")
        session = sw.wait_sessions(1, timeout=300, watch=["gateway", "worker"])[0]
        index = ExpertIndex(ckpt)
        experts = [index.load(0, e) for e in range(SHAPE_EXPERTS)]
        biases = [index.biases(0, e) for e in range(SHAPE_EXPERTS)]
        fn = index.function
        meta = ((TARGET_KEY_METADATA, target_key(sw.backbone_token, session.session_id)),)
        stream = _RawStream(session.target, meta, timeout=600 + 20 * budget_s)
        g = torch.Generator().manual_seed(3)
        try:
            for batch in SHAPE_BATCHES:
                segments = shape_segments(batch)
                hidden = torch.randn(batch, shape.hidden, generator=g)  # [rows, H]
                weights = torch.rand(batch, generator=g)  # [rows]
                request = serialize_dispatch_request(WIRE_CALL_ID, 0, hidden, weights, segments, projections=True)

                def compute() -> None:
                    start = 0
                    for e, rows in segments:
                        gate_up, down = experts[e]
                        expert_forward(hidden[start:start + rows], gate_up, down, fn, weights[start:start + rows],
                                       biases[e])
                        start += rows

                def call() -> bytes:
                    answer = stream.call(request)
                    if not isinstance(answer, bytes):
                        raise SwarmError(f"{shape.name}: the stream answered {type(answer).__name__}, not bytes")
                    return answer

                answer = call()  # also warms up the connection and the worker
                partials = expert_pb2.DispatchResponse.FromString(answer).partials
                expected = len(serialize_dispatch_response(
                    WIRE_CALL_ID, torch.zeros(batch, shape.hidden), partials.compute_micros,
                    torch.zeros(batch, 2 * shape.intermediate)))
                if len(answer) != expected:
                    raise SwarmError(f"{shape.name}: the worker's answer to {batch} rows is {len(answer)} bytes, "
                                     f"not the {expected} the wire figures count")
                for _ in range(2):
                    call()
                remote = _timed(call, most=most[batch], budget_s=budget_s)
                local = _timed(compute, most=most[batch], budget_s=budget_s)
                payload = len(request) + len(answer)
                paths["gateway"][str(batch)] = {**_summary(remote, batch, payload, in_flight_rows_s=None),
                                                "calls": len(remote), "request_bytes": len(request),
                                                "answer_bytes": len(answer)}
                inproc = _summary(local, batch, payload, in_flight_rows_s=None)
                del inproc["mb_s"]  # nothing moves
                paths["inprocess"][str(batch)] = {**inproc, "calls": len(local)}
                say(f"  batch {batch}: gateway p50 {paths['gateway'][str(batch)]['p50_ms']} ms, "
                    f"in process {inproc['p50_ms']} ms")
            rss = psutil.Process(sw.pid("worker")).memory_info().rss
        finally:
            stream.close()
    out.update(paths)
    gw, ip = paths["gateway"], paths["inprocess"]
    out["ratios"] = {f"gateway_over_inprocess_rows_s_b{b}": round(gw[str(b)]["rows_s"] / ip[str(b)]["rows_s"], 3)
                     for b in SHAPE_BATCHES}
    out["figures"] = {
        **{f"gateway_added_ms_b{b}": round(gw[str(b)]["p50_ms"] - ip[str(b)]["p50_ms"], 3) for b in SHAPE_BATCHES},
        "worker_rss_bytes": rss, "worker_weights_bytes": weights_bytes,
    }
    return out


def run_shape_bench(name: str, *, quick: bool = False, say: Callable[[str], None] = print) -> dict[str, object]:
    """``kvasir bench --shape NAME``: for each shape :func:`shapes_named` gives, its wire
    figures (:func:`shape_wire`), its memory figures (:func:`memory_figures`) and its
    dispatch through the gateway against the kernel alone (:func:`shape_dispatch`), each
    shape's table said as soon as it is measured. Raises ValueError for an unknown name
    before anything starts."""
    shapes = shapes_named(name)
    out: dict[str, object] = {"compute": COMPUTE_NOTE, "quick": quick, "batches": list(SHAPE_BATCHES),
                              "swarm_sizes": list(SWARM_SIZES), "units": "bytes; MB, GB and TB are 10^6, 10^9, 10^12",
                              "machine": {"cpus": os.cpu_count(), "torch_threads": 1}}
    results: dict[str, dict[str, object]] = {}
    for shape in shapes:
        result: dict[str, object] = {"shape": {**asdict(shape), "expert_params": shape.expert_params},
                                     "wire": shape_wire(shape), "memory": memory_figures(shape)}
        dispatch = shape_dispatch(shape, quick=quick, say=say)
        result["ratios"] = dispatch.pop("ratios")
        result["figures"] = dispatch.pop("figures")
        result["dispatch"] = dispatch
        results[shape.name] = result
        say(shape_table(result))
    out["shapes"] = results
    return out


def _si(n: float) -> str:
    """Bytes in decimal units: 1.31 TB, 88.1 MB, 459 KB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if n / scale < 100 else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"


def shape_table(result: Mapping[str, object]) -> str:
    """One shape's result of :func:`run_shape_bench` as text: the shape, its wire bytes, its
    memory and its dispatch figures."""
    s: dict = result["shape"]  # type: ignore[type-arg, assignment]
    wire: dict = result["wire"]  # type: ignore[type-arg, assignment]
    mem: dict = result["memory"]  # type: ignore[type-arg, assignment]
    layers, big = s["moe_layers"], f"b{SHAPE_BATCH}"
    lines = [f"{s['name']} ({', '.join(s['releases'])}): hidden {s['hidden']}, expert intermediate "
             f"{s['intermediate']}, {layers} MoE layers of {s['experts']} experts, top-{s['top_k']}; experts "
             f"released in {s['released']}"]
    if s["note"]:
        lines.append(f"  {s['note']}")
    lines.append(f"  {'wire bytes, request + answer':<34}{'1-row call':>13}{f'per row of {SHAPE_BATCH}':>16}"
                 f"{'per token/layer':>17}{f'per token, {layers} layers':>22}")
    for dtype in WIRE_DTYPES:
        for suffix, label in (("", dtype), ("_row_checks", f"{dtype}, row checks")):
            one, many = wire[dtype]["b1"], wire[dtype][big]
            lines.append(f"    {label:<32}{one[f'bytes_per_row{suffix}']:>13,.0f}"
                         f"{many[f'bytes_per_row{suffix}']:>16,.1f}{one[f'bytes_per_token_per_layer{suffix}']:>17,.0f}"
                         f"{_si(one[f'bytes_per_token{suffix}']):>22}")
    lines.append("    (per token: each of a token's experts in a call of its own; its row once per expert)")
    per, model = mem["bytes_per_expert"], mem["model_bytes"]
    lines.append(f"  memory per expert (gate_up + down): {_si(per['bfloat16'])} bfloat16, {_si(per['float32'])} "
                 f"float32, {_si(per['released'])} as released ({s['released']}); the model's "
                 f"{mem['experts_in_model']:,} experts: {_si(model['bfloat16'])} bfloat16")
    lines.append("  a worker holding 1/N of them (bfloat16): " + ", ".join(
        f"N={n}: {w['experts']:,} experts, {_si(w['bfloat16_bytes'])}" for n, w in mem["per_worker"].items()))
    figures: dict = result["figures"]  # type: ignore[type-arg, assignment]
    dispatch: dict = result["dispatch"]  # type: ignore[type-arg, assignment]
    lines.append(f"  worker process holding {SHAPE_EXPERTS} float32 experts ({_si(figures['worker_weights_bytes'])}): "
                 f"{_si(figures['worker_rss_bytes'])} resident")
    lines.append(f"  {'dispatch, float32, row checks on':<34}{'p50 ms':>9}{'p90 ms':>9}{'rows/s':>11}"
                 f"{'kernel p50 ms':>15}{'rows/s':>11}{'gateway/kernel':>16}")
    ratios: dict = result["ratios"]  # type: ignore[type-arg, assignment]
    for b in SHAPE_BATCHES:
        gw, ip = dispatch["gateway"][str(b)], dispatch["inprocess"][str(b)]
        label = f"batch {b}" + (f" ({SHAPE_EXPERTS} experts)" if b > 1 else "")
        lines.append(f"    {label:<32}{gw['p50_ms']:>9}{gw['p90_ms']:>9}{gw['rows_s']:>11,.0f}{ip['p50_ms']:>15}"
                     f"{ip['rows_s']:>11,.0f}{ratios[f'gateway_over_inprocess_rows_s_b{b}']:>16}")
    return "\n".join(lines)
