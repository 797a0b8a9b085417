"""The decode bench (``decode`` in the full ``kvasir bench``): aggregate tokens/s of many concurrent
sequences, every expert local against every MoE layer on workers through the gateway at RTT
0, 13 and 50 ms, and against the same placement's fabric-free ceiling at each RTT; what checking
them costs (``checks``); and the CPU each process spent per byte (``decode_hops``).
"""

from __future__ import annotations

import pathlib
import tempfile
import time
from collections.abc import Callable

from kvasir.bench._decode_swarm import DECODE_MODEL, DECODE_WORKERS, _core_split, start_decode_swarm
from kvasir.bench.checks import _audit_cost, row_check_cost

RTTS_MS = (0, 13, 50)


def run_decode_bench(*, quick: bool = False, say: Callable[[str], None] = print) -> dict[str, object]:
    """Aggregate tokens/s of many concurrent sequences: every expert local, against every MoE
    layer's experts on two workers that reach the hub through the TLS gateway over a link
    with an emulated round trip (a latency proxy between the workers and the gateway).
    The remote runs pick their micro-batch groups from measured step times. Processes are
    pinned by :func:`_core_split` where the machine allows it.

    At each RTT the placement's ceiling too (:func:`ceiling_args`): the same experts on
    workers emulated in the backbone's process, threads on the workers' cores behind the same
    emulated round trip, everything but the fabric as in the remote run; its tokens are
    checked against a local decode of the same groups (``--compare-local``)."""
    from kvasir.swarm import LocalSwarm

    batch, tokens = (32, 6) if quick else (128, 16)
    args_common = ["--prompt", "the swarm", "--max-new-tokens", str(tokens), "--batch", str(batch)]
    split = _core_split()
    out: dict[str, object] = {"model": DECODE_MODEL, "batch": batch, "new_tokens": tokens,
                              "cores": None if split is None else {"backbone_and_hub": sorted(split[0]),
                                                                   "gateway_proxy_workers": sorted(split[1])}}
    with tempfile.TemporaryDirectory(prefix="kvasir-bench-decode-") as tmp, LocalSwarm(tmp) as sw:
        model, rtt_file = start_decode_swarm(sw, pathlib.Path(tmp), split, ("backbone",))
        hops: dict[str, object] = {}
        local, hops["local"] = decode_hops(sw, ["--model", str(model), *args_common], hub=False)
        out["local_tokens_per_s"] = local["decode_tokens_per_s"]
        out["local_tokens_per_s_with_prefill"] = local["tokens_per_s"]
        say(f"  local: {local['decode_tokens_per_s']} tokens/s decoding ({local['tokens_per_s']} with the prefill)")
        for rtt in RTTS_MS:
            rtt_file.write_text(str(rtt))
            time.sleep(0.3)  # the proxy re-reads the file every 0.1 s
            remote, hops[f"rtt{rtt}"] = decode_hops(sw, ["--model", str(model), *args_common, "--groups", "auto",
                                                         "--wait-sessions", "2"])
            # Steady decoding, prefill excluded (backbone's decode_tokens_per_s); the figures
            # with the prefill are kept beside it.
            ratio = round(float(remote["decode_tokens_per_s"]) / float(local["decode_tokens_per_s"]), 3)  # type: ignore[arg-type]
            with_prefill = round(float(remote["tokens_per_s"]) / float(local["tokens_per_s"]), 3)  # type: ignore[arg-type]
            point: dict[str, object] = {
                "remote_tokens_per_s": remote["decode_tokens_per_s"], "remote_over_local": ratio,
                "remote_tokens_per_s_with_prefill": remote["tokens_per_s"],
                "remote_over_local_with_prefill": with_prefill,
                "groups": remote["groups"], "groups_reason": remote["groups_reason"],
                "remote_calls": remote["remote_calls"], "fallback_calls": remote["fallback_calls"]}
            say(f"  rtt {rtt} ms: {remote['decode_tokens_per_s']} tokens/s decoding with {remote['groups']} groups "
                f"({ratio} of local; {with_prefill} with the prefill)")
            ceiling = sw.run_backbone(["--model", str(model), *args_common, "--groups", "auto",
                                       *ceiling_args(rtt, split), "--compare-local"], hub=False)
            point.update(ceiling_figures(ceiling, remote, local))
            out[f"rtt{rtt}"] = point
            say(f"  rtt {rtt} ms ceiling: {ceiling['decode_tokens_per_s']} tokens/s decoding with {ceiling['groups']} "
                f"groups (remote {point['remote_over_ceiling']} of it; tokens identical to local: "
                f"{ceiling['tokens_identical']})")
        out["hops"] = hops
        say("  CPU ns per byte the hub metered, RTT 0: " + ", ".join(
            f"{k} {v}" for k, v in hops["rtt0"]["ns_per_byte"].items())  # type: ignore[index]
            + "; latency proxy's share of the CPU: " + ", ".join(
            f"RTT {rtt} ms {hops[f'rtt{rtt}']['latency_proxy_cpu_share']}" for rtt in RTTS_MS))  # type: ignore[index]
        out["audit"] = _audit_cost(sw, model, args_common, groups=int(out["rtt0"]["groups"]), rtt_file=rtt_file,  # type: ignore[index]
                                   say=say)
        out["row_checks"] = row_check_cost(sw, model, args_common, groups=int(out["rtt0"]["groups"]),  # type: ignore[index]
                                           rtt_file=rtt_file, say=say)
    return out


