"""``kvasir bench --seed-table``: the seed's three reference figures (docs: ARCHITECTURE.md,
"Performance model") beside ours, measured in one run on this machine.

* ``batching``: per-row throughput of Dispatch calls through the TLS gateway at batch 512 over
  batch 1 (the full bench's dispatch machinery, one call at a time; seed: 77x on GPU).
* ``remote_layer``: the throughput lost by a single stream (batch 1) when one MoE layer of
  many has its experts on a worker behind the TLS gateway at 13 ms RTT, against the same
  decode with every expert local (seed: 1.2%, 4.220 -> 4.169 tok/s, layer-0 experts remote).
* ``edge``: the same through nginx terminating TLS in front of a plain-ws gateway, as
  ``kvasir bench``'s edge path (seed: ~28% through a CDN edge); skipped without nginx.

The decodes alternate local, gateway and edge in a rotated order, round after round, and
take medians (this machine is shared and noisy); every decode's text must equal the local
one's, and one more decode per remote path compares its logits with a local run's
(``--compare-local``).
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvasir.bench._checkpoint import make_bench_checkpoint
from kvasir.bench._decode_swarm import DECODE_MODEL, _core_split
from kvasir.bench._streams import _Stream
from kvasir.bench.dispatch import DISPATCH_CALLS, DISPATCH_CALLS_QUICK, dispatch_point, time_dispatch

if TYPE_CHECKING:
    from kvasir.swarm import LocalSwarm

__all__ = ["SEED", "SEED_RTT_MS", "SEED_TABLE_MODEL", "SeedRow", "added_ms", "overhead", "overhead_at_seed_token",
           "run_seed_table_bench", "seed_rows", "seed_table"]

# The seed's figures (ARCHITECTURE.md, "Performance model").
SEED_BATCHING = 77.0  # per-row throughput at batch 512 over batch 1, GPU
SEED_REMOTE_LAYER_TOKENS_S = (4.220, 4.169)  # all local, layer 0's experts remote at 13 ms
SEED_REMOTE_LAYER = 0.012
SEED_EDGE = 0.28  # the same through a CDN edge
SEED = {"batching_b512_over_b1": SEED_BATCHING, "remote_layer_overhead": SEED_REMOTE_LAYER,
        "remote_layer_tokens_per_s": list(SEED_REMOTE_LAYER_TOKENS_S), "edge_overhead": SEED_EDGE}
SEED_RTT_MS = 13
BATCHING_BATCHES = (1, 512)
DECODE_PATHS = ("local", "gateway", "edge")

# The decode bench's layer widths (Qwen3-30B-A3B's hidden 2048 and expert intermediate 768,
# 16/4 heads of 128, top-2) over 24 MoE layers of 4 experts. The overhead is the time one
# remote layer adds to a token (a round trip plus the hops) over the time of the whole token,
# so a token must take a time of the seed's order (4.2 tok/s, ~240 ms) for the share to mean
# something: at the decode bench's 2 layers a token takes ~15 ms on one core, and one 13 ms
# round trip would double it, as on no real model. A token here reads ~1.9 GB of weights
# (attention and 2 experts a layer), ~0.1-0.15 s on the backbone's one core; a real model at
# these widths (48 layers of 128 experts, top-8) is slower still on a CPU. More layers would
# come nearer the seed's token at the cost of minutes of writing and loading checkpoints (it
# is 2.7 GB of float32 as it is); the added milliseconds per token are reported beside the
# share, and that share scaled to the seed's token time. 4 experts, not 8 or 128: the unused
# ones would only lengthen writing and loading the checkpoint, not a token.
SEED_TABLE_MODEL = {**DECODE_MODEL, "num_hidden_layers": 24, "num_experts": 4}
PROMPT = "The swarm runs the dense layers here and sends each token's expert work far away"


def overhead(remote: float, local: float) -> float:
    """The throughput a path loses against local: ``1 - remote / local`` (0.012 is 1.2%)."""
    if local <= 0:
        raise ValueError(f"local throughput must be positive, got {local}")
    return 1.0 - remote / local


def added_ms(remote: float, local: float) -> float:
    """Milliseconds a path adds to each token: ``1000 / remote - 1000 / local`` (tokens/s)."""
    if remote <= 0 or local <= 0:
        raise ValueError(f"throughputs must be positive, got {remote} and {local}")
    return 1000.0 / remote - 1000.0 / local


def overhead_at_seed_token(added: float) -> float:
    """The overhead that ``added`` ms per token would be on the seed's local token (4.220
    tok/s): what our added time means at the seed's token time rather than ours."""
    seed_ms = 1000.0 / SEED_REMOTE_LAYER_TOKENS_S[0]
    return overhead(1000.0 / (seed_ms + added), 1000.0 / seed_ms)


