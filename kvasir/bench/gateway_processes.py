"""A gateway's processes (``kvasir bench --gateway-processes``; ``gateway_processes`` in the full
bench): aggregate MB/s through a TLS gateway of one process against ``--processes 2``.
"""

from __future__ import annotations

import os
import pathlib
import tempfile
import time
from collections.abc import Callable

from kvasir.bench._checkpoint import HIDDEN, make_bench_checkpoint
from kvasir.bench._streams import _RawStream

# The relay bench's expert: an intermediate of 8, so computing it costs next to nothing and
# the relays carry the load.
_RELAY_INTER = 8


def _gateway_split(sw, children: list[dict[str, object]]) -> list[int]:  # type: ignore[no-untyped-def]
    """Sessions per gateway process, from each one's /metrics."""
    import re
    import urllib.request

    out = []
    for child in children:
        with urllib.request.urlopen(f"http://127.0.0.1:{child['http_port']}/metrics", timeout=10) as resp:
            found = re.search(r"^kvasir_gateway_sessions (\S+)$", resp.read().decode(), re.MULTILINE)
        out.append(int(float(found.group(1))) if found else 0)
    return out


def _process_tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process and its live children."""
    import psutil

    try:
        root = psutil.Process(pid)
        total = 0.0
        for p in (root, *root.children(recursive=True)):
            t = p.cpu_times()
            total += t.user + t.system
        return total
    except psutil.Error:
        return 0.0


def run_gateway_processes_bench(*, quick: bool = False, workers: int = 4, batch: int = 512,
                                say: Callable[[str], None] = print) -> dict[str, object]:
    """Aggregate MB/s through a TLS gateway run with one process and with two
    (``--processes 2``), same load: ``workers`` workers of an almost free expert (hidden
    2048, so the bytes are the dispatch bench's), each with one caller thread in this process
    keeping two batch-``batch`` calls in flight. With two processes the workers are
    rebalanced (a worker restarted connects again) until each process holds half of them:
    the kernel spreads connections by a hash, and four connections may all land on one.
    Reports MB/s (request tensors + partials), the gateway's CPU per byte, and the cores
    each role used (gateway, hub, workers, callers), so what limits the figure is visible:
    on a 2-core machine every role shares two cores. Nothing is pinned."""
    import threading

    import torch

    from kvasir.swarm import LocalSwarm, SwarmError
    from kvasir_rpc import TARGET_KEY_METADATA, encode_tensor, expert_pb2, target_key

    seconds = 6.0 if quick else 15.0
    out: dict[str, object] = {"workers": workers, "batch": batch, "seconds": seconds, "cpus": os.cpu_count()}
    g = torch.Generator().manual_seed(2)
    hidden, weights = torch.randn(batch, HIDDEN, generator=g), torch.rand(batch, generator=g)
    req = expert_pb2.DispatchRequest(call_id=1, layer=0, hidden=encode_tensor(hidden), weights=encode_tensor(weights),
                                     segments=[expert_pb2.ExpertSegment(expert=0, rows=batch)])
    wire = req.SerializeToString()
    payload = (2 * hidden.numel() + weights.numel()) * 4  # request tensors + partials
    with tempfile.TemporaryDirectory(prefix="kvasir-bench-gwprocs-") as tmp:
        ckpt = make_bench_checkpoint(pathlib.Path(tmp) / "expert", experts=1, inter=_RELAY_INTER)
        for procs in (1, 2):
            with LocalSwarm(pathlib.Path(tmp) / f"p{procs}") as sw:
                say(f"gateway with {procs} process(es): TLS, a hub, {workers} workers, {workers} callers")
                info = sw.start_gateway(processes=procs, http=True)
                sw.start_hub(gateway=True)
                names = [f"worker{i}" for i in range(workers)]
                for name in names:
                    sw.start_worker(name, ckpt, "0:0", via="gateway")
                sessions = sw.wait_sessions(workers, timeout=300, watch=["gateway", *names])
                split = None
                if procs > 1:
                    children = info["children"]  # type: ignore[assignment]
                    split = _gateway_split(sw, children)  # type: ignore[arg-type]
                    for attempt in range(8):
                        if max(split) - min(split) <= workers % procs:
                            break
                        # Restart workers until the split is even: which one sits on the
                        # fuller process is not visible here, so any, in turn.
                        victim = names[attempt % workers]
                        sw.stop_process(victim)
                        sw.start_worker(victim, ckpt, "0:0", via="gateway")
                        deadline = time.monotonic() + 120
                        while len(sw.list_sessions()) < workers or sum(_gateway_split(sw, children)) < workers:  # type: ignore[arg-type]
                            if time.monotonic() > deadline:
                                raise SwarmError(f"{victim} did not come back within 120 s")
                            time.sleep(0.2)
                        split = _gateway_split(sw, children)  # type: ignore[arg-type]
                    sessions = sw.list_sessions()
                    say(f"  sessions per process: {split}")
                streams = [_RawStream(s.target, ((TARGET_KEY_METADATA, target_key(sw.backbone_token, s.session_id)),))
                           for s in sessions]
                try:
                    for stream in streams:
                        answer = stream.call(wire)  # warm up, and check the answer's size
                        if not isinstance(answer, bytes) or len(answer) < hidden.numel() * 4:
                            raise SwarmError(f"the worker answered {len(answer) if isinstance(answer, bytes) else answer}")
                    done = [0] * len(streams)
                    stop_at = [0.0]

                    def caller(i: int) -> None:
                        while time.perf_counter() < stop_at[0]:
                            streams[i].burst(wire, 4, 2)
                            done[i] += 4

                    pids = {"gateway": [sw.procs["gateway"].pid], "hub": [sw.procs["hub"].pid],
                            "workers": [sw.procs[n].pid for n in names]}

                    def role_cpu() -> dict[str, float]:
                        # The gateway's tree (its children with --processes); the callers are
                        # this process alone: its tree is the whole swarm.
                        cpu = {role: sum(_process_tree_cpu(p) for p in ps) for role, ps in pids.items()}
                        cpu["callers"] = time.process_time()
                        return cpu

                    cpu0 = role_cpu()
                    t0 = time.perf_counter()
                    stop_at[0] = t0 + seconds
                    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(len(streams))]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join(timeout=seconds + 120)
                    wall = time.perf_counter() - t0
                    cpu = {role: c - cpu0[role] for role, c in role_cpu().items()}
                finally:
                    for stream in streams:
                        stream.close()
                moved = sum(done) * payload
                mb_s = round(moved / wall / 1e6, 1)
                out[f"processes_{procs}"] = {
                    "mb_s": mb_s, "calls": sum(done), "wall_s": round(wall, 2), "sessions_per_process": split,
                    "gateway_cpu_ns_per_byte": round(cpu["gateway"] * 1e9 / moved, 3) if moved else None,
                    # Each role's CPU per byte moved: what one core of the machine buys of it.
                    "cpu_ns_per_byte": {role: round(c * 1e9 / moved, 3) if moved else None for role, c in cpu.items()},
                    "cores_used": {role: round(c / wall, 2) for role, c in cpu.items()},
                    "load_average_1m": round(os.getloadavg()[0], 2),
                }
                say(f"  {mb_s} MB/s over {sum(done)} calls; cores used "
                    f"{out[f'processes_{procs}']['cores_used']}")  # type: ignore[index]
    one, two = out["processes_1"], out["processes_2"]
    out["gateway_processes_2_over_1_mb_s"] = round(two["mb_s"] / one["mb_s"], 3) if one["mb_s"] else None  # type: ignore[index, operator]
    # What this machine allows at best, from the one-process run's CPU per byte: one process
    # relays at most 1/g bytes a second (one core), two at most 2/g, and all roles together
    # at most cores/t, where g is the gateway's ns/byte and t every role's.
    per_byte = one["cpu_ns_per_byte"]  # type: ignore[index]
    g, t = per_byte["gateway"], sum(per_byte.values())
    if g and t:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        out["gateway_share_of_cpu_per_byte"] = round(g / t, 3)
        out["ceiling_2_over_1_on_this_machine"] = round(min(2 / g, cores / t) / min(1 / g, cores / t), 3)
    return out