def ceiling_args(rtt_ms: int, split: tuple[frozenset[int], frozenset[int]] | None) -> list[str]:
    """``backbone generate``'s options for the decode placement's fabric-free ceiling at
    ``rtt_ms``: a worker emulated in the backbone's process for each of ``DECODE_WORKERS``,
    holding its experts, on the cores :func:`_core_split` gives the workers."""
    args = [a for experts in DECODE_WORKERS.values() for a in ("--ceiling-worker", experts)]
    args += ["--ceiling-rtt", str(rtt_ms)]
    if split is not None:
        args += ["--ceiling-cpus", ",".join(str(c) for c in sorted(split[1]))]
    return args


def ceiling_figures(ceiling: dict[str, object], remote: dict[str, object],
                    local: dict[str, object]) -> dict[str, object]:
    """One RTT's ceiling figures: its decode rate (prefill excluded), the remote run's and the
    local run's over it, its groups, and whether its tokens are a local decode's."""
    rate = float(ceiling["decode_tokens_per_s"])  # type: ignore[arg-type]
    return {"ceiling_tokens_per_s": ceiling["decode_tokens_per_s"],
            "remote_over_ceiling": round(float(remote["decode_tokens_per_s"]) / rate, 3),  # type: ignore[arg-type]
            "ceiling_over_local": round(rate / float(local["decode_tokens_per_s"]), 3),  # type: ignore[arg-type]
            "ceiling_groups": ceiling["groups"], "ceiling_groups_reason": ceiling["groups_reason"],
            "ceiling_fallback_calls": ceiling["fallback_calls"], "ceiling_hedged_calls": ceiling["hedged_calls"],
            "ceiling_tokens_identical": ceiling["tokens_identical"], "ceiling_verdict": ceiling["verdict"]}


DECODE_RELAYS = ("hub", "gateway", "latency", "worker1", "worker2")


