"""``kvasir bench`` (no path named): the dispatch paths side by side, then every other path of
the full run (decode, hops, gateway processes, assist), their ratios and figures together.

Dispatch: one SwiGLU expert (hidden 2048, intermediate 768, float32, like Qwen3-30B-A3B's)
at several batch sizes through the in-process kernel, a direct grpcio call on loopback TCP
(no tunnel), the hub path (worker dials the hub's WebSocket), the gateway path (worker
and hub both dial a TLS gateway; the tunnel sealed end to end, the default) and the same
gateway path with the end-to-end channel off (a hub with ``--e2e off``), for its cost. Medians and p90s per call, rows/s with one and with
several calls in flight, relay MB/s, and metered bytes over tensor payload bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvasir.bench._checkpoint import HIDDEN, make_bench_checkpoint
from kvasir.bench._streams import _Stream, _summary
from kvasir.bench.assist import ASSIST_RTTS_MS, assist_keys, run_assist_bench
from kvasir.bench.decode import decode_hop_figures, decode_ratios, run_decode_bench
from kvasir.bench.gateway_processes import run_gateway_processes_bench
from kvasir.bench.hops import hop_figures, run_hop_bench

BATCHES = (1, 8, 64, 512)
# Calls timed one at a time at each batch (as many again with IN_FLIGHT in flight).
DISPATCH_CALLS = {1: 300, 8: 200, 64: 100, 512: 30}
DISPATCH_CALLS_QUICK = {1: 60, 8: 40, 64: 20, 512: 6}
IN_FLIGHT = 4


@dataclasses.dataclass(frozen=True)
class DispatchPoint:
    """One batch's Dispatch call to expert 0 of layer 0 of the bench checkpoint: its rows and
    weights, the request carrying them, and the tensor payload of a call and its answer in
    bytes (request rows and weights plus the partials)."""

    hidden: Any  # torch.Tensor [batch, HIDDEN], float32
    weights: Any  # torch.Tensor [batch], float32
    request: Any  # expert_pb2.DispatchRequest
    payload: int


def dispatch_point(batch: int, g: Any) -> DispatchPoint:
    """``batch`` random rows and weights from torch generator ``g``, as a :class:`DispatchPoint`."""
    import torch

    from kvasir_rpc import encode_tensor, expert_pb2

    hidden = torch.randn(batch, HIDDEN, generator=g)
    weights = torch.rand(batch, generator=g)
    req = expert_pb2.DispatchRequest(call_id=1, layer=0, hidden=encode_tensor(hidden), weights=encode_tensor(weights),
                                     segments=[expert_pb2.ExpertSegment(expert=0, rows=batch)])
    return DispatchPoint(hidden, weights, req, (hidden.numel() + weights.numel() + hidden.numel()) * 4)


def time_dispatch(stream: _Stream, req: object, *, batch: int, payload: int, n: int, in_flight: int = IN_FLIGHT,
                  meter: Callable[[], int] | None = None) -> tuple[dict[str, float], float | None]:
    """Time ``req`` on ``stream``: 3 calls to warm up the connection and the worker, ``n`` one
    at a time, then ``n`` with ``in_flight`` in flight. Returns the calls' ``_summary`` (p50
    and p90 ms, rows/s and MB/s one at a time, ``rows_s_in_flight``) and, given ``meter`` (the
    bytes the hub metered so far for the stream's session), the bytes metered over the tensor
    payload of the one-at-a-time calls (else None)."""
    for _ in range(3):
        stream.call(req)
    before = meter() if meter is not None else 0
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        stream.call(req)
        times.append(time.perf_counter() - t0)
    wire = (meter() - before) / (payload * n) if meter is not None else None
    secs = stream.burst(req, n, in_flight)
    return _summary(times, batch, payload, in_flight_rows_s=batch * n / secs), wire


def run_bench(*, quick: bool = False, say: Callable[[str], None] = print) -> dict[str, object]:
    import grpc
    import torch

    from kvasir.swarm import LocalSwarm, SwarmError, free_port
    from kvasir_rpc import (
        TARGET_KEY_METADATA,
        ExpertIndex,
        expert_forward,
        get_activation,
        target_key,
    )

    torch.set_num_threads(1)
    calls = DISPATCH_CALLS_QUICK if quick else DISPATCH_CALLS
    paths: dict[str, dict[str, object]] = {}
    wire: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvasir-bench-") as tmp, LocalSwarm(tmp) as sw, \
            LocalSwarm(pathlib.Path(tmp) / "edge-swarm") as edge_sw, \
            LocalSwarm(pathlib.Path(tmp) / "e2e-off-swarm") as off_sw:
        ckpt = make_bench_checkpoint(pathlib.Path(tmp) / "expert")
        index = ExpertIndex(ckpt)
        gate_up, down = index.load(0, 0)
        act = get_activation("silu")
        direct_port = free_port()
        say("starting gateway (TLS), hub and two workers")
        sw.start_gateway()
        sw.start_hub(gateway=True)
        sw.start_worker("worker_hub", ckpt, "0:0", via="hub", extra=["--direct-grpc", f"127.0.0.1:{direct_port}"])
        sw.start_worker("worker_gateway", ckpt, "0:0", via="gateway")
        sessions = sw.wait_sessions(2, watch=["gateway", "worker_hub", "worker_gateway"])
        by_path = {("gateway" if s.remote_address.startswith("gateway:") else "hub"): s for s in sessions}
        # The direct call through the bare trio relay: what one relay on trio adds to a call's
        # latency (two crossings: the request's and the answer's), the bound of the relays' hops.
        relay_port = sw.start_trio_relay("relay", direct_port)
        targets = {"direct": f"127.0.0.1:{direct_port}", "relay": f"127.0.0.1:{relay_port}",
                   "hub": by_path["hub"].target, "gateway": by_path["gateway"].target}
        swarm_of = {"hub": sw, "gateway": sw}
        # The gateway path with the end-to-end channel off: a hub with --e2e off (a swarm of its own).
        say("e2e off: a second gateway and hub (--e2e off), worker with --e2e auto")
        off_sw.start_gateway()
        off_sw.start_hub(gateway=True, extra=["--e2e", "off"])
        off_sw.start_worker("worker_gateway_e2e_off", ckpt, "0:0", via="gateway", extra=["--e2e", "auto"])
        by_path["gateway_e2e_off"] = off_sw.wait_sessions(1, watch=["gateway", "worker_gateway_e2e_off"])[0]
        targets["gateway_e2e_off"] = by_path["gateway_e2e_off"].target
        swarm_of["gateway_e2e_off"] = off_sw
        if not by_path["gateway"].encrypted or by_path["gateway_e2e_off"].encrypted:
            raise SwarmError("the gateway path should be sealed end to end and the --e2e off one not")
        # The edge path: nginx terminates TLS in front of a plain-ws gateway (a second swarm).
        try:
            edge_sw.start_gateway(tls=False)
            edge_sw.start_hub(gateway=True)
            edge_port = edge_sw.start_edge(edge_sw.gateway_port)
            edge_sw.start_worker("worker_edge", ckpt, "0:0", via="gateway", gateway_url=f"wss://127.0.0.1:{edge_port}")
            by_path["edge"] = edge_sw.wait_sessions(1, watch=["gateway", "edge", "worker_edge"])[0]
            targets["edge"] = by_path["edge"].target
            swarm_of["edge"] = edge_sw
            say("edge path: nginx (TLS) in front of a plain-ws gateway")
        except SwarmError as exc:
            say(f"edge path skipped: {exc}")

        session_changes: dict[str, int] = {}

        def renew(path: str) -> str:
            wallet = by_path[path].wallet
            say(f"{path}: session {by_path[path].session_id} is gone; looking for its worker's new one")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                for s in swarm_of[path].list_sessions():
                    if s.wallet == wallet and s.session_id != by_path[path].session_id:
                        by_path[path] = s
                        session_changes[path] = session_changes.get(path, 0) + 1
                        return str(s.target)
                time.sleep(0.2)
            raise SwarmError(f"{path}: the worker did not come back within 60 s")

        def key(path: str) -> tuple[tuple[str, str], ...]:
            """The hub splices a target only for a call that presents the session's key."""
            if path in ("direct", "relay"):
                return ()
            return ((TARGET_KEY_METADATA, target_key(swarm_of[path].backbone_token, by_path[path].session_id)),)

        def metered(path: str) -> int:
            for s in swarm_of[path].list_sessions():
                if s.session_id == by_path[path].session_id:
                    return int(s.bytes_to_worker + s.bytes_from_worker)
            return 0

        g = torch.Generator().manual_seed(1)
        for batch in BATCHES:
            point = dispatch_point(batch, g)
            hidden, weights, req, payload = point.hidden, point.weights, point.request, point.payload
            n = calls[batch]
            # In-process: the same kernel, no network.
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                expert_forward(hidden, gate_up, down, act, weights)
                times.append(time.perf_counter() - t0)
            paths.setdefault("inprocess", {})[str(batch)] = _summary(times, batch, payload, in_flight_rows_s=None)
            for path, target in targets.items():
                try:
                    stream = _Stream(target, key(path))
                except grpc.FutureTimeoutError:
                    # The worker's session was replaced (it reconnected): find its new one.
                    target = targets[path] = renew(path)
                    stream = _Stream(target, key(path))
                try:
                    meter = None if path in ("direct", "relay") else functools.partial(metered, path)
                    summary, wire_ratio = time_dispatch(stream, req, batch=batch, payload=payload, n=n, meter=meter)
                    if wire_ratio is not None:
                        wire.setdefault(path, {})[str(batch)] = round(wire_ratio, 4)
                    paths.setdefault(path, {})[str(batch)] = summary
                finally:
                    stream.close()
            say(f"batch {batch}: " + ", ".join(f"{p} p50 {paths[p][str(batch)]['p50_ms']} ms" for p in paths))  # type: ignore[index]

    def p50(path: str, b: int) -> float:
        return float(paths[path][str(b)]["p50_ms"])  # type: ignore[index]

    def rows(path: str, b: int, key: str = "rows_s") -> float:
        return float(paths[path][str(b)][key])  # type: ignore[index]

    def trio_bound_b1(relays: int) -> float:
        """The p50 at batch 1 of the direct call through ``relays`` bare trio relays."""
        return p50("direct", 1) + relays * (p50("relay", 1) - p50("direct", 1))

    # "The faster of the two gateway paths" for the throughput ratio.
    fast = max((p for p in ("gateway", "edge") if p in paths), key=lambda p: rows(p, 512, "rows_s_in_flight"))
    ratios = {
        "gateway_over_direct_p50_b1": round(p50("gateway", 1) / p50("direct", 1), 3),
        "hub_over_direct_p50_b1": round(p50("hub", 1) / p50("direct", 1), 3),
        # The gateway path crosses three relays (hub, gateway, the worker's tunnel to its gRPC
        # server), each at least what the bare trio relay adds to the direct call.
        "gateway_over_trio_bound_p50_b1": round(p50("gateway", 1) / trio_bound_b1(3), 3),
        "trio_bound_over_direct_p50_b1": round(trio_bound_b1(3) / p50("direct", 1), 3),
        "gateway_over_inprocess_rows_b512": round(rows(fast, 512, "rows_s_in_flight") / rows("inprocess", 512), 3),
        "direct_over_inprocess_rows_b512": round(rows("direct", 512) / rows("inprocess", 512), 3),
        "wire_over_payload_b64": wire["gateway"]["64"],
        "gateway_e2e_on_over_off_p50_b1": round(p50("gateway", 1) / p50("gateway_e2e_off", 1), 3),
        "gateway_e2e_on_over_off_mb_s_b512": round(float(paths["gateway"]["512"]["mb_s"])  # type: ignore[index]
                                                   / float(paths["gateway_e2e_off"]["512"]["mb_s"]), 3),  # type: ignore[index]
    }
    figures = {
        "gateway_added_ms_b1": round(p50("gateway", 1) - p50("direct", 1), 3),
        "hub_added_ms_b1": round(p50("hub", 1) - p50("direct", 1), 3),
        "trio_relay_added_ms_b1": round(p50("relay", 1) - p50("direct", 1), 3),
        "gateway_tls_mb_s_b512": paths["gateway"]["512"]["mb_s"],  # type: ignore[index]
        "gateway_e2e_on_p50_ms_b1": p50("gateway", 1),
        "gateway_e2e_off_p50_ms_b1": p50("gateway_e2e_off", 1),
        "gateway_e2e_on_mb_s_b512": paths["gateway"]["512"]["mb_s"],  # type: ignore[index]
        "gateway_e2e_off_mb_s_b512": paths["gateway_e2e_off"]["512"]["mb_s"],  # type: ignore[index]
        "gateway_edge_mb_s_b512": paths["edge"]["512"]["mb_s"] if "edge" in paths else None,  # type: ignore[index]
        "faster_gateway_path": fast,
        "hub_mb_s_b512": paths["hub"]["512"]["mb_s"],  # type: ignore[index]
        "direct_mb_s_b512": paths["direct"]["512"]["mb_s"],  # type: ignore[index]
    }
    say("decode: all experts local vs every MoE layer on workers through the gateway and its fabric-free ceiling, "
        "RTT 0/13/50 ms")
    decode = run_decode_bench(quick=quick, say=say)
    ratios.update(decode_ratios(decode))  # type: ignore[arg-type]
    ratios["decode_audits_on_over_off_rtt0"] = decode["audit"]["on_over_off"]  # type: ignore[index]
    ratios["decode_row_checks_on_over_off_rtt0"] = decode["row_checks"]["on_over_off"]  # type: ignore[index]
    ratios["row_checks_wire_bytes_on_over_off"] = decode["row_checks"]["wire_bytes_on_over_off"]  # type: ignore[index]
    figures["row_check_us_per_row"] = decode["row_checks"]["row_check_us_per_row"]  # type: ignore[index]
    figures.update(decode_hop_figures(decode))
    say("hops: CPU ns per byte of each process a batch-512 Dispatch call crosses")
    hops = run_hop_bench(quick=quick, say=say)
    figures.update(hop_figures(hops))
    figures["session_changes"] = session_changes  # workers that reconnected mid-run (should be empty)
    say("gateway processes: aggregate MB/s through a TLS gateway, 1 process vs --processes 2")
    gateway_processes = run_gateway_processes_bench(quick=quick, say=say)
    ratios["gateway_processes_2_over_1_mb_s"] = gateway_processes["gateway_processes_2_over_1_mb_s"]  # type: ignore[assignment]
    figures["gateway_processes_1_mb_s_b512"] = gateway_processes["processes_1"]["mb_s"]  # type: ignore[index]
    figures["gateway_processes_2_mb_s_b512"] = gateway_processes["processes_2"]["mb_s"]  # type: ignore[index]
    figures["gateway_processes_ceiling_2_over_1"] = gateway_processes.get("ceiling_2_over_1_on_this_machine")
    say("one stream: plain greedy vs --assist lookup, every MoE layer through the gateway, RTT 13/50 ms")
    assist = run_assist_bench(quick=quick, say=say)
    figures.update(assist_keys(assist))
    for rtt in ASSIST_RTTS_MS:
        ratios[f"assist_over_plain_rtt{rtt}"] = assist[f"rtt{rtt}"]["assist_over_plain"]  # type: ignore[index]
    return {"dispatch": paths, "wire": wire, "decode": decode, "hops": hops, "assist": assist, "ratios": ratios,
            "figures": figures, "gateway_processes": gateway_processes,
            "machine": {"cpus": os.cpu_count(), "torch_threads": 1}, "quick": quick}
