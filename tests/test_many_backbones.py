"""Many backbones share one swarm (issue 30): a worker's session carries several backbone
connections at once on a multiplexed tunnel (docs/PROTOCOL.md "Multiplexed tunnel"), the
backbones take turns at its experts, and each is credited for its own work. Real processes
on 127.0.0.1: a ledger, a hub, workers, a backbone service and batch decodes beside it.

What must hold: a batch decode while the service is busy on the same hub uses the workers
(remote rows > 0 each), both exact; a worker that serves one backbone at a time turns the
second away with RESOURCE_EXHAUSTED, which that backbone logs and counts (never a silent
fallback), and gets the worker once the first lets go."""

from __future__ import annotations

import concurrent.futures
import json
import re
import urllib.request

import grpc
import pytest

from kvasir.swarm import LocalSwarm
from kvasir_rpc import backbone_pb2, backbone_pb2_grpc

pytestmark = pytest.mark.integration

PROMPTS = [f"Backbone {i} shares the workers" + " and their experts" * (i % 3) for i in range(6)]


def _generate(port: int, prompt: str) -> tuple[list[int], backbone_pb2.GenerateSummary]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = backbone_pb2_grpc.BackboneServiceStub(channel)
        ids: list[int] = []
        summary = None
        for msg in stub.Generate(backbone_pb2.GenerateRequest(prompt=prompt, max_tokens=12, ignore_eos=True,
                                                              digest_logits=True), timeout=120):
            ids += msg.token_ids
            if msg.HasField("summary"):
                summary = msg.summary
        assert summary is not None
        return ids, summary


def test_a_batch_decode_and_a_service_share_the_workers_both_exact(tiny_models, tmp_path):
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path / "swarm") as sw:
        sw.start_ledger()
        sw.start_hub(receipt_interval=0.5, http=True)
        sw.start_worker("w1", model, "*:0-3")
        sw.start_worker("w2", model, "*:4-7")
        sw.wait_sessions(2, watch=["w1", "w2"])
        remote = sw.start_backbone_service("svc", model, ["--wait-sessions", "2"])
        local = sw.start_backbone_service("local", model, hub=False)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            # The service is busy on the workers while the batch decode runs beside it.
            served = [pool.submit(_generate, int(remote["grpc_port"]), p) for p in PROMPTS]
            result = sw.run_backbone(["--model", str(model), "--prompt", "a second backbone", "--batch", "2",
                                      "--max-new-tokens", "12", "--compare-local", "--require-bitwise",
                                      "--wait-sessions", "2"])
            answers = [f.result(timeout=300) for f in served]
        assert result["backbone_exit_code"] == 0 and result["verdict"] == "bitwise equal", result
        assert result["remote_rows"] > 0 and result["fallback_calls"] == 0 and result["local_rows"] == 0
        assert result["worker_busy_refusals"] == 0
        for prompt, (ids, summary) in zip(PROMPTS, answers):
            assert summary.remote_rows > 0 and summary.fallback_rows == 0
            assert ids == _generate(int(local["grpc_port"]), prompt)[0]  # batched with others: the same tokens
        # Alone (one batch shape on both), the service on the swarm is bitwise the local one.
        ids, summary = _generate(int(remote["grpc_port"]), PROMPTS[0])
        alone_ids, alone = _generate(int(local["grpc_port"]), PROMPTS[0])
        assert ids == alone_ids and summary.logits_digest == alone.logits_digest and summary.remote_rows > 0
        # Both backbones showed on the hub's status: the service with its load, each with its shares.
        status = json.loads(urllib.request.urlopen(sw.status_url + "api/status", timeout=10).read())
        kinds = sorted(b["kind"] for b in status["backbones"])
        assert "serve" in kinds and all(b["fallback_rows"] == 0 for b in status["backbones"]), status["backbones"]
        assert sw.stop_process("svc") == 0  # it reports the last of its work as it stops
        sessions = sw.list_sessions()
        assert all(s.tunnel_channels == 8 for s in sessions)
        # Each backbone's work is credited once: the hub counts both runs' reports.
        credited = sw.wait_credited(sessions)
        assert all(credited[s.session_id] == s.work_bytes > 0 for s in sessions)


