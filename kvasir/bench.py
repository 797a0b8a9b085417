"""``kvasir bench``: the paths side by side in one run, reported as ratios.

Dispatch: one SwiGLU expert (hidden 2048, intermediate 768, float32, like Qwen3-30B-A3B's)
at several batch sizes through the in-process kernel, a direct grpcio call on loopback TCP
(no tunnel), the hub path (worker dials the hub's WebSocket), the gateway path (worker
and hub both dial a TLS gateway; the tunnel sealed end to end, the default) and the same
gateway path with the end-to-end channel off (a hub with ``--e2e off``), for its cost. Medians and p90s per call, rows/s with one and with
several calls in flight, relay MB/s, and metered bytes over tensor payload bytes.

Everything runs on this machine at once, so absolute figures move between runs; the
ratios between paths measured in the same run are what to compare.

Real shapes (``kvasir bench --shape NAME``): the widths of released models (SHAPES), to size a
swarm: bytes on the wire per token, a worker's memory per expert, and calls at those widths
through the gateway path against the kernel alone.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import queue
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass

__all__ = ["run_bench", "make_bench_checkpoint", "run_assist_bench", "run_gateway_processes_bench", "run_shape_bench",
           "SHAPES", "ReleaseShape"]

HIDDEN, INTER = 2048, 768
BATCHES = (1, 8, 64, 512)


def make_bench_checkpoint(directory: pathlib.Path, *, experts: int = 2, inter: int = INTER,
                          hidden: int = HIDDEN, gpt_oss: bool = False) -> pathlib.Path:
    """One MoE layer of ``experts`` float32 experts of random weights, per-expert tensors, in
    ``directory`` (made if absent); returns it. By default two of Qwen3-30B-A3B's expert shape
    (38 MB). ``hidden`` is the width of a row on the wire; a small ``inter`` makes computing
    an expert cost next to nothing. ``gpt_oss``: gpt-oss's experts instead (fused tensors stored
    transposed, biases, its clamped SwiGLU over interleaved outputs). The tensors are all in
    memory once while it writes them."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config: dict[str, object] = {"model_type": "gpt_oss" if gpt_oss else "qwen3_moe", "num_hidden_layers": 1, "num_experts": experts,
              "hidden_size": hidden, "moe_intermediate_size": inter, "hidden_act": "silu", "dtype": "float32"}
    if gpt_oss:
        config.update(swiglu_alpha=1.702, swiglu_limit=7.0)
    (directory / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    tensors = {}
    if gpt_oss:
        p = "model.layers.0.mlp.experts"
        tensors[f"{p}.gate_up_proj"] = torch.randn(experts, hidden, 2 * inter, generator=g).mul_(0.02)
        tensors[f"{p}.gate_up_proj_bias"] = torch.randn(experts, 2 * inter, generator=g).mul_(0.02)
        tensors[f"{p}.down_proj"] = torch.randn(experts, inter, hidden, generator=g).mul_(0.02)
        tensors[f"{p}.down_proj_bias"] = torch.randn(experts, hidden, generator=g).mul_(0.02)
    for e in range(0 if gpt_oss else experts):
        p = f"model.layers.0.mlp.experts.{e}"
        tensors[f"{p}.gate_proj.weight"] = torch.randn(inter, hidden, generator=g).mul_(0.02)
        tensors[f"{p}.up_proj.weight"] = torch.randn(inter, hidden, generator=g).mul_(0.02)
        tensors[f"{p}.down_proj.weight"] = torch.randn(hidden, inter, generator=g).mul_(0.02)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class _Stream:
    """One Dispatch stream; ``call`` is a blocking round trip, ``burst`` keeps k in flight."""

    def __init__(self, target: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        import grpc

        from kvasir_rpc import expert_pb2_grpc

        self.channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 256 << 20),
                                                             ("grpc.max_send_message_length", 256 << 20)])
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.responses = expert_pb2_grpc.ExpertServiceStub(self.channel).Dispatch(self._iter(), metadata=metadata)

    def _iter(self) -> Iterator[object]:
        while True:
            item = self.q.get()
            if item is None:
                return
            yield item

    def call(self, req: object) -> object:
        self.q.put(req)
        return next(self.responses)

    def burst(self, req: object, n: int, k: int) -> float:
        """Send n calls keeping k in flight; seconds taken."""
        t0 = time.perf_counter()
        sent = 0
        for _ in range(min(k, n)):
            self.q.put(req)
            sent += 1
        for _ in range(n):
            next(self.responses)
            if sent < n:
                self.q.put(req)
                sent += 1
        return time.perf_counter() - t0

    def close(self) -> None:
        self.q.put(None)
        self.responses.cancel()
        self.channel.close()


