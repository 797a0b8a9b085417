"""The backbone as a service (``python -m backbone serve``), real processes on 127.0.0.1:
a ledger, a TLS gateway, a hub and two workers that dial out to the gateway, a backbone
service whose experts are on them, and one with every expert local. What must hold: 32
concurrent greedy calls each return what they return alone, bit for bit what the local
service computes; a caller that goes away frees its slot; bad requests get the exact
status naming the field; a full service says RESOURCE_EXHAUSTED; grpcurl works; a liar in
the swarm changes no token."""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import subprocess
import time

import grpc
import pytest
from helpers import grpcurl_path, swarm_with_dishonest, trustme_certs, wait_until

from kvasir.swarm import LocalSwarm
from kvasir_rpc import backbone_pb2, backbone_pb2_grpc

pytestmark = pytest.mark.integration

LIAR = str(pathlib.Path(__file__).with_name("liar_worker.py"))
PROMPTS = [f"Request {i} asks the swarm" + " about experts" * (i % 4) for i in range(32)]
TOKENS = 10


class Service:
    def __init__(self, port: int, model: str, key: str = "") -> None:
        self.address = f"127.0.0.1:{port}"
        self.model = model
        self.metadata = (("authorization", f"Bearer {key}"),) if key else ()
        self.channel = grpc.insecure_channel(self.address)
        self.stub = backbone_pb2_grpc.BackboneServiceStub(self.channel)

    def generate(self, timeout: float = 120.0, **fields) -> tuple[list[int], str, backbone_pb2.GenerateSummary]:  # type: ignore[no-untyped-def]
        ids: list[int] = []
        text = ""
        summary = None
        for msg in self.stub.Generate(backbone_pb2.GenerateRequest(**fields), timeout=timeout,
                                      metadata=self.metadata):
            assert summary is None, "the summary comes on the last message only"
            ids += msg.token_ids
            text += msg.text
            if msg.HasField("summary"):
                summary = msg.summary
        assert summary is not None
        return ids, text, summary

    def describe(self) -> backbone_pb2.BackboneServiceDescribeResponse:
        return self.stub.Describe(backbone_pb2.BackboneServiceDescribeRequest(), timeout=10, metadata=self.metadata)


def _greedy(prompt: str, **extra):  # type: ignore[no-untyped-def]
    return dict(prompt=prompt, max_tokens=TOKENS, ignore_eos=True, digest_logits=True, **extra)


@pytest.fixture(scope="module")
def services(tiny_models, tmp_path_factory):  # type: ignore[no-untyped-def]
    model = tiny_models("qwen3_moe")
    work = tmp_path_factory.mktemp("serve")
    with LocalSwarm(work) as sw:
        trustme_certs(sw.workdir)
        sw.start_ledger()
        sw.start_gateway()
        sw.start_hub(gateway=True)
        for name, experts in (("w1", "*:0-3"), ("w2", "*:4-7")):
            sw.start_worker(name, model, experts, via="gateway")
        sw.wait_sessions(2, watch=["w1", "w2"])
        remote = sw.start_backbone_service("remote", model, ["--lanes", "2", "--wait-sessions", "2"])
        # The local service wants an API key, and serves the HTTP API too.
        local = sw.start_backbone_service("local", model, ["--max-batch", "8", "--max-waiting", "24", "--lanes", "2",
                                                           "--api-key-file", str(work / "api.key")],
                                          hub=False, http=True)
        key = (work / "api.key").read_text().strip()
        svc = Service(int(local["grpc_port"]), str(local["model"]), key)
        svc.http_port = int(local["http_port"])  # type: ignore[attr-defined]
        yield sw, Service(int(remote["grpc_port"]), str(remote["model"])), svc


