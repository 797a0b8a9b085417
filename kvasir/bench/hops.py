"""The fabric's cost by hop (``kvasir bench --hops``; ``hops`` in the full bench): CPU nanoseconds
per byte of each process a Dispatch call crosses, and each hop's floor.
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable

from kvasir.bench._checkpoint import HIDDEN, make_bench_checkpoint
from kvasir.bench._streams import _pct, _Stream

HOP_BATCH = 512
# Each path measured this many times, in alternating order, and the CPU summed.
HOP_ROUNDS = 3
# The processes a Dispatch call crosses on each path, from the backbone's side. ``direct``: the
# same call straight to the hub path's worker's own gRPC port (``--direct-grpc``), no tunnel:
# what grpcio and the servicer cost the client and the worker alone. ``relay``: the direct call
# through the bare trio relay (``kvasir.bench.trio_relay``): what any trio relay pays for these
# bytes, the hub's and the gateway's work taken out.
HOP_PATHS = {"hub": ("client", "hub", "worker"), "gateway": ("client", "hub", "gateway", "worker"),
             "fabric": ("client", "hub", "gateway", "worker"), "direct": ("client", "worker"),
             "relay": ("client", "relay", "worker")}


@dataclasses.dataclass
class _Tally:
    """One path's calls summed over the rounds: CPU seconds by process, each call's wall time,
    the bytes the hub metered, the wall time measured."""

    cpu: dict[str, float] = dataclasses.field(default_factory=dict)
    times: list[float] = dataclasses.field(default_factory=list)
    wire: int = 0
    wall: float = 0.0


def run_hop_bench(*, quick: bool = False, say: Callable[[str], None] = print) -> dict[str, object]:
    """CPU nanoseconds per byte of each process a Dispatch call crosses, at batch 512.

    One swarm: a TLS gateway, a hub, a worker that dials the hub (path ``hub``, plain ws), one
    that dials the gateway (``gateway``, sealed end to end) and one that dials the gateway with
    ``--echo-experts`` (``fabric``: the relays without compute); the hub's worker also
    serves its gRPC port directly (``direct``: no tunnel, no relay), and through the bare trio
    relay (``relay``: the cheapest relay on trio, as a bound on the hub's and the gateway's
    figures, ``{hub,gateway}_over_relay`` under ``relay``). This process is the
    backbone's client side (a grpcio stream, as the backbone's). Each hop's CPU time over the
    same calls (every thread, from /proc) is divided by the same byte count: the tensor
    payload of those calls, request rows and weights plus the partials. On the ``hub`` and
    ``gateway`` paths the worker's figure has the in-process compute time of the same calls
    subtracted (the fabric path's worker computes nothing). Every path is measured in
    ``HOP_ROUNDS`` rounds (the order reversed every other round) and its CPU summed over
    them, so that the machine's drift during the run falls on every path alike. Also the
    fabric path's latency at batch 1."""
    import torch

    from kvasir.bench.cpu import CpuMeter, ns_per_byte
    from kvasir.swarm import LocalSwarm, free_port
    from kvasir_rpc import (
        TARGET_KEY_METADATA,
        ExpertIndex,
        encode_tensor,
        expert_forward,
        expert_pb2,
        get_activation,
        target_key,
    )

    torch.set_num_threads(1)
    n = 10 if quick else 25  # calls per path and round
    rounds = 1 if quick else HOP_ROUNDS
    out: dict[str, object] = {"batch": HOP_BATCH, "calls": n * rounds, "rounds": rounds, "hidden": HIDDEN,
                              "dtype": "float32",
                              "bytes": "tensor payload: request hidden + weights + response partials",
                              "client": "this process (grpcio stream), time.process_time()"}
    with tempfile.TemporaryDirectory(prefix="kvasir-bench-hops-") as tmp, LocalSwarm(tmp) as sw:
        ckpt = make_bench_checkpoint(pathlib.Path(tmp) / "expert")
        gate_up, down = ExpertIndex(ckpt).load(0, 0)
        act = get_activation("silu")
        say("hops: TLS gateway, hub, a worker on the hub, one on the gateway and an --echo-experts one")
        sw.start_gateway()
        sw.start_hub(gateway=True)
        # The echo worker holds expert 1, the others expert 0: their sessions are told apart so.
        direct_port = free_port()
        sw.start_worker("worker_hub", ckpt, "0:0", via="hub", extra=["--direct-grpc", f"127.0.0.1:{direct_port}"])
        sw.start_worker("worker_gateway", ckpt, "0:0", via="gateway")
        sw.start_worker("worker_echo", ckpt, "0:1", via="gateway", extra=["--echo-experts"])
        relay_port = sw.start_trio_relay("relay", direct_port)
        sessions = sw.wait_sessions(3, watch=["gateway", "worker_hub", "worker_gateway", "worker_echo"])
        by_path = {}
        for s in sessions:
            through_gateway = s.remote_address.startswith("gateway:")
            path = "fabric" if s.slices[0].experts[0] == 1 else ("gateway" if through_gateway else "hub")
            by_path[path] = s
        worker_of = {"hub": "worker_hub", "gateway": "worker_gateway", "fabric": "worker_echo", "direct": "worker_hub",
                     "relay": "worker_hub"}
        token = sw.backbone_token

        def metered(path: str) -> int:
            if path in ("direct", "relay"):
                return 0  # no session: nothing metered
            return sum(int(s.bytes_to_worker + s.bytes_from_worker) for s in sw.list_sessions()
                       if s.session_id == by_path[path].session_id)

        g = torch.Generator().manual_seed(2)
        for batch in (HOP_BATCH, 1):
            hidden = torch.randn(batch, HIDDEN, generator=g)
            weights = torch.rand(batch, generator=g)
            payload = (2 * hidden.numel() + weights.numel()) * 4
            paths = ("fabric", "gateway", "hub", "direct", "relay") if batch == HOP_BATCH else ("fabric",)
            # Each path's calls in rounds, the order reversed every other round, summed: the
            # machine's drift over the run falls on every path alike.
            acc = {p: _Tally() for p in paths}
            compute_s = 0.0
            for r in range(rounds if batch == HOP_BATCH else 1):
                if batch == HOP_BATCH:
                    c0 = time.process_time()
                    for _ in range(n):
                        expert_forward(hidden, gate_up, down, act, weights)
                    compute_s += time.process_time() - c0
                for path in (paths if r % 2 == 0 else paths[::-1]):
                    req = expert_pb2.DispatchRequest(
                        call_id=1, layer=0, hidden=encode_tensor(hidden), weights=encode_tensor(weights),
                        segments=[expert_pb2.ExpertSegment(expert=1 if path == "fabric" else 0, rows=batch)])
                    if path in ("direct", "relay"):
                        stream = _Stream(f"127.0.0.1:{direct_port if path == 'direct' else relay_port}", ())
                    else:
                        meta = ((TARGET_KEY_METADATA, target_key(token, by_path[path].session_id)),)
                        stream = _Stream(by_path[path].target, meta)
                    a = acc[path]
                    try:
                        for _ in range(3):
                            stream.call(req)  # warm up the connection and the worker
                        pids: dict[str, int | None] = {"client": None, "worker": sw.pid(worker_of[path]),
                                                       "hub": sw.pid("hub"), "gateway": sw.pid("gateway"),
                                                       "relay": sw.pid("relay")}
                        before = metered(path)
                        with CpuMeter(pids) as meter:
                            for _ in range(n):
                                t0 = time.perf_counter()
                                stream.call(req)
                                a.times.append(time.perf_counter() - t0)
                        a.wire += metered(path) - before
                    finally:
                        stream.close()
                    for k, v in meter.reading.cpu_s.items():
                        a.cpu[k] = a.cpu.get(k, 0.0) + v
                    a.wall += meter.reading.wall_s
            for path in paths:
                a = acc[path]
                times, cpu = a.times, a.cpu
                med = statistics.median(times)
                if batch == 1:
                    out["fabric_b1"] = {"p50_ms": round(med * 1000, 3), "p90_ms": round(_pct(times, 0.9) * 1000, 3)}
                    continue
                hops = HOP_PATHS[path]
                if path != "fabric":
                    cpu = {**cpu, "worker_with_compute": cpu["worker"], "worker": cpu["worker"] - compute_s}
                total = payload * len(times)
                point: dict[str, object] = {
                    "bytes": total, "metered_bytes": a.wire, "wall_s": round(a.wall, 3),
                    "p50_ms": round(med * 1000, 3), "mb_s": round(payload / med / 1e6, 1),
                    "cpu_s": {k: round(v, 4) for k, v in cpu.items() if k in hops or k == "worker_with_compute"},
                    "ns_per_byte": {h: ns_per_byte(cpu[h], total) for h in hops},
                }
                point["ns_per_byte_total"] = ns_per_byte(sum(cpu[h] for h in hops), total)
                if path != "fabric":
                    point["worker_compute_s"] = round(compute_s, 4)
                out[path] = point
                say(f"  {path}: " + ", ".join(f"{h} {v} ns/B" for h, v in point["ns_per_byte"].items())  # type: ignore[attr-defined]
                    + f"; {point['mb_s']} MB/s")
    direct = out.get("direct")
    if isinstance(direct, dict):
        # What the tunnel and the relays add to each end over grpcio alone (the direct call).
        for path in ("hub", "gateway", "fabric"):
            measured = out.get(path)
            if isinstance(measured, dict):
                ours, alone = measured["ns_per_byte"], direct["ns_per_byte"]
                measured["ends_over_direct_ns_per_byte"] = {
                    h: round(ours[h] - alone[h], 3) for h in ("client", "worker")
                    if ours.get(h) is not None and alone.get(h) is not None}
    add_floors(out, say=say)
    return out


def add_floors(hops: dict[str, object], *, say: Callable[[str], None] = print) -> None:
    """Put under ``hops`` each hop's floor (``kvasir.bench.floors``: what its kernel copies,
    TLS, end-to-end AEAD and masking alone cost per byte on this machine, measured now) and,
    per path, ``floor_ns_per_byte`` and ``over_floor`` (measured / floor) by hop."""
    from kvasir.bench.floors import hop_floors, measure_primitives

    say("hops: the primitives' CPU ns per byte (sockets, TLS, AEADs, mask), for each hop's floor")
    primitives = measure_primitives(runs=5)  # the median of 5: a floor that holds still from run to run
    hops["primitives"] = primitives
    floors = hop_floors(primitives)
    for path, point in hops.items():
        if path not in HOP_PATHS or not isinstance(point, dict):
            continue
        floor = floors[path if path in ("hub", "direct", "relay") else "gateway"]
        point["floor_ns_per_byte"] = {h: round(floor[h], 3) for h in point["ns_per_byte"]}
        point["over_floor"] = {h: round(v / floor[h], 2) if v is not None else None
                               for h, v in point["ns_per_byte"].items()}
    add_trio_bounds(hops, floors)


def add_trio_bounds(hops: dict[str, object], floors: dict[str, dict[str, float]]) -> None:
    """Per path, each relay hop's (hub, gateway) bound on trio: what the bare trio relay
    measured per byte, plus what the hop's floor holds beyond the relay's (its mask, TLS and
    AEAD work), as ``trio_bound_ns_per_byte``, and the hop's figure over it as
    ``over_trio_bound``: how far the hop is from the cheapest relay trio allows."""
    relay = hops.get("relay")
    if not isinstance(relay, dict) or relay["ns_per_byte"].get("relay") is None:
        return
    bare, bare_floor = relay["ns_per_byte"]["relay"], floors["relay"]["relay"]
    for path, point in hops.items():
        if path not in ("hub", "gateway", "fabric") or not isinstance(point, dict):
            continue
        floor = floors[path if path == "hub" else "gateway"]
        bound = {h: bare + floor[h] - bare_floor for h in ("hub", "gateway") if h in point["ns_per_byte"]}
        point["trio_bound_ns_per_byte"] = {h: round(v, 3) for h, v in bound.items()}
        point["over_trio_bound"] = {h: round(point["ns_per_byte"][h] / v, 2) for h, v in bound.items()
                                    if point["ns_per_byte"][h] is not None}


def hop_figures(hops: dict[str, object]) -> dict[str, object]:
    """The hop bench's flat figures: ``{path}_ns_per_byte_{hop}_b512`` and the fabric's MB/s."""
    figures: dict[str, object] = {}
    for path in HOP_PATHS:
        point = hops.get(path)
        if isinstance(point, dict):
            for hop, v in point["ns_per_byte"].items():
                figures[f"{path}_ns_per_byte_{hop}_b512"] = v
            figures[f"{path}_ns_per_byte_total_b512"] = point["ns_per_byte_total"]
            for hop, v in point.get("floor_ns_per_byte", {}).items():
                figures[f"{path}_floor_ns_per_byte_{hop}_b512"] = v
            for hop, v in point.get("over_floor", {}).items():
                figures[f"{path}_over_floor_{hop}_b512"] = v
            for hop, v in point.get("over_trio_bound", {}).items():
                figures[f"{path}_over_trio_bound_{hop}_b512"] = v
    if isinstance(hops.get("fabric"), dict):
        figures["fabric_mb_s_b512"] = hops["fabric"]["mb_s"]  # type: ignore[index]
    if isinstance(hops.get("fabric_b1"), dict):
        figures["fabric_p50_ms_b1"] = hops["fabric_b1"]["p50_ms"]  # type: ignore[index]
    return figures


def hop_table(hops: dict[str, object]) -> str:
    """The hop bench as a text table: ns of CPU per byte, a row per path, a column per hop."""
    cols = ("client", "hub", "gateway", "relay", "worker")
    lines = [f"CPU ns per byte of tensor payload, batch {hops['batch']}, {hops['calls']} calls (floor: what the hop's "
             "socket copies, TLS, end-to-end AEAD and masking alone cost here)",
             "direct: the same call to the worker's own gRPC port, no tunnel (grpcio and the servicer alone); "
             "relay: the same through the bare trio relay; /trio: the hop over that relay's figure plus its "
             "floor's mask, TLS and AEAD",
             f"{'path':<10}" + "".join(f"{c:>10}" for c in cols) + f"{'total':>10}{'MB/s':>10}"]
    for path in HOP_PATHS:
        point = hops.get(path)
        if not isinstance(point, dict):
            continue
        cells = "".join(f"{point['ns_per_byte'].get(c, '-')!s:>10}" for c in cols)
        lines.append(f"{path:<10}{cells}{point['ns_per_byte_total']!s:>10}{point['mb_s']!s:>10}")
        if "floor_ns_per_byte" in point:
            floor = "".join(f"{point['floor_ns_per_byte'].get(c, '-')!s:>10}" for c in cols)
            lines.append(f"{'  floor':<10}{floor}")
        if "over_floor" in point:
            over = "".join(f"{point['over_floor'].get(c, '-')!s:>10}" for c in cols)
            lines.append(f"{'  /floor':<10}{over}")
        if "over_trio_bound" in point:
            over = "".join(f"{point['over_trio_bound'].get(c, '-')!s:>10}" for c in cols)
            lines.append(f"{'  /trio':<10}{over}")
    if isinstance(hops.get("fabric_b1"), dict):
        lines.append(f"fabric p50 at batch 1: {hops['fabric_b1']['p50_ms']} ms")  # type: ignore[index]
    return "\n".join(lines)