@dataclasses.dataclass(frozen=True)
class SeedRow:
    """One row of the table: what is measured, the seed's figure, ours (or why there is none)
    and how ours was measured."""

    name: str
    seed: str
    ours: str
    how: str


def seed_rows(result: Mapping[str, object]) -> list[SeedRow]:
    """The table's rows from :func:`run_seed_table_bench`'s result (or one of its shape)."""
    b: dict = result["batching"]  # type: ignore[type-arg, assignment]
    d: dict = result["decode"]  # type: ignore[type-arg, assignment]
    rtt = d["rtt_ms"]
    rows = [SeedRow(
        "per-row throughput, batch 512 over batch 1, gateway",
        f"{SEED_BATCHING:.0f}x (GPU)",
        f"{b['b512_over_b1']:.1f}x",
        f"Dispatch calls through the TLS gateway, one at a time: {b['rows_s']['512']:,.0f} rows/s at 512 over "
        f"{b['rows_s']['1']:,.0f} at 1 (p50 {b['p50_ms']['512']} and {b['p50_ms']['1']} ms); one expert "
        f"{b['hidden']}x{b['inter']} float32 on CPU, RTT 0")]
    local = d["median_tokens_per_s"]["local"]
    seeds = {"gateway": f"{SEED_REMOTE_LAYER:.1%} ({SEED_REMOTE_LAYER_TOKENS_S[0]:.3f} -> "
                        f"{SEED_REMOTE_LAYER_TOKENS_S[1]:.3f} tok/s)",
             "edge": f"~{SEED_EDGE:.0%} (CDN edge)"}
    for path, label in (("gateway", f"one remote MoE layer of many, {rtt} ms RTT"),
                        ("edge", f"the same through a TLS-terminating edge, {rtt} ms RTT")):
        seed = seeds[path]
        skipped = d["skipped"].get(path)
        if skipped:
            rows.append(SeedRow(label, seed, f"skipped: {skipped}",
                                "would be nginx (TLS) in front of a plain-ws gateway; `make bench` installs nginx"))
            continue
        remote = d["median_tokens_per_s"][path]
        same = "tokens identical" if d["texts_identical"][path] else "TOKENS DIFFER"
        verdict = d["verdict"].get(path)
        behind = "nginx (TLS) and a plain-ws gateway" if path == "edge" else "the TLS gateway"
        by_round = d.get("overhead_by_round", {}).get(path)
        spread = f" (by round {min(by_round):.1%} to {max(by_round):.1%})" if by_round else ""
        added = d["added_ms_per_token"][path]
        rows.append(SeedRow(
            label, seed, f"{d['overhead'][path]:.1%} ({local} -> {remote} tok/s)",
            f"batch 1, layer 0's experts on a worker behind {behind}, a latency proxy at {rtt} ms, against all "
            f"local; medians of {d['rounds']} alternated rounds of {d['new_tokens']} tokens{spread}, "
            f"{d['model']['num_hidden_layers']} MoE layers; {same}" + (f" ({verdict})" if verdict else "")
            + f"; +{added} ms on a {d['local_ms_per_token']} ms token, "
              f"{overhead_at_seed_token(added):.1%} on the seed's {1000 / SEED_REMOTE_LAYER_TOKENS_S[0]:.0f} ms"
            + (f"; {fallbacks} calls computed here after all" if (fallbacks := d.get("fallback_calls", {}).get(path))
               else "")))
    return rows


def seed_table(result: Mapping[str, object]) -> str:
    """:func:`seed_rows` as text: a line per row (what, seed, ours), how ours was measured below it."""
    rows = seed_rows(result)
    width = max(len(r.name) for r in rows)
    seed_w = max(len("seed"), *(len(r.seed) for r in rows))
    lines = [f"{'':<{width}}  {'seed':<{seed_w}}  ours", ]
    for r in rows:
        lines.append(f"{r.name:<{width}}  {r.seed:<{seed_w}}  {r.ours}")
        lines.append(f"{'':<4}{r.how}")
    return "\n".join(lines)