def test_32_concurrent_calls_each_return_what_they_return_alone_and_alone_the_swarm_is_bitwise_local(services):
    sw, remote, local = services
    alone = [local.generate(**_greedy(p)) for p in PROMPTS]
    assert all(s.max_batch_size == 1 and s.completion_tokens == TOKENS for _, _, s in alone)
    assert all(s.finish_reason == backbone_pb2.FINISH_REASON_LENGTH for _, _, s in alone)
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        together_local = list(pool.map(lambda p: local.generate(**_greedy(p)), PROMPTS))
        together_remote = list(pool.map(lambda p: remote.generate(**_greedy(p)), PROMPTS))
    for (ids, text, s), (ids_l, text_l, s_l), (ids_r, text_r, s_r) in zip(alone, together_local, together_remote):
        assert ids_l == ids and text_l == text and ids_r == ids and text_r == text
        assert s_r.remote_rows > 0 and s_r.local_rows == 0 and s_r.fallback_rows == 0
        assert s_r.remote_rows + s_r.local_rows == s.local_rows  # the same rows, run elsewhere
    # Alone on the swarm, a decode is the local one in every logit of every step. (In a
    # batch, the dense layers' kernels see other rows and the last bits of a logit may
    # differ with the batch's make-up, on either service; the tokens do not, as above.)
    for prompt, (_, _, s) in list(zip(PROMPTS, alone))[:4]:
        assert remote.generate(**_greedy(prompt))[2].logits_digest == s.logits_digest
    # They were batched: the local service holds 8 at once, 2 lanes of 4; the remote one 32.
    assert max(s.max_batch_size for _, _, s in together_local) == 4
    assert max(s.max_batch_size for _, _, s in together_remote) > 4
    d = remote.describe()
    assert d.remote and d.coverage == 1.0 and d.live_sessions == 2
    assert [(layer.layer, list(layer.covered)) for layer in d.layers] == [(i, list(range(8))) for i in range(4)]
    assert d.stats.remote_calls > 0 and d.stats.fallback_calls == 0 and d.stats.requests_finished >= 32
    assert d.model.id == remote.model and d.model.experts_per_layer == 8 and d.model.experts_per_token == 2
    assert remote.stub.ListModels(backbone_pb2.ListModelsRequest(), timeout=5).models[0] == d.model
    assert not local.describe().remote and local.describe().coverage == 0.0


def test_a_service_with_an_api_key_refuses_callers_without_it_on_grpc_and_http(services):
    import openai
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    sw, _, local = services
    key_file = sw.workdir / "api.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    stub = local.stub
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", local.metadata[0][1][7:]),)):
        for call in (lambda: stub.ListModels(backbone_pb2.ListModelsRequest(), timeout=10, metadata=metadata),
                     lambda: stub.Describe(backbone_pb2.BackboneServiceDescribeRequest(), timeout=10,
                                           metadata=metadata),
                     lambda: list(stub.Generate(backbone_pb2.GenerateRequest(prompt="x", max_tokens=2), timeout=10,
                                                metadata=metadata))):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "--api-key-file" in err.value.details()
    # Health stays open (for probes); the key opens the rest.
    health = health_pb2_grpc.HealthStub(local.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    base = f"http://127.0.0.1:{local.http_port}/v1"
    with pytest.raises(openai.AuthenticationError) as refused:
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).completions.create(
            model=local.model, prompt="x", max_tokens=2)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    client = openai.OpenAI(base_url=base, api_key=local.metadata[0][1][len("Bearer "):], max_retries=0)
    reply = client.completions.create(model=local.model, prompt=PROMPTS[1], max_tokens=TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].text == local.generate(**_greedy(PROMPTS[1]))[1]


