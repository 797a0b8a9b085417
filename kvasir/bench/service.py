"""``kvasir bench --service``: the backbone service under 1, 8 and 32 concurrent callers.

Two services side by side in one run, on the same model and prompts: every expert local,
and every MoE layer's experts on two workers that reach the hub through the TLS gateway.
For each number of concurrent callers: aggregate tokens/s (all the tokens over the wall
time from the first call to the last answer), time to first token (median and worst, as
the summaries report it) and each request's own decode rate. The local service is also
called through its OpenAI-compatible ``/v1/completions`` (tokens/s only), and the remote
service with two lanes (micro-batch pipelining) against one, at 32 callers, with the
workers' link at RTT 0 and 50 ms. The ratios are what to read: 32 callers over 1 (what
continuous batching buys), remote over local, two lanes over one.
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable

__all__ = ["run_service_bench"]

CONCURRENCY = (1, 8, 32)


def _prompts(n: int) -> list[str]:
    return [f"caller {i} asks about the experts" + " of the swarm" * (i % 3) for i in range(n)]


def _call(stub, prompt: str, tokens: int):  # type: ignore[no-untyped-def]
    from kvasir_rpc import backbone_pb2

    summary = None
    for msg in stub.Generate(backbone_pb2.GenerateRequest(prompt=prompt, max_tokens=tokens, ignore_eos=True),
                             timeout=600):
        if msg.HasField("summary"):
            summary = msg.summary
    assert summary is not None
    return summary


def _point(stub, n: int, tokens: int, rounds: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """``rounds`` waves of ``n`` concurrent calls (distinct prompts); at least 8 calls."""
    prompts = _prompts(max(n * rounds, 8))
    _call(stub, "warm up", 2)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        summaries = list(pool.map(lambda p: _call(stub, p, tokens), prompts))
    wall = time.perf_counter() - t0
    total = sum(s.completion_tokens for s in summaries)
    ttft = [s.time_to_first_token_seconds for s in summaries]
    return {"tokens_per_s": round(total / wall, 2), "ttft_p50_s": round(statistics.median(ttft), 4),
            "ttft_max_s": round(max(ttft), 4),
            "request_tokens_per_s_p50": round(statistics.median(s.tokens_per_second for s in summaries), 2),
            "max_batch_size": max(s.max_batch_size for s in summaries), "requests": len(summaries)}


def _http_call(port: int, prompt: str, tokens: int) -> int:
    import urllib.request

    body = json.dumps({"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return int(json.load(resp)["usage"]["completion_tokens"])


def _http_point(port: int, n: int, tokens: int, rounds: int) -> dict[str, float]:
    prompts = _prompts(max(n * rounds, 8))
    _http_call(port, "warm up", 2)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        total = sum(pool.map(lambda p: _http_call(port, p, tokens), prompts))
    return {"tokens_per_s": round(total / (time.perf_counter() - t0), 2), "requests": len(prompts)}


def run_service_bench(*, quick: bool = False, say: Callable[[str], None] = print) -> dict[str, object]:
    import grpc

    from kvasir.bench._decode_swarm import DECODE_MODEL, _core_split, start_decode_swarm
    from kvasir.swarm import LocalSwarm
    from kvasir_rpc import backbone_pb2_grpc

    tokens = 8 if quick else 16
    rounds = 1 if quick else 2
    split = _core_split()
    out: dict[str, object] = {"model": DECODE_MODEL, "new_tokens": tokens, "rounds": rounds,
                              "cores": None if split is None else {"services_and_hub": sorted(split[0]),
                                                                   "gateway_workers": sorted(split[1])}}
    with tempfile.TemporaryDirectory(prefix="kvasir-bench-service-") as tmp, LocalSwarm(tmp) as sw:
        # The workers' link goes through a latency proxy: RTT 0 for the main figures, then
        # 50 ms to see what lanes hide.
        model, rtt_file = start_decode_swarm(sw, pathlib.Path(tmp), split, ("remote", "remote2", "local"))
        services = {"local": sw.start_backbone_service("local", model, hub=False, http=True),
                    "remote": sw.start_backbone_service("remote", model, ["--wait-sessions", "2"]),
                    "remote_two_lanes": sw.start_backbone_service("remote2", model,
                                                                  ["--wait-sessions", "2", "--lanes", "2"])}
        stubs = {path: backbone_pb2_grpc.BackboneServiceStub(grpc.insecure_channel(f"127.0.0.1:{r['grpc_port']}"))
                 for path, r in services.items()}
        for path in ("local", "remote"):
            for n in CONCURRENCY:
                point = _point(stubs[path], n, tokens, rounds)
                out[f"{path}_c{n}"] = point
                say(f"  {path}, {n} concurrent: {point['tokens_per_s']} tokens/s, first token after "
                    f"{point['ttft_p50_s']} s (worst {point['ttft_max_s']} s), batch up to {point['max_batch_size']}")
        # Micro-batch pipelining: one lane against two, 32 callers, RTT 0 and 50 ms; the two
        # alternate three times and the median counts (this machine is shared and noisy).
        for rtt in (0, 50):
            rtt_file.write_text(str(rtt))
            time.sleep(0.3)  # the proxy re-reads the file every 0.1 s
            runs: dict[str, list[dict[str, float]]] = {"remote": [], "remote_two_lanes": []}
            for _ in range(3):
                for path in runs:
                    runs[path].append(_point(stubs[path], 32, tokens, 1))
            for path, points in runs.items():
                point = sorted(points, key=lambda q: q["tokens_per_s"])[1]
                out[f"{path}_c32_rtt{rtt}"] = {**point, "runs_tokens_per_s": [q["tokens_per_s"] for q in points]}
                say(f"  {path}, 32 concurrent, RTT {rtt} ms: {point['tokens_per_s']} tokens/s (median of "
                    f"{[q['tokens_per_s'] for q in points]}), first token after {point['ttft_p50_s']} s")
        rtt_file.write_text("0")
        for n in (1, 32):
            point = _http_point(int(services["local"]["http_port"]), n, tokens, rounds)  # type: ignore[call-overload]
            out[f"local_http_c{n}"] = point
            say(f"  local through /v1/completions, {n} concurrent: {point['tokens_per_s']} tokens/s")
    ratios = {}
    for path in ("local", "remote"):
        ratios[f"{path}_c32_over_c1"] = round(out[f"{path}_c32"]["tokens_per_s"] / out[f"{path}_c1"]["tokens_per_s"], 2)  # type: ignore[index]
    ratios["local_http_c32_over_c1"] = round(out["local_http_c32"]["tokens_per_s"] / out["local_http_c1"]["tokens_per_s"], 2)  # type: ignore[index]
    for n in CONCURRENCY:
        ratios[f"remote_over_local_c{n}"] = round(out[f"remote_c{n}"]["tokens_per_s"] / out[f"local_c{n}"]["tokens_per_s"], 3)  # type: ignore[index]
    for rtt in (0, 50):
        ratios[f"two_lanes_over_one_c32_rtt{rtt}"] = round(
            out[f"remote_two_lanes_c32_rtt{rtt}"]["tokens_per_s"] / out[f"remote_c32_rtt{rtt}"]["tokens_per_s"], 3)  # type: ignore[index]
    out["ratios"] = ratios
    return out