def _batching(quick: bool, say: Callable[[str], None]) -> dict[str, object]:
    """Dispatch calls through the TLS gateway at batch 1 and 512 (the full bench's gateway path)."""
    import torch

    from kvasir.bench._checkpoint import HIDDEN, INTER
    from kvasir.swarm import LocalSwarm
    from kvasir_rpc import TARGET_KEY_METADATA, target_key

    torch.set_num_threads(1)
    calls = DISPATCH_CALLS_QUICK if quick else DISPATCH_CALLS
    points: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvasir-bench-seed-") as tmp, LocalSwarm(tmp) as sw:
        ckpt = make_bench_checkpoint(pathlib.Path(tmp) / "expert")
        say("batching: TLS gateway, hub and a worker that dials the gateway")
        sw.start_gateway()
        sw.start_hub(gateway=True)
        sw.start_worker("worker_gateway", ckpt, "0:0", via="gateway")
        session = sw.wait_sessions(1, watch=["gateway", "worker_gateway"])[0]
        key = ((TARGET_KEY_METADATA, target_key(sw.backbone_token, session.session_id)),)
        g = torch.Generator().manual_seed(1)
        for batch in BATCHING_BATCHES:
            point = dispatch_point(batch, g)
            stream = _Stream(session.target, key)
            try:
                points[str(batch)], _ = time_dispatch(stream, point.request, batch=batch, payload=point.payload,
                                                      n=calls[batch])
            finally:
                stream.close()
            say(f"  batch {batch}: p50 {points[str(batch)]['p50_ms']} ms, {points[str(batch)]['rows_s']} rows/s")
    lo, hi = (str(b) for b in BATCHING_BATCHES)
    return {"hidden": HIDDEN, "inter": INTER, "calls": {b: calls[int(b)] for b in (lo, hi)}, "points": points,
            "rows_s": {b: points[b]["rows_s"] for b in (lo, hi)}, "p50_ms": {b: points[b]["p50_ms"] for b in (lo, hi)},
            "b512_over_b1": round(points[hi]["rows_s"] / points[lo]["rows_s"], 2),
            "b512_over_b1_in_flight": round(points[hi]["rows_s_in_flight"] / points[lo]["rows_s_in_flight"], 2)}


def _start_remote_layer(sw: LocalSwarm, model: pathlib.Path, rtt_file: pathlib.Path, *, edge: bool) -> None:
    """In ``sw``: a gateway (TLS; with ``edge`` plain ws behind nginx terminating TLS), a hub,
    and a worker holding layer 0's experts that reaches the gateway (or nginx) through a
    latency proxy whose round trip is read from ``rtt_file``; returns once the hub lists it."""
    sw.start_gateway(tls=not edge)
    sw.start_hub(gateway=True)
    front = sw.start_edge(sw.gateway_port) if edge else sw.gateway_port
    proxy = sw.start_latency_proxy("latency", front, rtt_file)
    sw.start_worker("worker", model, f"0:0-{SEED_TABLE_MODEL['num_experts'] - 1}", via="gateway",
                    gateway_url=f"wss://127.0.0.1:{proxy}")
    sw.wait_sessions(1, watch=["gateway", "latency", "worker", *(["edge"] if edge else [])])