def test_sampling_is_the_requests_own_stop_strings_end_the_text(services):
    _, remote, local = services
    sampled = dict(prompt="Once upon a time", max_tokens=12, ignore_eos=True, digest_logits=True,
                   sampling=backbone_pb2.Sampling(temperature=0.9, top_p=0.95, top_k=40, seed=1234))
    alone = local.generate(**sampled)
    assert alone[2].seed == 1234
    # The same seed draws the same tokens in a batch with others, on the swarm too.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        noise = [pool.submit(local.generate, **_greedy(p)) for p in PROMPTS[:6]]
        again = pool.submit(local.generate, **sampled)
        on_swarm = pool.submit(remote.generate, **sampled)
        assert again.result()[:2] == alone[:2] and on_swarm.result()[:2] == alone[:2]
        for f in noise:
            f.result()
    other = local.generate(**{**sampled, "sampling": backbone_pb2.Sampling(temperature=0.9, seed=99)})
    assert other[0] != alone[0]
    unseeded = local.generate(**{**sampled, "sampling": backbone_pb2.Sampling(temperature=0.9)})
    assert unseeded[2].HasField("seed")
    # top_k 1 is greedy whatever the temperature.
    greedy = local.generate(**_greedy("Once upon a time"))
    top1 = local.generate(**{**_greedy("Once upon a time"), "sampling": backbone_pb2.Sampling(temperature=2.0,
                                                                                             top_k=1, seed=5)})
    assert top1[0] == greedy[0]
    # A stop string: the text ends before it; what came before is the greedy text's start.
    text = greedy[1]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip()
    ids, cut, s = local.generate(**_greedy("Once upon a time"), stop=[stop, "never-there"])
    assert s.finish_reason == backbone_pb2.FINISH_REASON_STOP and s.stop == stop
    assert cut == text[: text.index(stop)] and stop not in cut
    assert ids == greedy[0][: len(ids)] and s.completion_tokens == len(ids) < TOKENS


def _long(prompt: str = "a long one") -> backbone_pb2.GenerateRequest:
    return backbone_pb2.GenerateRequest(prompt=prompt, max_tokens=2000, ignore_eos=True)


def test_a_caller_that_goes_away_frees_its_slot_and_a_full_service_says_resource_exhausted(services):
    _, _, local = services
    call = local.stub.Generate(_long(), timeout=60, metadata=local.metadata)
    next(call)
    next(call)
    wait_until(lambda: local.describe().running == 1, 10, "the long call to run")
    call.cancel()
    wait_until(lambda: local.describe().running == 0, 10, "the cancelled call's slot to be freed")
    # Fill every slot (8) and the waiting line (24): the next call is refused at once.
    calls = [local.stub.Generate(_long(f"long {i}"), timeout=60, metadata=local.metadata) for i in range(32)]
    try:
        try:
            wait_until(lambda: local.describe().running + local.describe().waiting == 32, 60, "32 calls to be held")
        except AssertionError as exc:  # say what the service held and how the calls that were not held ended
            d = local.describe()
            ended = [(i, c.code().name, c.details()) for i, c in enumerate(calls) if c.done()]
            raise AssertionError(f"{exc}: running {d.running}, waiting {d.waiting}; ended: {ended}") from None
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            local.generate(**_greedy("one too many"), timeout=20)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
        assert "slots are busy" in refused.value.details() and time.monotonic() - t0 < 5
    finally:
        for c in calls:
            c.cancel()
    wait_until(lambda: local.describe().running + local.describe().waiting == 0, 20, "every slot to be freed")
    assert local.generate(**_greedy("served again"))[2].completion_tokens == TOKENS


@pytest.mark.parametrize("fields, code, names", [
    (dict(prompt="x", sampling=backbone_pb2.Sampling(temperature=-1)), "INVALID_ARGUMENT", "sampling.temperature"),
    (dict(prompt="x", sampling=backbone_pb2.Sampling(top_p=1.5)), "INVALID_ARGUMENT", "sampling.top_p"),
    (dict(prompt=""), "INVALID_ARGUMENT", "prompt"),
    (dict(prompt="x", prompt_token_ids=[5]), "INVALID_ARGUMENT", "prompt"),
    (dict(prompt_token_ids=[5, 999_999]), "INVALID_ARGUMENT", "prompt_token_ids"),
    (dict(prompt="x", max_tokens=5000), "INVALID_ARGUMENT", "max_tokens"),
    (dict(prompt_token_ids=[5] * 2040, max_tokens=16), "INVALID_ARGUMENT", "max_tokens"),
    (dict(prompt_token_ids=[5] * 2048), "INVALID_ARGUMENT", "prompt"),
    (dict(prompt="x", stop=["s"] * 9), "INVALID_ARGUMENT", "stop"),
    (dict(prompt="x", stop=[""]), "INVALID_ARGUMENT", "stop[0]"),
    (dict(prompt="x", model="gpt-4"), "NOT_FOUND", "model"),
], ids=["temperature", "top_p", "empty", "both", "vocab", "max_tokens", "context", "prompt-too-long", "stops",
        "empty-stop", "model"])