def run_bench(*, quick: bool = False, say: Callable[[str], None] = print) -> dict[str, object]:
    import grpc
    import torch

    from kvasir.swarm import LocalSwarm, SwarmError, free_port
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
    calls = {1: 60, 8: 40, 64: 20, 512: 6} if quick else {1: 300, 8: 200, 64: 100, 512: 30}
    in_flight = 4
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
        targets = {"direct": f"127.0.0.1:{direct_port}", "hub": by_path["hub"].target,
                   "gateway": by_path["gateway"].target}
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
            if path == "direct":
                return ()
            return ((TARGET_KEY_METADATA, target_key(swarm_of[path].backbone_token, by_path[path].session_id)),)

        def metered(path: str) -> int:
            for s in swarm_of[path].list_sessions():
                if s.session_id == by_path[path].session_id:
                    return int(s.bytes_to_worker + s.bytes_from_worker)
            return 0

        g = torch.Generator().manual_seed(1)
        for batch in BATCHES:
            hidden = torch.randn(batch, HIDDEN, generator=g)
            weights = torch.rand(batch, generator=g)
            req = expert_pb2.DispatchRequest(call_id=1, layer=0, hidden=encode_tensor(hidden),
                                             weights=encode_tensor(weights),
                                             segments=[expert_pb2.ExpertSegment(expert=0, rows=batch)])
            payload = (hidden.numel() + weights.numel() + hidden.numel()) * 4  # request tensors + partials
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
                    for _ in range(3):
                        stream.call(req)  # warm up the connection and the worker
                    before = metered(path) if path != "direct" else 0
                    times = []
                    for _ in range(n):
                        t0 = time.perf_counter()
                        stream.call(req)
                        times.append(time.perf_counter() - t0)
                    if path != "direct":
                        wire.setdefault(path, {})[str(batch)] = round((metered(path) - before) / (payload * n), 4)
                    secs = stream.burst(req, n, in_flight)
                    paths.setdefault(path, {})[str(batch)] = _summary(times, batch, payload,
                                                                      in_flight_rows_s=batch * n / secs)
                finally:
                    stream.close()
            say(f"batch {batch}: " + ", ".join(f"{p} p50 {paths[p][str(batch)]['p50_ms']} ms" for p in paths))  # type: ignore[index]

    def p50(path: str, b: int) -> float:
        return float(paths[path][str(b)]["p50_ms"])  # type: ignore[index]

    def rows(path: str, b: int, key: str = "rows_s") -> float:
        return float(paths[path][str(b)][key])  # type: ignore[index]

    # "The faster of the two gateway paths" for the throughput ratio.
    fast = max((p for p in ("gateway", "edge") if p in paths), key=lambda p: rows(p, 512, "rows_s_in_flight"))
    ratios = {
        "gateway_over_direct_p50_b1": round(p50("gateway", 1) / p50("direct", 1), 3),
        "hub_over_direct_p50_b1": round(p50("hub", 1) / p50("direct", 1), 3),
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
    say("decode: all experts local vs every MoE layer on workers through the gateway, RTT 0/13/50 ms")
    decode = run_decode_bench(quick=quick, say=say)
    for rtt in RTTS_MS:
        ratios[f"decode_remote_over_local_rtt{rtt}"] = decode[f"rtt{rtt}"]["remote_over_local"]  # type: ignore[index]
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


RTTS_MS = (0, 13, 50)
# One MoE layer's shapes as Qwen3-30B-A3B's (hidden 2048, 32/4 heads of 128 there, here
# 16/4; expert intermediate 768), with 8 experts of which 2 per token and 2 layers: compute
# per layer is what hides a round trip, and a toy hidden size would leave nothing to hide
# it behind (at hidden 512, 64 sequences computed a whole step in ~50 ms locally, less than
# one 50 ms round trip per MoE layer). 300 MB of float32 experts.
DECODE_MODEL = {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
                "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 768, "num_hidden_layers": 2}


def _core_split() -> tuple[frozenset[int], frozenset[int]] | None:
    """(backbone host, elsewhere): the backbone and its hub get one core, the gateway, the
    latency proxy and the workers the rest, so "remote" experts are computed on other
    cores, as on other machines, and the local run has the backbone's core alone."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None
    if len(cpus) < 2 or shutil.which("taskset") is None:
        return None
    return frozenset(cpus[:1]), frozenset(cpus[1:])


def start_decode_swarm(sw, tmp: pathlib.Path, split: tuple[frozenset[int], frozenset[int]] | None,  # type: ignore[no-untyped-def]
                       backbones: tuple[str, ...]) -> tuple[pathlib.Path, pathlib.Path]:
    """The decode benches' swarm in ``sw``: the DECODE_MODEL checkpoint, a TLS gateway, a hub,
    and two workers (half the experts each) that reach the gateway through a latency proxy
    whose round trip is the number in the returned file (ms). With ``split``, the processes
    named ``backbones`` and the hub get the first cores, the rest the others. Returns
    ``(model, rtt_file)``."""
    from kvasir.tiny import make_tiny_checkpoint

    if split is not None:
        sw.default_cpus = split[1]
        for name in (*backbones, "hub"):
            sw.cpus[name] = split[0]
    model = make_tiny_checkpoint(tmp / "model", arch="qwen3_moe", seed=0, overrides=DECODE_MODEL)
    rtt_file = tmp / "rtt_ms"
    sw.start_gateway()
    sw.start_hub(gateway=True)
    proxy = sw.start_latency_proxy("latency", sw.gateway_port, rtt_file)
    half = DECODE_MODEL["num_experts"] // 2
    url = f"wss://127.0.0.1:{proxy}"
    sw.start_worker("worker1", model, f"*:0-{half - 1}", via="gateway", gateway_url=url)
    sw.start_worker("worker2", model, f"*:{half}-{DECODE_MODEL['num_experts'] - 1}", via="gateway", gateway_url=url)
    sw.wait_sessions(2, watch=["gateway", "latency", "worker1", "worker2"])
    return model, rtt_file


def run_decode_bench(*, quick: bool = False, say: Callable[[str], None] = print) -> dict[str, object]:
    """Aggregate tokens/s of many concurrent sequences: every expert local, against every MoE
    layer's experts on two workers that reach the hub through the TLS gateway over a link
    with an emulated round trip (a latency proxy between the workers and the gateway).
    The remote runs pick their micro-batch groups from measured step times. Processes are
    pinned by :func:`_core_split` where the machine allows it."""
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
            out[f"rtt{rtt}"] = {"remote_tokens_per_s": remote["decode_tokens_per_s"], "remote_over_local": ratio,
                                "remote_tokens_per_s_with_prefill": remote["tokens_per_s"],
                                "remote_over_local_with_prefill": with_prefill,
                                "groups": remote["groups"], "groups_reason": remote["groups_reason"],
                                "remote_calls": remote["remote_calls"], "fallback_calls": remote["fallback_calls"]}
            say(f"  rtt {rtt} ms: {remote['decode_tokens_per_s']} tokens/s decoding with {remote['groups']} groups "
                f"({ratio} of local; {with_prefill} with the prefill)")
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


def run_checks_bench(*, quick: bool = False, say: Callable[[str], None] = print) -> dict[str, object]:
    """Only what checking the workers costs (``kvasir bench --checks``): on the decode bench's
    swarm, the remote decode at RTT 0 with row checks on and off, and with audits on and off."""
    from kvasir.swarm import LocalSwarm

    batch, tokens = (32, 6) if quick else (128, 16)
    args_common = ["--prompt", "the swarm", "--max-new-tokens", str(tokens), "--batch", str(batch)]
    split = _core_split()
    out: dict[str, object] = {"model": DECODE_MODEL, "batch": batch, "new_tokens": tokens}
    with tempfile.TemporaryDirectory(prefix="kvasir-bench-checks-") as tmp, LocalSwarm(tmp) as sw:
        model, rtt_file = start_decode_swarm(sw, pathlib.Path(tmp), split, ("backbone",))
        rtt_file.write_text("0")
        first = sw.run_backbone(["--model", str(model), *args_common, "--groups", "auto", "--wait-sessions", "2"])
        groups = int(first["groups"])  # type: ignore[call-overload]
        out["row_checks"] = row_check_cost(sw, model, args_common, groups=groups, rtt_file=rtt_file, say=say)
        out["audit"] = _audit_cost(sw, model, args_common, groups=groups, rtt_file=rtt_file, say=say)
    return out


def row_check_cost(sw, model: pathlib.Path, args_common: list[str], *, groups: int,  # type: ignore[no-untyped-def]
                   rtt_file: pathlib.Path, say: Callable[[str], None]) -> dict[str, object]:
    """What checking every row costs, at RTT 0: the same remote decode with ``--row-checks
    off`` and on (the default), alternated twice (this machine is noisy); medians of tokens/s,
    the backbone's CPU time in the row checks per row checked, and the bytes the answers took
    on the wire per remote row, on against off (the projections travel with the partials)."""
    rtt_file.write_text("0")
    time.sleep(0.3)  # the proxy re-reads the file every 0.1 s
    runs: dict[str, list[dict[str, object]]] = {"off": [], "on": []}
    for _ in range(2):
        for mode in ("off", "on"):
            runs[mode].append(sw.run_backbone(["--model", str(model), *args_common, "--groups", str(groups),
                                               "--wait-sessions", "2", "--row-checks", mode]))
    rate = {m: statistics.median(float(r["decode_tokens_per_s"]) for r in rs) for m, rs in runs.items()}  # type: ignore[arg-type]

    def per_row(mode: str, key: str) -> float:
        total = sum(float(str(r[key])) for r in runs[mode])
        rows = sum(int(r["remote_rows"]) for r in runs[mode])  # type: ignore[call-overload]
        return total / rows if rows else 0.0

    on = runs["on"]
    checked = sum(int(r["row_checked_rows"]) for r in on)  # type: ignore[call-overload]
    seconds = sum(float(str(r["row_check_seconds"])) for r in on)
    cpu = sum(float(str(r["cpu_seconds"])) for r in on)
    result: dict[str, object] = {
        "groups": groups,
        "tokens_per_s_row_checks_off": round(rate["off"], 3), "tokens_per_s_row_checks_on": round(rate["on"], 3),
        "on_over_off": round(rate["on"] / rate["off"], 3) if rate["off"] else None,
        "rows_checked": checked, "row_check_seconds": round(seconds, 4),
        "row_check_us_per_row": round(seconds / checked * 1e6, 3) if checked else None,
        "row_check_share_of_backbone_cpu": round(seconds / cpu, 4) if cpu else None,
        "received_bytes_per_row_on": round(per_row("on", "received_bytes"), 1),
        "received_bytes_per_row_off": round(per_row("off", "received_bytes"), 1),
        "sent_bytes_per_row_on": round(per_row("on", "sent_bytes"), 1),
        "sent_bytes_per_row_off": round(per_row("off", "sent_bytes"), 1),
        "refusals": sum(int(r["row_check_refusals"]) for r in on),  # type: ignore[call-overload]
    }
    off_bytes = result["received_bytes_per_row_off"] + result["sent_bytes_per_row_off"]  # type: ignore[operator]
    on_bytes = result["received_bytes_per_row_on"] + result["sent_bytes_per_row_on"]  # type: ignore[operator]
    result["wire_bytes_on_over_off"] = round(on_bytes / off_bytes, 4) if off_bytes else None
    say(f"  row checks: {result['tokens_per_s_row_checks_on']} tokens/s against {result['tokens_per_s_row_checks_off']} "
        f"off ({result['on_over_off']}); {checked} rows checked at {result['row_check_us_per_row']} us each of the "
        f"backbone's CPU; wire bytes per remote row {on_bytes:.0f} against {off_bytes:.0f} "
        f"({result['wire_bytes_on_over_off']})")
    return result


ASSIST_RTTS_MS = (13, 50)
ASSIST_PASSAGE = ("The swarm runs the dense layers here and sends each token's expert work to workers far away; "
                  "a round trip per layer is the price of every token.")


def run_assist_bench(*, quick: bool = False, say: Callable[[str], None] = print) -> dict[str, object]:
    """Single-stream (batch 1) decode tokens/s with every MoE layer on two workers through the
    TLS gateway behind the latency proxy, at RTT 13 and 50 ms: plain greedy decoding against
    ``--assist lookup`` (drafts from the prompt's n-grams, verified in one forward pass per
    step), on a prompt that quotes a passage and asks for it again; and with the model as its
    own draft model (``--assist draft``), where every guess holds: the bound of what one
    verifying pass per step gives. Reports the drafts' acceptance and whether the assisted
    texts equal the plain one. The model's weights are random: it does not quote the passage
    as a trained model would, so lookup's acceptance here is what its own repetitions give."""
    from kvasir.swarm import LocalSwarm

    tokens = 24 if quick else 48
    prompt = f"Passage: {ASSIST_PASSAGE}\nRepeat the passage word for word: {ASSIST_PASSAGE}"
    args_common = ["--prompt", prompt, "--max-new-tokens", str(tokens), "--wait-sessions", "2"]
    split = _core_split()
    out: dict[str, object] = {"model": DECODE_MODEL, "new_tokens": tokens, "assist_tokens": 4, "assist_ngram": 3}
    with tempfile.TemporaryDirectory(prefix="kvasir-bench-assist-") as tmp, LocalSwarm(tmp) as sw:
        model, rtt_file = start_decode_swarm(sw, pathlib.Path(tmp), split, ("backbone",))
        for rtt in ASSIST_RTTS_MS:
            rtt_file.write_text(str(rtt))
            time.sleep(0.3)  # the proxy re-reads the file every 0.1 s
            plain = sw.run_backbone(["--model", str(model), *args_common])
            assisted = sw.run_backbone(["--model", str(model), *args_common, "--assist", "lookup"])
            # The model itself as its own draft (every expert local, so it costs a local decode
            # of the guesses): every guess holds, the bound of what verifying in one pass gives.
            ideal = sw.run_backbone(["--model", str(model), *args_common, "--assist", "draft", "--draft-model",
                                     str(model)])
            p, a = float(plain["decode_tokens_per_s"]), float(assisted["decode_tokens_per_s"])  # type: ignore[arg-type]
            d = float(ideal["decode_tokens_per_s"])  # type: ignore[arg-type]
            # Here the draft is as costly as the model; a real one is 10-100x smaller. Its
            # time taken out, what is left is the verifying passes' rate with free guesses.
            verify_s = (int(ideal["n_tokens"]) - 1) / d - float(ideal["draft_seconds"])  # type: ignore[call-overload, arg-type]
            free = round((int(ideal["n_tokens"]) - 1) / verify_s, 3) if verify_s > 0 else None  # type: ignore[call-overload]
            out[f"rtt{rtt}"] = {
                "plain_tokens_per_s": p, "assist_tokens_per_s": a, "assist_over_plain": round(a / p, 3),
                "ideal_draft_tokens_per_s": d, "ideal_draft_over_plain": round(d / p, 3),
                "ideal_draft_tokens_per_step": ideal["tokens_per_step"],
                "free_draft_tokens_per_s": free, "free_draft_over_plain": round(free / p, 3) if free else None,
                "ideal_draft_texts_identical": plain["texts"] == ideal["texts"],
                "texts_identical": plain["texts"] == assisted["texts"],
                "acceptance_rate": assisted["acceptance_rate"], "tokens_per_step": assisted["tokens_per_step"],
                "forward_passes_per_token": assisted["forward_passes_per_token"],
                "plain_remote_calls_per_token": round(int(plain["remote_calls"]) / int(plain["n_tokens"]), 3),  # type: ignore[call-overload]
                "assist_remote_calls_per_token": assisted["remote_calls_per_token"],
                "ideal_draft_remote_calls_per_token": ideal["remote_calls_per_token"],
            }
            say(f"  rtt {rtt} ms, one stream: {p} tokens/s plain, {a} with --assist lookup ({round(a / p, 3)}x); "
                f"{assisted['draft_tokens_accepted']} of {assisted['draft_tokens_proposed']} drafts accepted, "
                f"{assisted['tokens_per_step']} tokens per step; same text: {plain['texts'] == assisted['texts']}; "
                f"the model as its own draft: {d} tokens/s ({round(d / p, 3)}x, {ideal['tokens_per_step']} per step; "
                f"{free} tokens/s without the drafting time)")
    return out


def assist_keys(assist: dict[str, object]) -> dict[str, object]:
    """The assist bench's flat keys: tokens/s with and without, and their ratio, by RTT."""
    keys: dict[str, object] = {}
    for rtt in ASSIST_RTTS_MS:
        r = assist[f"rtt{rtt}"]
        keys[f"single_stream_tokens_s_rtt{rtt}_plain"] = r["plain_tokens_per_s"]  # type: ignore[index]
        keys[f"single_stream_tokens_s_rtt{rtt}_assist"] = r["assist_tokens_per_s"]  # type: ignore[index]
        keys[f"assist_over_plain_rtt{rtt}"] = r["assist_over_plain"]  # type: ignore[index]
        keys[f"assist_acceptance_rate_rtt{rtt}"] = r["acceptance_rate"]  # type: ignore[index]
        keys[f"single_stream_tokens_s_rtt{rtt}_ideal_draft"] = r["ideal_draft_tokens_per_s"]  # type: ignore[index]
        keys[f"ideal_draft_over_plain_rtt{rtt}"] = r["ideal_draft_over_plain"]  # type: ignore[index]
        keys[f"free_draft_over_plain_rtt{rtt}"] = r["free_draft_over_plain"]  # type: ignore[index]
    return keys


def _audit_cost(sw, model: pathlib.Path, args_common: list[str], *, groups: int, rtt_file: pathlib.Path,  # type: ignore[no-untyped-def]
                say: Callable[[str], None]) -> dict[str, object]:
    """The audits' price at RTT 0: the same remote decode with audits off and at the default
    rate, alternated twice (this machine is noisy), same groups; medians, and the share of the
    decode's wall time the backbone spent auditing."""
    rtt_file.write_text("0")
    time.sleep(0.3)  # the proxy re-reads the file every 0.1 s
    runs: dict[str, list[dict[str, object]]] = {"off": [], "on": []}
    for _ in range(2):
        for mode in ("off", "on"):
            extra = ["--audit-rate", "0"] if mode == "off" else []
            runs[mode].append(sw.run_backbone(["--model", str(model), *args_common, "--groups", str(groups),
                                               "--wait-sessions", "2", *extra]))
    rate = {m: statistics.median(float(r["decode_tokens_per_s"]) for r in rs) for m, rs in runs.items()}  # type: ignore[arg-type]
    on = runs["on"]
    audited = sum(int(r["audited_rows"]) for r in on)  # type: ignore[call-overload]
    remote_rows = sum(int(r["remote_rows"]) for r in on)  # type: ignore[call-overload]
    seconds = sum(float(str(r["audit_seconds"])) for r in on)
    wall = sum(float(str(r["seconds"])) for r in on)
    result = {
        "audit_rate": on[0]["audit_rate"], "groups": groups,
        "tokens_per_s_audits_off": round(rate["off"], 3), "tokens_per_s_audits_on": round(rate["on"], 3),
        "on_over_off": round(rate["on"] / rate["off"], 3) if rate["off"] else None,
        "audited_rows": audited, "remote_rows": remote_rows, "audit_seconds": round(seconds, 3),
        # Rows equal bit for bit to the backbone's own kernel: these need no error bound.
        "audit_exact_rows": sum(int(r["audit_exact_rows"]) for r in on),  # type: ignore[call-overload]
        "audit_share_of_wall": round(seconds / wall, 4) if wall else None,
        "quarantined": sorted({s for r in on for s in r["sessions_quarantined"]}),  # type: ignore[attr-defined]
    }
    say(f"  audits at {result['audit_rate']}: {result['tokens_per_s_audits_on']} tokens/s against "
        f"{result['tokens_per_s_audits_off']} off ({result['on_over_off']}); {audited} of {remote_rows} rows "
        f"audited in {result['audit_seconds']} s of the backbone's CPU time")
    return result


def _summary(times: list[float], batch: int, payload: int, *, in_flight_rows_s: float | None) -> dict[str, float]:
    med = statistics.median(times)
    out = {
        "p50_ms": round(med * 1000, 3),
        "p90_ms": round(_pct(times, 0.9) * 1000, 3),
        "rows_s": round(batch / med, 1),
        "mb_s": round(payload / med / 1e6, 1),
    }
    if in_flight_rows_s is not None:
        out["rows_s_in_flight"] = round(in_flight_rows_s, 1)
    return out


# --- The fabric's cost by hop (``kvasir bench --hops``; ``hops`` in the full bench) ---------

HOP_BATCH = 512
# The processes a Dispatch call crosses on each path, from the backbone's side.
HOP_PATHS = {"hub": ("client", "hub", "worker"), "gateway": ("client", "hub", "gateway", "worker"),
             "fabric": ("client", "hub", "gateway", "worker")}


def run_hop_bench(*, quick: bool = False, say: Callable[[str], None] = print) -> dict[str, object]:
    """CPU nanoseconds per byte of each process a Dispatch call crosses, at batch 512.

    One swarm: a TLS gateway, a hub, a worker that dials the hub (path ``hub``, plain ws), one
    that dials the gateway (``gateway``, sealed end to end) and one that dials the gateway with
    ``--echo-experts`` (``fabric``: the relays without compute). This process is the
    backbone's client side (a grpcio stream, as the backbone's). Each hop's CPU time over the
    same calls (every thread, from /proc) is divided by the same byte count: the tensor
    payload of those calls, request rows and weights plus the partials. On the ``hub`` and
    ``gateway`` paths the worker's figure has the in-process compute time of the same calls
    subtracted (the fabric path's worker computes nothing). Also the fabric path's latency at batch 1."""
    import torch

    from kvasir.cpu import CpuMeter, ns_per_byte
    from kvasir.swarm import LocalSwarm
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
    n = 10 if quick else 25
    out: dict[str, object] = {"batch": HOP_BATCH, "calls": n, "hidden": HIDDEN, "dtype": "float32",
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
        sw.start_worker("worker_hub", ckpt, "0:0", via="hub")
        sw.start_worker("worker_gateway", ckpt, "0:0", via="gateway")
        sw.start_worker("worker_echo", ckpt, "0:1", via="gateway", extra=["--echo-experts"])
        sessions = sw.wait_sessions(3, watch=["gateway", "worker_hub", "worker_gateway", "worker_echo"])
        by_path = {}
        for s in sessions:
            through_gateway = s.remote_address.startswith("gateway:")
            path = "fabric" if s.slices[0].experts[0] == 1 else ("gateway" if through_gateway else "hub")
            by_path[path] = s
        worker_of = {"hub": "worker_hub", "gateway": "worker_gateway", "fabric": "worker_echo"}
        token = sw.backbone_token

        def metered(path: str) -> int:
            return sum(int(s.bytes_to_worker + s.bytes_from_worker) for s in sw.list_sessions()
                       if s.session_id == by_path[path].session_id)

        g = torch.Generator().manual_seed(2)
        for batch in (HOP_BATCH, 1):
            hidden = torch.randn(batch, HIDDEN, generator=g)
            weights = torch.rand(batch, generator=g)
            payload = (2 * hidden.numel() + weights.numel()) * 4
            compute_s = 0.0
            if batch == HOP_BATCH:
                c0 = time.process_time()
                for _ in range(n):
                    expert_forward(hidden, gate_up, down, act, weights)
                compute_s = time.process_time() - c0
            for path in (("fabric", "gateway", "hub") if batch == HOP_BATCH else ("fabric",)):
                req = expert_pb2.DispatchRequest(
                    call_id=1, layer=0, hidden=encode_tensor(hidden), weights=encode_tensor(weights),
                    segments=[expert_pb2.ExpertSegment(expert=1 if path == "fabric" else 0, rows=batch)])
                meta = ((TARGET_KEY_METADATA, target_key(token, by_path[path].session_id)),)
                stream = _Stream(by_path[path].target, meta)
                try:
                    for _ in range(3):
                        stream.call(req)  # warm up the connection and the worker
                    pids: dict[str, int | None] = {"client": None, "worker": sw.pid(worker_of[path]),
                                                   "hub": sw.pid("hub"), "gateway": sw.pid("gateway")}
                    before = metered(path)
                    times = []
                    with CpuMeter(pids) as meter:
                        for _ in range(n):
                            t0 = time.perf_counter()
                            stream.call(req)
                            times.append(time.perf_counter() - t0)
                    wire = metered(path) - before
                finally:
                    stream.close()
                cpu = meter.reading.cpu_s
                med = statistics.median(times)
                if batch == 1:
                    out["fabric_b1"] = {"p50_ms": round(med * 1000, 3), "p90_ms": round(_pct(times, 0.9) * 1000, 3)}
                    continue
                hops = HOP_PATHS[path]
                if path != "fabric":
                    cpu = {**cpu, "worker_with_compute": cpu["worker"], "worker": cpu["worker"] - compute_s}
                total = payload * n
                point: dict[str, object] = {
                    "bytes": total, "metered_bytes": wire, "wall_s": round(meter.reading.wall_s, 3),
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
    add_floors(out, say=say)
    return out


def add_floors(hops: dict[str, object], *, say: Callable[[str], None] = print) -> None:
    """Put under ``hops`` each hop's floor (``kvasir.floors``: what its kernel copies,
    TLS, end-to-end AEAD and masking alone cost per byte on this machine, measured now) and,
    per path, ``floor_ns_per_byte`` and ``over_floor`` (measured / floor) by hop."""
    from kvasir.floors import hop_floors, measure_primitives

    say("hops: the primitives' CPU ns per byte (sockets, TLS, AEADs, mask), for each hop's floor")
    primitives = measure_primitives()
    hops["primitives"] = primitives
    floors = hop_floors(primitives)
    for path, point in hops.items():
        if path not in HOP_PATHS or not isinstance(point, dict):
            continue
        floor = floors["hub" if path == "hub" else "gateway"]
        point["floor_ns_per_byte"] = {h: round(floor[h], 3) for h in point["ns_per_byte"]}
        point["over_floor"] = {h: round(v / floor[h], 2) if v is not None else None
                               for h, v in point["ns_per_byte"].items()}


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
    if isinstance(hops.get("fabric"), dict):
        figures["fabric_mb_s_b512"] = hops["fabric"]["mb_s"]  # type: ignore[index]
    if isinstance(hops.get("fabric_b1"), dict):
        figures["fabric_p50_ms_b1"] = hops["fabric_b1"]["p50_ms"]  # type: ignore[index]
    return figures


def hop_table(hops: dict[str, object]) -> str:
    """The hop bench as a text table: ns of CPU per byte, a row per path, a column per hop."""
    cols = ("client", "hub", "gateway", "worker")
    lines = [f"CPU ns per byte of tensor payload, batch {hops['batch']}, {hops['calls']} calls (floor: what the hop's "
             "socket copies, TLS, end-to-end AEAD and masking alone cost here)",
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
    if isinstance(hops.get("fabric_b1"), dict):
        lines.append(f"fabric p50 at batch 1: {hops['fabric_b1']['p50_ms']} ms")  # type: ignore[index]
    return "\n".join(lines)


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

    from kvasir.cpu import CpuMeter, ns_per_byte

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
# The relay bench's expert: an intermediate of 8, so computing it costs next to nothing and
# the relays carry the load.
_RELAY_INTER = 8


class _RawStream(_Stream):
    """A Dispatch stream of serialized messages, both ways: the caller pays no protobuf
    encoding or parsing, so the relays, not this process, carry the load."""

    def __init__(self, target: str, metadata: tuple[tuple[str, str], ...] = (), *,
                 timeout: float | None = None) -> None:
        import grpc

        self.channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 256 << 20),
                                                             ("grpc.max_send_message_length", 256 << 20)])
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.q = queue.SimpleQueue()
        dispatch = self.channel.stream_stream("/kvasir.v1.ExpertService/Dispatch")  # no (de)serializers: bytes
        # ``timeout``: a deadline for the whole stream, so no call of it can wait for ever.
        self.responses = dispatch(self._iter(), metadata=metadata, timeout=timeout)


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


# --- Real releases' shapes (``kvasir bench --shape NAME``) --------------------------------------

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