def _decode(quick: bool, say: Callable[[str], None]) -> dict[str, object]:
    """Single-stream decodes, all local against layer 0's experts behind the gateway and
    behind the edge, at SEED_RTT_MS, alternated in rounds."""
    from kvasir.swarm import LocalSwarm, SwarmError
    from kvasir.tiny import make_tiny_checkpoint

    rounds, tokens = (2, 12) if quick else (5, 32)
    split = _core_split()
    out: dict[str, object] = {"model": SEED_TABLE_MODEL, "rtt_ms": SEED_RTT_MS, "rounds": rounds, "new_tokens": tokens,
                              "remote": f"layer 0, experts 0-{SEED_TABLE_MODEL['num_experts'] - 1}",
                              "cores": None if split is None else {"backbone_and_hub": sorted(split[0]),
                                                                   "relays_and_worker": sorted(split[1])}}
    with tempfile.TemporaryDirectory(prefix="kvasir-bench-seed-decode-") as tmp, LocalSwarm(tmp) as sw, \
            LocalSwarm(pathlib.Path(tmp) / "edge-swarm") as edge_sw:
        root = pathlib.Path(tmp)
        if split is not None:
            for swarm in (sw, edge_sw):
                swarm.default_cpus = split[1]
                swarm.cpus["backbone"] = swarm.cpus["hub"] = split[0]
        say(f"remote layer: a {SEED_TABLE_MODEL['num_hidden_layers']}-layer model, a TLS gateway, a hub and a "
            f"worker with layer 0's experts behind a {SEED_RTT_MS} ms latency proxy")
        model = make_tiny_checkpoint(root / "model", arch="qwen3_moe", seed=0, overrides=SEED_TABLE_MODEL)
        rtt_file = root / "rtt_ms"
        rtt_file.write_text(str(SEED_RTT_MS))
        _start_remote_layer(sw, model, rtt_file, edge=False)
        swarm_of = {"local": sw, "gateway": sw}
        skipped: dict[str, str] = {}
        try:
            _start_remote_layer(edge_sw, model, rtt_file, edge=True)
            swarm_of["edge"] = edge_sw
            say(f"  edge: nginx (TLS) in front of a plain-ws gateway, the worker behind a {SEED_RTT_MS} ms proxy")
        except SwarmError as exc:
            skipped["edge"] = str(exc).splitlines()[0]
            say(f"  edge skipped: {skipped['edge']}")
        paths = [p for p in DECODE_PATHS if p in swarm_of]
        # "all": every expert loaded in both runs, so the remote one differs from local by layer 0 alone.
        base = ["--model", str(model), "--prompt", PROMPT, "--max-new-tokens", str(tokens), "--expert-weights", "all"]

        def decode(path: str, extra: Sequence[str] = ()) -> dict[str, object]:
            if path == "local":
                return swarm_of[path].run_backbone([*base, *extra], hub=False)
            return swarm_of[path].run_backbone([*base, "--wait-sessions", "1", *extra])

        tps: dict[str, list[float]] = {p: [] for p in paths}
        texts: dict[str, list[object]] = {p: [] for p in paths}
        calls: dict[str, list[dict[str, object]]] = {p: [] for p in paths if p != "local"}
        for r in range(rounds):
            order = paths[r % len(paths):] + paths[:r % len(paths)]
            for path in order:
                res = decode(path)
                tps[path].append(float(res["decode_tokens_per_s"]))  # type: ignore[arg-type]
                texts[path].append(res["texts"])
                if path != "local":
                    calls[path].append({k: res.get(k) for k in ("n_tokens", "remote_calls", "remote_rows",
                                                                  "fallback_calls", "hedged_calls", "audited_rows")})
            say(f"  round {r + 1}: " + ", ".join(f"{p} {tps[p][-1]} tok/s" for p in paths))
        verdict: dict[str, object] = {}
        for path in paths:
            if path != "local":
                checked = decode(path, ["--compare-local"])
                verdict[path] = checked.get("verdict")
                say(f"  {path}: --compare-local: {verdict[path]}")
    reference = texts["local"][0]
    medians = {p: round(statistics.median(tps[p]), 3) for p in paths}
    added = {p: round(added_ms(medians[p], medians["local"]), 1) for p in paths if p != "local"}
    out.update(
        tokens_per_s=tps, median_tokens_per_s=medians, skipped=skipped, verdict=verdict, calls=calls,
        texts_identical={p: all(t == reference for t in texts[p]) for p in paths},
        overhead={p: round(overhead(medians[p], medians["local"]), 4) for p in paths if p != "local"},
        # The same per round (a remote decode over the local one of its round), for the spread.
        overhead_by_round={p: [round(overhead(x, y), 4) for x, y in zip(tps[p], tps["local"])]
                           for p in paths if p != "local"},
        # Calls computed here after all (lost, late or refused): the remote runs were not all remote.
        fallback_calls={p: sum(int(c["fallback_calls"] or 0) for c in calls[p]) for p in calls},  # type: ignore[call-overload]
        local_ms_per_token=round(1000 / medians["local"], 1), added_ms_per_token=added,
        overhead_at_seed_token={p: round(overhead_at_seed_token(ms), 4) for p, ms in added.items()})
    if "edge" in medians:
        out["edge_over_gateway_overhead"] = round(overhead(medians["edge"], medians["gateway"]), 4)
    return out


def run_seed_table_bench(*, quick: bool = False, say: Callable[[str], None] = print) -> dict[str, object]:
    """The seed's table (see the module's docstring): ``{"seed", "batching", "decode",
    "ratios", "figures", "table", "seconds"}``, the table as text in ``table``. Starts and stops
    its own swarms (one for the batching, then two side by side for the decodes); raises
    SwarmError when one does not start, except the edge's, which is reported in its row as
    skipped. Takes about 4 minutes on 2 cores (``quick``: about 2)."""
    t0 = time.monotonic()
    batching = _batching(quick, say)
    decode = _decode(quick, say)
    result: dict[str, object] = {"seed": SEED, "batching": batching, "decode": decode, "quick": quick}
    overheads: dict = decode["overhead"]  # type: ignore[type-arg, assignment]
    result["ratios"] = {"batching_b512_over_b1": batching["b512_over_b1"],
                        f"remote_layer_overhead_rtt{SEED_RTT_MS}": overheads.get("gateway"),
                        f"edge_overhead_rtt{SEED_RTT_MS}": overheads.get("edge")}
    figures: dict[str, object] = {"local_ms_per_token": decode["local_ms_per_token"]}
    for path, ms in decode["added_ms_per_token"].items():  # type: ignore[attr-defined]
        figures[f"{path}_added_ms_per_token_rtt{SEED_RTT_MS}"] = ms
        figures[f"{path}_overhead_at_seed_token_rtt{SEED_RTT_MS}"] = decode["overhead_at_seed_token"][path]  # type: ignore[index]
    figures["tokens_identical"] = all(decode["texts_identical"].values())  # type: ignore[attr-defined]
    result["figures"] = figures
    result["table"] = seed_table(result)
    result["seconds"] = round(time.monotonic() - t0, 1)
    return result