def decode_hops(sw, args: list[str], *, hub: bool = True) -> tuple[dict[str, object], dict[str, object]]:  # type: ignore[no-untyped-def]
    """Run one decode of :func:`start_decode_swarm`'s swarm (``sw.run_backbone(args, hub=hub)``)
    and measure the CPU each process spent on it: ``(backbone's result, hops)``.

    The hub, gateway, latency proxy and workers are read from /proc across the whole run;
    the backbone's whole life from this process's reaped-children usage (import and load
    included), and its decode alone from its own ``cpu_seconds``. Per byte: over the bytes
    the hub metered in the run (tunnel payload both ways, the groups' probe included), the
    backbone's decode over the bytes its dispatcher sent and received in the decode.
    ``latency_proxy_cpu_share``: the proxy's CPU over all of these processes' (the backbone's
    whole life); what emulating the round trip costs the remote run."""
    import resource

    from kvasir.bench.cpu import CpuMeter, ns_per_byte

    def hub_bytes() -> int:
        return sum(int(s.bytes_to_worker + s.bytes_from_worker) for s in sw.list_sessions())

    def children_cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return float(ru.ru_utime + ru.ru_stime)

    before, child0 = hub_bytes(), children_cpu()
    with CpuMeter({name: sw.pid(name) for name in DECODE_RELAYS}) as meter:
        result = sw.run_backbone(args, hub=hub)
    metered = max(0, hub_bytes() - before)
    cpu = {**meter.reading.cpu_s, "workers": meter.reading.cpu_s["worker1"] + meter.reading.cpu_s["worker2"],
           "backbone_process": children_cpu() - child0, "backbone_decode": float(str(result["cpu_seconds"]))}
    backbone_bytes = int(result.get("sent_bytes", 0)) + int(result.get("received_bytes", 0))  # type: ignore[call-overload]
    total = sum(cpu[k] for k in (*DECODE_RELAYS, "backbone_process"))
    hops: dict[str, object] = {
        "wall_s": round(meter.reading.wall_s, 3), "hub_metered_bytes": metered, "backbone_bytes": backbone_bytes,
        "tokens": result["n_tokens"], "cpu_s": {k: round(v, 3) for k, v in cpu.items()},
        "backbone_decode_cpu_ms_per_token": round(cpu["backbone_decode"] * 1000 / int(result["n_tokens"]), 3),  # type: ignore[call-overload]
    }
    if hub:
        hops["ns_per_byte"] = {"backbone_decode": ns_per_byte(cpu["backbone_decode"], backbone_bytes),
                               **{k: ns_per_byte(cpu[k], metered)
                                  for k in ("hub", "gateway", "latency", "workers")}}
        hops["latency_proxy_cpu_share"] = round(cpu["latency"] / total, 4) if total > 0 else None
    return result, hops


def decode_ratios(decode: dict[str, object]) -> dict[str, object]:
    """Flat ratios of :func:`run_decode_bench`'s result at each RTT:
    ``decode_remote_over_local_rtt{rtt}``, ``decode_remote_over_ceiling_rtt{rtt}`` (what the
    fabric leaves of the placement's ceiling) and ``decode_ceiling_over_local_rtt{rtt}``."""
    ratios: dict[str, object] = {}
    for rtt in RTTS_MS:
        point = decode[f"rtt{rtt}"]
        assert isinstance(point, dict)
        ratios[f"decode_remote_over_local_rtt{rtt}"] = point["remote_over_local"]
        ratios[f"decode_remote_over_ceiling_rtt{rtt}"] = point["remote_over_ceiling"]
        ratios[f"decode_ceiling_over_local_rtt{rtt}"] = point["ceiling_over_local"]
    return ratios


def decode_hop_figures(decode: dict[str, object]) -> dict[str, object]:
    """Flat figures of the decode's hops: ``decode_rtt0_ns_per_byte_{hop}`` and the latency
    proxy's share of the CPU at each RTT."""
    hops = decode.get("hops")
    figures: dict[str, object] = {}
    if not isinstance(hops, dict):
        return figures
    for hop, v in hops["rtt0"]["ns_per_byte"].items():
        figures[f"decode_rtt0_ns_per_byte_{hop}"] = v
    for rtt in RTTS_MS:
        figures[f"latency_proxy_cpu_share_rtt{rtt}"] = hops[f"rtt{rtt}"]["latency_proxy_cpu_share"]
    figures["decode_backbone_cpu_ms_per_token_local"] = hops["local"]["backbone_decode_cpu_ms_per_token"]
    figures["decode_backbone_cpu_ms_per_token_rtt0"] = hops["rtt0"]["backbone_decode_cpu_ms_per_token"]
    return figures
