"""The service scales out (issue 30): two ``backbone serve`` replicas share one hub and its
workers behind a standard load balancer (Debian's HAProxy, HTTP and gRPC), each with its own
continuous batch. Real processes: a ledger, a hub, two workers, the replicas, a local service
for reference and the balancer; the official ``openai`` package drives the balancer.

What must hold: 32 concurrent OpenAI requests through the balancer all answer what the local
service answers; both replicas computed on the workers (remote rows > 0 each, from their
/metrics), nothing fell back; gRPC through the balancer too; every byte credited once."""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil

import grpc
import pytest

from kvasir.swarm import LocalSwarm
from kvasir_rpc import backbone_pb2, backbone_pb2_grpc

pytestmark = pytest.mark.integration

PROMPTS = [f"Caller {i} asks the replicas" + " about the swarm" * (i % 4) for i in range(32)]


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    assert m is not None, name
    return float(m[1])


def test_two_replicas_behind_haproxy_share_the_workers_and_answer_as_the_local_service(tiny_models, tmp_path):
    if shutil.which("haproxy") is None and not os.path.exists("/usr/sbin/haproxy"):
        pytest.skip("haproxy not found: install Debian's haproxy (make system-deps does)")
    import openai

    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path / "swarm") as sw:
        sw.start_ledger()
        sw.start_hub(receipt_interval=0.5)
        sw.start_worker("w1", model, "*:0-3")
        sw.start_worker("w2", model, "*:4-7")
        sw.wait_sessions(2, watch=["w1", "w2"])
        replicas = [sw.start_backbone_service(name, model, ["--wait-sessions", "2", "--lanes", "2"], http=True)
                    for name in ("r1", "r2")]
        local = sw.start_backbone_service("local", model, ["--max-batch", "32", "--max-waiting", "64"], hub=False,
                                          http=True)
        http_port, grpc_port = sw.start_service_balancer(replicas)
        served = str(replicas[0]["model"])

        def ask(port: int, prompt: str) -> str:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                   timeout=300)
            answer = client.completions.create(model=served, prompt=prompt, max_tokens=10, temperature=0)
            return answer.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            through = list(pool.map(lambda p: ask(http_port, p), PROMPTS))
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            expected = list(pool.map(lambda p: ask(int(local["http_port"]), p), PROMPTS))
        assert through == expected
        for name in ("r1", "r2"):
            metrics = sw.scrape(name)
            assert _metric(metrics, "kvasir_backbone_remote_rows_total") > 0, name
            assert _metric(metrics, "kvasir_backbone_fallback_rows_total") == 0, name
            assert _metric(metrics, "kvasir_backbone_local_rows_total") == 0, name
            assert _metric(metrics, "kvasir_backbone_worker_busy_refusals_total") == 0, name
        # gRPC through the balancer: HTTP/2 end to end.
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = backbone_pb2_grpc.BackboneServiceStub(channel)
            text = "".join(m.text for m in stub.Generate(
                backbone_pb2.GenerateRequest(prompt=PROMPTS[0], max_tokens=10, ignore_eos=True), timeout=120))
        assert text == expected[0]
        # Each replica reports its own work as it stops; the hub counts both, the ledger credits it once.
        for name in ("r1", "r2"):
            assert sw.stop_process(name) == 0
        sessions = sw.list_sessions()
        credited = sw.wait_credited(sessions)
        assert all(credited[s.session_id] == s.work_bytes > 0 for s in sessions)
