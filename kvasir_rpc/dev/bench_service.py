"""``kvasir bench --service``: the backbone service under 1, 8 and 32 concurrent callers.

Two services side by side in one run, on the same model and prompts: every expert local,
and every MoE layer's experts on two workers that reach the hub through the TLS gateway.
For each number of concurrent callers: aggregate tokens/s (all the tokens over the wall
time from the first call to the last answer), time to first token (median and worst, as
the summaries report it) and each request's own decode rate. The local service is also
called through its OpenAI-compatible ``/v1/completions`` (tokens/s only). The ratios are
what to read: 32 callers over 1 (what continuous batching buys) and remote over local.
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
    """``rounds`` waves of ``n`` concurrent calls (distinct prompts)."""
    prompts = [f"caller {i} asks about the experts" + " of the swarm" * (i % 3) for i in range(n * rounds)]
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
    prompts = [f"caller {i} asks about the experts" + " of the swarm" * (i % 3) for i in range(n * rounds)]
    _http_call(port, "warm up", 2)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        total = sum(pool.map(lambda p: _http_call(port, p, tokens), prompts))
    return {"tokens_per_s": round(total / (time.perf_counter() - t0), 2), "requests": len(prompts)}


def run_service_bench(*, quick: bool = False, say: Callable[[str], None] = print) -> dict[str, object]:
    import grpc

    from kvasir_rpc import backbone_pb2_grpc
    from kvasir_rpc.dev.bench import DECODE_MODEL, _core_split
    from kvasir_rpc.dev.swarm import LocalSwarm
    from kvasir_rpc.dev.tiny import make_tiny_checkpoint

    tokens = 8 if quick else 16
    rounds = 1 if quick else 2
    split = _core_split()
    out: dict[str, object] = {"model": DECODE_MODEL, "new_tokens": tokens, "rounds": rounds,
                              "cores": None if split is None else {"services_and_hub": sorted(split[0]),
                                                                   "gateway_workers": sorted(split[1])}}
    with tempfile.TemporaryDirectory(prefix="kvasir-bench-service-") as tmp, LocalSwarm(tmp) as sw:
        if split is not None:
            sw.default_cpus = split[1]
            sw.cpus["remote"] = sw.cpus["local"] = sw.cpus["hub"] = split[0]
        model = make_tiny_checkpoint(pathlib.Path(tmp) / "model", arch="qwen3_moe", seed=0, overrides=DECODE_MODEL)
        sw.start_gateway()
        sw.start_hub(gateway=True)
        half = DECODE_MODEL["num_experts"] // 2
        sw.start_worker("worker1", model, f"*:0-{half - 1}", via="gateway")
        sw.start_worker("worker2", model, f"*:{half}-{DECODE_MODEL['num_experts'] - 1}", via="gateway")
        sw.wait_sessions(2, watch=["gateway", "worker1", "worker2"])
        services = {"local": sw.start_backbone_service("local", model, hub=False, http=True),
                    "remote": sw.start_backbone_service("remote", model, ["--wait-sessions", "2", "--lanes", "2"])}
        for path, ready in services.items():
            with grpc.insecure_channel(f"127.0.0.1:{ready['grpc_port']}") as channel:
                stub = backbone_pb2_grpc.BackboneServiceStub(channel)
                for n in CONCURRENCY:
                    point = _point(stub, n, tokens, rounds)
                    out[f"{path}_c{n}"] = point
                    say(f"  {path}, {n} concurrent: {point['tokens_per_s']} tokens/s, first token after "
                        f"{point['ttft_p50_s']} s (worst {point['ttft_max_s']} s), batch up to {point['max_batch_size']}")
        for n in (1, 32):
            point = _http_point(int(services["local"]["http_port"]), n, tokens, rounds)  # type: ignore[call-overload]
            out[f"local_http_c{n}"] = point
            say(f"  local through /v1/completions, {n} concurrent: {point['tokens_per_s']} tokens/s")
    ratios = {}
    for path in services:
        ratios[f"{path}_c32_over_c1"] = round(out[f"{path}_c32"]["tokens_per_s"] / out[f"{path}_c1"]["tokens_per_s"], 2)  # type: ignore[index]
    ratios["local_http_c32_over_c1"] = round(out["local_http_c32"]["tokens_per_s"] / out["local_http_c1"]["tokens_per_s"], 2)  # type: ignore[index]
    for n in CONCURRENCY:
        ratios[f"remote_over_local_c{n}"] = round(out[f"remote_c{n}"]["tokens_per_s"] / out[f"local_c{n}"]["tokens_per_s"], 3)  # type: ignore[index]
    out["ratios"] = ratios
    return out
