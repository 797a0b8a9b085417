"""Prometheus metrics at ``/metrics`` of each component's ``--http``.

Fast: every metric of the gateway and the ledger follows the naming rules (``kvasir_<component>_``,
counters end ``_total``), read from registries built in this process over a real Gateway and
a real LedgerStore; ``serve_metrics`` answers 404 off ``/metrics``. Integration: the backbone
engine's own registry, in process; then a real swarm (ledger, TLS gateway, hub, two workers
through the gateway, a backbone service) runs a few Generate calls, and the numbers each
component's ``/metrics`` shows agree with what Describe, the ledger's balances and the other
components say."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

import grpc
import pytest
from helpers import trustme_certs
from prometheus_client.parser import text_string_to_metric_families

from kvasir.swarm import LocalSwarm
from kvasir_rpc import backbone_pb2, backbone_pb2_grpc

PROMPTS = [f"Metrics request {i} asks the swarm" + " about experts" * (i % 3) for i in range(4)]
TOKENS = 6
HTTP_TIMEOUT_S = 10.0


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition: (name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    return samples[(name, tuple(sorted(labels.items())))]


def _total(samples: dict, name: str) -> float:  # type: ignore[type-arg]
    """The sum of ``name`` over all its label values."""
    return sum(v for (n, _), v in samples.items() if n == name)


def _check_names(text: str, component: str) -> list[str]:
    """The exposition's metric names, after checking the rules: each starts
    ``kvasir_<component>_``, a counter ends ``_total``, a histogram ``_seconds``."""
    names = []
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M):
        assert name.startswith(f"kvasir_{component}_"), name
        if kind == "counter":
            assert name.endswith("_total"), name
        elif kind == "histogram":
            assert name.endswith("_seconds"), name
        else:
            assert kind == "gauge", (name, kind)
            assert not name.endswith("_total"), name
        names.append(name)
    assert len(names) == len(set(names)) and names
    return names


def test_gateway_and_ledger_metrics_follow_the_naming_rules(tmp_path):
    from prometheus_client import generate_latest

    from ledger._metrics import LedgerMetrics
    from ledger._open import open_store
    from relay.gateway._gateway import Gateway, GatewayConfig
    from relay.gateway._metrics import gateway_registry

    gw = Gateway(GatewayConfig())
    gw.refusals.refused("rate")
    gateway_names = _check_names(generate_latest(gateway_registry(gw.statistics)).decode(), "gateway")
    assert {"kvasir_gateway_relayed_bytes_total", "kvasir_gateway_sessions", "kvasir_gateway_hubs_connected",
            "kvasir_gateway_refusals_total", "kvasir_gateway_sessions_closed_total"} <= set(gateway_names)
    store = open_store(f"sqlite:///{tmp_path / 'ledger.sqlite'}", pool_size=1)
    try:
        text = generate_latest(LedgerMetrics(store).registry).decode()
    finally:
        store.close()
    ledger_names = _check_names(text, "ledger")
    assert {"kvasir_ledger_credited_nano_kvr_total", "kvasir_ledger_submit_duration_seconds",
            "kvasir_ledger_wallets", "kvasir_ledger_receipts_total"} <= set(ledger_names)
    samples = _samples(text)
    assert _value(samples, "kvasir_ledger_wallets") == 0
    assert _value(samples, "kvasir_ledger_receipts_total", outcome="credited") == 0


def test_serve_metrics_answers_only_at_metrics_and_stops():
    from prometheus_client import CollectorRegistry

    from kvasir_rpc import StatsCollector, counter_family, latency_histogram, serve_metrics

    registry = CollectorRegistry()
    registry.register(StatsCollector(lambda: [counter_family("kvasir_test_things_total", "things", 3)]))
    latency_histogram("kvasir_test_call_seconds", "calls", registry).observe(0.002)
    with pytest.raises(ValueError, match="_total"):
        counter_family("kvasir_test_things", "a counter without _total")
    stop, port = serve_metrics(registry, "127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}/metrics", timeout=HTTP_TIMEOUT_S) as resp:
            assert resp.headers["content-type"].startswith("text/plain")
            samples = _samples(resp.read().decode())
        assert _value(samples, "kvasir_test_things_total") == 3
        assert _value(samples, "kvasir_test_call_seconds_count") == 1
        assert _value(samples, "kvasir_test_call_seconds_bucket", le="0.0025") == 1
        for path in ("/", "/metrics/x", "/favicon.ico"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(f"{base}{path}", timeout=HTTP_TIMEOUT_S)
            assert err.value.code == 404
    finally:
        stop()
    stop()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=HTTP_TIMEOUT_S)


@pytest.mark.integration
def test_the_backbone_engine_counts_requests_tokens_and_steps_by_outcome(tiny_models):
    """In process, experts local: the registry reads what the engine and dispatcher counted."""
    from backbone.engine._batch import Engine, Request
    from backbone.engine._decode import load_model
    from backbone.experts._dispatch import Dispatcher
    from backbone.service._grpc_api import Backbone
    from backbone.service._metrics import BackboneMetrics

    model, tokenizer = load_model(tiny_models("qwen3_moe"))
    dispatcher = Dispatcher(model, None)
    engine = Engine(model, tokenizer, dispatcher, max_batch=2, max_waiting=0)
    try:
        bb = Backbone(engine=engine, tokenizer=tokenizer, dispatcher=dispatcher, model_id="tiny")
        metrics = BackboneMetrics(bb)
        ids = tuple(tokenizer("the swarm")["input_ids"])
        streams = [engine.submit(Request(prompt_ids=ids, max_tokens=TOKENS, ignore_eos=True)) for _ in range(2)]
        from backbone.engine._batch import Overloaded

        with pytest.raises(Overloaded):
            engine.submit(Request(prompt_ids=ids, max_tokens=TOKENS, ignore_eos=True))
        for stream in streams:
            assert list(stream)[-1].summary is not None
        text = metrics.exposition().decode()
    finally:
        engine.close()
    _check_names(text, "backbone")
    s = _samples(text)
    assert _value(s, "kvasir_backbone_requests_total", outcome="length") == 2
    assert _value(s, "kvasir_backbone_requests_total", outcome="overloaded") == 1
    assert _value(s, "kvasir_backbone_tokens_generated_total") == 2 * TOKENS
    # The first token comes from the prefill, every other from a decode step.
    assert _value(s, "kvasir_backbone_decode_rows_total") == 2 * (TOKENS - 1)
    assert _value(s, "kvasir_backbone_local_rows_total") > 0
    assert _value(s, "kvasir_backbone_remote_calls_total") == 0
    assert _value(s, "kvasir_backbone_expert_call_duration_seconds_count") == 0


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as resp:
        return str(resp.read().decode())


@pytest.mark.integration
def test_a_swarms_metrics_agree_with_describe_the_ledger_and_each_other(tiny_models, tmp_path):
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path) as sw:
        trustme_certs(sw.workdir)
        sw.start_ledger(http=True)
        sw.start_gateway(http=True)
        sw.start_hub(gateway=True)
        for name, experts in (("w1", "*:0-3"), ("w2", "*:4-7")):
            sw.start_worker(name, model, experts, via="gateway")
        sessions = sw.wait_sessions(2, watch=["w1", "w2"])
        info = sw.start_backbone_service("backbone", model, ["--wait-sessions", "2"], http=True)
        assert sw.http_ports["backbone"] == info["http_port"]
        with grpc.insecure_channel(f"127.0.0.1:{info['grpc_port']}") as channel:
            stub = backbone_pb2_grpc.BackboneServiceStub(channel)
            for prompt in PROMPTS:
                replies = list(stub.Generate(backbone_pb2.GenerateRequest(
                    prompt=prompt, max_tokens=TOKENS, ignore_eos=True), timeout=120))
                assert replies[-1].summary.completion_tokens == TOKENS
            described = stub.Describe(backbone_pb2.BackboneServiceDescribeRequest(), timeout=10).stats
            backbone_text = sw.scrape("backbone")
            with pytest.raises(urllib.error.HTTPError) as err:
                _get(f"http://127.0.0.1:{sw.http_ports['backbone']}/status")
            assert err.value.code == 404
        gateway_text = sw.scrape("gateway")

        # The backbone: what Describe says, and one latency observation per accepted call.
        _check_names(backbone_text, "backbone")
        b = _samples(backbone_text)
        assert described.remote_rows > 0 and described.fallback_calls == 0
        assert _value(b, "kvasir_backbone_remote_rows_total") == described.remote_rows
        assert _value(b, "kvasir_backbone_remote_calls_total") == described.remote_calls
        assert _value(b, "kvasir_backbone_local_rows_total") == described.local_rows == 0
        assert _value(b, "kvasir_backbone_expert_call_duration_seconds_count") == described.remote_calls
        assert _value(b, "kvasir_backbone_expert_call_duration_seconds_sum") > 0
        assert _value(b, "kvasir_backbone_requests_total", outcome="length") == len(PROMPTS)
        assert _value(b, "kvasir_backbone_tokens_generated_total") == len(PROMPTS) * TOKENS
        assert _value(b, "kvasir_backbone_live_sessions") == 2
        assert _value(b, "kvasir_backbone_expert_coverage_ratio") == 1.0
        sent, received = (_value(b, "kvasir_backbone_worker_sent_bytes_total"),
                          _value(b, "kvasir_backbone_worker_received_bytes_total"))
        assert sent > 0 and received > 0

        # The gateway relayed all of it (framed, and sealed end to end: more bytes, never fewer).
        _check_names(gateway_text, "gateway")
        g = _samples(gateway_text)
        assert _value(g, "kvasir_gateway_relayed_bytes_total", direction="to_worker") > sent
        assert _value(g, "kvasir_gateway_relayed_bytes_total", direction="to_hub") > received
        assert _value(g, "kvasir_gateway_relayed_messages_total", direction="to_worker") > 0
        assert _value(g, "kvasir_gateway_sessions") == 2
        assert _value(g, "kvasir_gateway_sessions_spliced_total") == 2
        assert _value(g, "kvasir_gateway_hubs_connected") == 1
        assert _value(g, "kvasir_gateway_workers_waiting") == 0

        # The ledger: once the backbone's last report is in and every receipt credited, its
        # totals are the wallets' balances.
        assert sw.stop_process("backbone") == 0
        credited = sw.wait_credited(sessions)
        ledger_text = sw.scrape("ledger")
        _check_names(ledger_text, "ledger")
        ledger = _samples(ledger_text)
        balances = [sw.ledger_balance(s.wallet) for s in sessions]
        assert sum(credited.values()) > 0
        assert _value(ledger, "kvasir_ledger_credited_bytes_total") == sum(credited.values())
        assert _value(ledger, "kvasir_ledger_credited_nano_kvr_total") == sum(x.pending_nano_kvr for x in balances)
        assert _value(ledger, "kvasir_ledger_credited_nano_kvr_total") == 7 * sum(credited.values())
        assert _value(ledger, "kvasir_ledger_wallets") == 2
        assert _value(ledger, "kvasir_ledger_receipts_total", outcome="credited") == sum(
            x.credit_count for x in balances)
        assert _total(ledger, "kvasir_ledger_receipts_rejected_total") == 0
        assert _value(ledger, "kvasir_ledger_submit_duration_seconds_count") == _value(
            ledger, "kvasir_ledger_batches_total") > 0

        # Anything but /metrics is not found (the backbone's HTTP API has its own routes).
        for name in ("gateway", "ledger"):
            with pytest.raises(urllib.error.HTTPError) as err:
                _get(f"http://127.0.0.1:{sw.http_ports[name]}/status")
            assert err.value.code == 404


@pytest.mark.integration
@pytest.mark.parametrize("component", ["gateway", "ledger"])
def test_a_taken_http_port_stops_the_component_with_one_line_naming_the_flag(component, tmp_path):
    import os
    import socket
    import subprocess
    import sys

    from kvasir_rpc import Wallet, write_secret

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        if component == "gateway":
            token = tmp_path / "hub.token"
            write_secret(token, "t" * 40 + "\n")
            args = ["-m", "relay", "gateway", "--listen", "127.0.0.1:0", "--insecure-plain-ws",
                    "--hub-token-file", str(token)]
        else:
            args = ["-m", "ledger", "serve", "--listen", "127.0.0.1:0", "--db", f"sqlite:///{tmp_path / 'l.sqlite'}",
                    "--trust-key", Wallet.generate().address]
        out = subprocess.run([sys.executable, *args, "--http", address], capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    text = out.stdout + out.stderr
    assert out.returncode == 2 and "Traceback" not in text
    assert text.strip().splitlines() == [f"{component}: --http {address} is in use by another program: stop it or "
                                         "choose another port (port 0 picks a free one)"], text