def test_a_worker_serving_one_backbone_at_a_time_says_so_to_the_second(tiny_models, tmp_path):
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path / "swarm") as sw:
        sw.start_ledger()
        sw.start_hub()
        sw.start_worker("w1", model, "*:0-7", extra=["--backbones", "1"])
        (session,) = sw.wait_sessions(1, watch=["w1"])
        assert session.tunnel_channels == 1
        svc = sw.start_backbone_service("svc", model, ["--wait-sessions", "1"], http=True)
        # It says where it serves, in one line, whatever the log level.
        assert f"kvasir.v1.BackboneService on 127.0.0.1:{svc['grpc_port']}; the OpenAI API at " \
               f"http://127.0.0.1:{svc['http_port']}/v1" in (sw.logs / "svc.log").read_text()
        assert _generate(int(svc["grpc_port"]), "holds the worker")[1].remote_rows > 0
        # The service holds the worker's one connection (busy with callers throughout); a batch
        # decode is turned away, says so, and computes exactly here.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            busy = [pool.submit(_generate, int(svc["grpc_port"]), p) for p in PROMPTS]
            result = sw.run_backbone(["--model", str(model), "--prompt", "turned away", "--max-new-tokens", "6",
                                      "--compare-local", "--require-bitwise", "--wait-sessions", "1"])
            assert all(f.result(timeout=300)[1].remote_rows > 0 for f in busy)
        assert result["backbone_exit_code"] == 0 and result["verdict"] == "bitwise equal", result
        log = (sw.logs / "backbone.log").read_text()
        shown = {k: result.get(k) for k in ("worker_busy_refusals", "remote_rows", "remote_calls", "local_rows",
                                             "fallback_calls", "sessions_used", "expert_weights")}
        hub = [line for line in (sw.logs / "hub.log").read_text().splitlines() if "target connection" in line]
        assert result["worker_busy_refusals"] >= 1 and result["remote_rows"] == 0, (shown, log[-1500:], hub[-6:])
        assert "worker busy with other backbones" in log and "carries 1 backbone connection already" in log
        (session,) = sw.list_sessions()
        assert session.connections_refused_busy >= 1 and session.backbone_connections == 1
        # The hub's refusal is on the service's side of the worker too: the service went on.
        assert "kvasir_backbone_worker_busy_refusals_total 0" in sw.scrape("svc")
        # Once the service lets go, the next backbone gets the worker.
        sw.stop_process("svc")
        result = sw.run_backbone(["--model", str(model), "--prompt", "let in", "--max-new-tokens", "6",
                                  "--compare-local", "--require-bitwise", "--wait-sessions", "1"])
        assert result["verdict"] == "bitwise equal" and result["remote_rows"] > 0, result


@pytest.mark.parametrize("fault", ["mux-stray", "mux-short"])
def test_a_worker_that_breaks_the_multiplexed_framing_loses_its_session_and_nothing_else(fault, tiny_models,
                                                                                      tmp_path):
    """The attack: a worker on a multiplexed tunnel carrying two backbones' connections (a
    service and a batch decode), honest for 30 data messages, then sends data on a channel the
    hub never opened (mux-stray) or a data message too short to name its channel (mux-short).
    What must hold: the hub ends that session with a protocol error (1002) naming the fault,
    keeps serving the honest worker and both backbones, the decode stays bitwise the local
    run's and the service answers every request."""
    from helpers import ROOT, swarm_with_dishonest

    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path / "swarm") as sw:
        bad, honest = swarm_with_dishonest(sw, model, "bad", (str(ROOT / "tests" / "bad_tunnel_worker.py"),
                                                               fault, "--"))
        service = sw.start_backbone_service("svc", model, ["--wait-sessions", "2"])
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            served = [pool.submit(_generate, int(service["grpc_port"]), p) for p in PROMPTS[:3]]
            result = sw.run_backbone(["--model", str(model), "--prompt", "a framing fault", "--batch", "2",
                                      "--max-new-tokens", "12", "--compare-local", "--require-bitwise",
                                      "--wait-sessions", "2"])
            answers = [f.result(timeout=300) for f in served]
        assert result["backbone_exit_code"] == 0 and result["verdict"] == "bitwise equal", result
        assert all(len(ids) == 12 for ids, _ in answers)
        hub_log = (sw.logs / "hub.log").read_text()
        says = (r"channel \d+: the worker sent \d+ bytes of data while the tunnel is IDLE" if fault == "mux-stray"
                else r"a data message of 1 bytes: it starts with its channel")
        assert re.search(says, hub_log), hub_log[-3000:]
        live = {s.session_id for s in sw.list_sessions()}
        assert honest.session_id in live and bad.session_id not in live
        assert sw.procs["hub"].poll() is None