def test_a_bad_request_gets_the_status_naming_the_field_and_the_service_goes_on(services, fields, code, names):
    _, remote, _ = services
    with pytest.raises(grpc.RpcError) as err:
        remote.generate(**fields, timeout=20)
    assert err.value.code() == getattr(grpc.StatusCode, code)
    assert err.value.details().startswith(f"{names}:"), err.value.details()
    assert remote.generate(prompt="still serving", max_tokens=2, ignore_eos=True)[2].completion_tokens == 2


def test_grpcurl_lists_describes_and_streams_generate_through_reflection(services):
    _, remote, _ = services

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([grpcurl_path(), "-plaintext", "-max-time", "30", *args], capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL)

    listed = run(remote.address, "list")
    assert listed.returncode == 0, listed.stderr
    assert {"kvasir.v1.BackboneService", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= set(listed.stdout.split())
    described = run(remote.address, "describe", "kvasir.v1.BackboneService")
    assert "rpc Generate ( .kvasir.v1.GenerateRequest ) returns ( stream .kvasir.v1.GenerateResponse )" in described.stdout
    out = run("-d", json.dumps({"prompt": PROMPTS[0], "max_tokens": TOKENS, "ignore_eos": True}), remote.address,
              "kvasir.v1.BackboneService/Generate")
    assert out.returncode == 0, out.stderr
    messages = [json.loads(m) for m in out.stdout.replace("}\n{", "}\x00{").split("\x00")]
    assert len(messages) >= 2 and messages[-1]["summary"]["completion_tokens"] == TOKENS
    expected = remote.generate(prompt=PROMPTS[0], max_tokens=TOKENS, ignore_eos=True)
    assert [t for m in messages for t in m.get("token_ids", [])] == expected[0]
    bad = run("-d", json.dumps({"prompt": "x", "max_tokens": 99999}), remote.address,
              "kvasir.v1.BackboneService/Generate")
    assert bad.returncode != 0 and "InvalidArgument" in bad.stderr and "max_tokens" in bad.stderr
    health = run(remote.address, "grpc.health.v1.Health/Check")
    assert health.returncode == 0 and "SERVING" in health.stdout


def test_a_liar_that_turns_after_30_calls_changes_no_token_of_any_stream(tiny_models, tmp_path):
    """The liar (without row checks, as an older worker: only audits see it) answers right for
    30 calls, so streams have sent tokens computed with its answers when an audit catches it;
    the service replays every running request without it and checks the tokens sent: every
    stream ends as the local run does, bit for bit."""
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path) as sw:
        liar, honest = swarm_with_dishonest(sw, model, "liar", (LIAR, "offset", "--after", "30", "--unchecked", "--"))
        remote = sw.start_backbone_service("remote", model, ["--wait-sessions", "2", "--audit-rate", "0.5"])
        local = sw.start_backbone_service("local", model, hub=False)
        svc, ref = Service(int(remote["grpc_port"]), ""), Service(int(local["grpc_port"]), "")
        requests = [_greedy(p) for p in PROMPTS[:8]]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda r: svc.generate(**r), requests))
        expected = [ref.generate(**r) for r in requests]
        for (ids, text, _), (ids_l, text_l, _) in zip(got, expected):
            assert ids == ids_l and text == text_l
        stats = svc.describe().stats
        assert list(stats.sessions_quarantined) == [liar.session_id]
        assert stats.replays >= 1
        assert svc.describe().live_sessions == 1
        # Later requests use the honest worker only.
        after = svc.generate(**_greedy("after the liar"))
        assert after[2].remote_rows > 0 and after[2].fallback_rows == 0
        assert after[2].logits_digest == ref.generate(**_greedy("after the liar"))[2].logits_digest
        assert honest.session_id in {s.session_id for s in sw.list_sessions()}
