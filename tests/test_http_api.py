"""The OpenAI-compatible HTTP API of ``python -m backbone serve --http``: one real server
process per module (a tiny checkpoint), reached with the official ``openai`` package, with
curl and with plain HTTP; the gRPC Describe on the same process shows its engine's load."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import pathlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from helpers import wait_until

from kvasir.swarm import LocalSwarm
from kvasir_rpc import backbone_pb2, backbone_pb2_grpc

pytestmark = pytest.mark.integration

START_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 60.0
MODEL = "tiny-moe"
MAX_BATCH, MAX_WAITING = 32, 2


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    log: pathlib.Path
    stub: Any

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def load(self) -> tuple[int, int]:
        """The engine's (running, waiting), from the gRPC Describe."""
        described = self.stub.Describe(backbone_pb2.BackboneServiceDescribeRequest(), timeout=10)
        return int(described.running), int(described.waiting)

    def running(self) -> int:
        return self.load()[0]

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with LocalSwarm(tmp_path_factory.mktemp("http")) as sw:
        info = sw.start_backbone_service(
            "backbone", tiny_models("qwen3_moe"), ["--model-name", MODEL, "--threads", "1", "--max-batch",
                                                   str(MAX_BATCH), "--max-waiting", str(MAX_WAITING)],
            hub=False, http=True, timeout=START_TIMEOUT_S)
        assert info["model"] == MODEL
        with grpc.insecure_channel(f"127.0.0.1:{info['grpc_port']}") as channel:
            yield Server(sw.procs["backbone"], int(info["http_port"]), int(info["grpc_port"]),  # type: ignore[call-overload]
                         sw.logs / "backbone.log", backbone_pb2_grpc.BackboneServiceStub(channel))


def _client(server: Server) -> Any:
    import openai

    # No retries: a test sees the first answer.
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S)


def _post(server: Server, path: str, body: bytes | object, *, content_type: str = "application/json",
          method: str = "POST") -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of one plain HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=CALL_TIMEOUT_S)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": content_type} if content_type else {}
        conn.request(method, path, body=data if method == "POST" else None, headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _complete(server: Server, prompt: str, max_tokens: int) -> str:
    status, body = _post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == max_tokens
    return str(body["choices"][0]["text"])


# -- the official client -----------------------------------------------------------------

def test_models(server: Server) -> None:
    client = _client(server)
    assert [m.id for m in client.models.list().data] == [MODEL]
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "kvasir")
    import openai

    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.code == "model_not_found"


def test_openai_completions_stream_equals_whole(server: Server) -> None:
    client = _client(server)
    args: dict[str, Any] = dict(model=MODEL, prompt="The quick brown fox", max_tokens=10, temperature=0,
                                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-") and whole.model == MODEL
    (choice,) = whole.choices
    assert choice.finish_reason == "length" and choice.index == 0 and choice.text
    assert whole.usage is not None and whole.usage.completion_tokens == 10
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 10

    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert len({c.id for c in chunks}) == 1

    # A prompt of token ids counts exactly those tokens.
    ids = client.completions.create(model=MODEL, prompt=[1, 300, 301, 302], max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert ids.usage is not None and (ids.usage.prompt_tokens, ids.usage.completion_tokens) == (4, 3)

    # Several prompts: several choices, each what it gives alone.
    both = client.completions.create(model=MODEL, prompt=["The quick brown fox", "Hello world"], max_tokens=10,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == choice.text
    assert both.choices[1].text == _complete(server, "Hello world", 10)


def test_openai_chat_stream_equals_whole(server: Server) -> None:
    client = _client(server)
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is your name?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    assert whole.usage is not None and 1 <= whole.usage.completion_tokens <= 8

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage == whole.usage

    # The prompt is the chat template's: the same text as a completion gives the same answer.
    prompt = ("<|im_start|>system\nYou are brief.<|im_end|>\n<|im_start|>user\nWhat is your name?<|im_end|>\n"
              "<|im_start|>assistant\n")
    same = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert same.choices[0].text == choice.message.content
    assert same.usage == whole.usage


def test_openai_errors_name_the_parameter(server: Server) -> None:
    import openai

    client = _client(server)
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(prompt="Hello", temperature=-1), "temperature"),
        (dict(prompt="Hello", max_tokens=0), "max_tokens"),
        (dict(prompt="Hello", n=2), "n"),
        (dict(prompt="Hello", top_p=1.5), "top_p"),
        (dict(prompt="Hello", echo=True), "echo"),
        (dict(prompt="Hello", max_tokens=10**9), "max_tokens"),
        (dict(prompt=[1, 10**6]), "prompt"),
    ]
    for args, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, **args)
        assert caught.value.param == param, (args, caught.value.body)
        assert caught.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])
    assert caught.value.param == "messages[0].role"
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="gpt-4", prompt="Hello")
    assert not_found.value.code == "model_not_found" and not_found.value.param == "model"


# -- curl --------------------------------------------------------------------------------

def _sse_data(raw: str) -> list[str]:
    """The data of each server-sent event, in order."""
    events = [e for e in raw.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), raw
    return [e.removeprefix("data: ") for e in events]


def test_curl_streams_server_sent_events(server: Server) -> None:
    curl = shutil.which("curl")
    assert curl is not None, "curl is a Debian base tool; the tests expect it"
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 9, "temperature": 0, "ignore_eos": True,
            "stream": True}
    out = subprocess.run([curl, "-sN", "--max-time", str(int(CALL_TIMEOUT_S)), "-H", "Content-Type: application/json",
                          "-d", json.dumps(body), f"{server.base_url}/completions"],
                         capture_output=True, text=True, timeout=CALL_TIMEOUT_S + 10, check=True)
    data = _sse_data(out.stdout)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == _complete(server, "Once upon a time", 9)

    chat = {"messages": [{"role": "user", "content": "Good morning"}], "max_tokens": 5, "temperature": 0,
            "stream": True}
    out = subprocess.run([curl, "-sN", "--max-time", str(int(CALL_TIMEOUT_S)), "-H", "Content-Type: application/json",
                          "-d", json.dumps(chat), f"{server.base_url}/chat/completions"],
                         capture_output=True, text=True, timeout=CALL_TIMEOUT_S + 10, check=True)
    data = _sse_data(out.stdout)
    assert data[-1] == "[DONE]"
    assert json.loads(data[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}


# -- bad requests --------------------------------------------------------------------------

BAD = [
    # (path, body, content type, status, param)
    ("/v1/completions", b'{"prompt": "Hello", ', "application/json", 400, None),
    ("/v1/completions", b'{"prompt": "Hello"}', "text/plain", 400, None),
    ("/v1/completions", b"", "", 400, None),
    ("/v1/completions", b'["Hello"]', "application/json", 400, None),
    ("/v1/completions", {"prompt": "Hello", "temperature": -1}, "application/json", 400, "temperature"),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 0}, "application/json", 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": "ten"}, "application/json", 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hello", "n": 2}, "application/json", 400, "n"),
    ("/v1/completions", {"prompt": "Hello", "seed": -1}, "application/json", 400, "seed"),
    ("/v1/completions", {"prompt": "Hello", "stop": ["x", 3]}, "application/json", 400, "stop"),
    ("/v1/completions", {"prompt": "Hello", "model": "no-such-model"}, "application/json", 404, "model"),
    ("/v1/completions", {"max_tokens": 4}, "application/json", 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, "application/json", 400, "prompt"),
    ("/v1/completions", {"prompt": "Hello", "frobnicate": 1}, "application/json", 400, "frobnicate"),
    ("/v1/completions", b'{"prompt": "' + b"a" * (1 << 20) + b'"}', "application/json", 413, None),
    ("/v1/chat/completions", {"prompt": "Hello"}, "application/json", 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "application/json", 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "application/json", 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     "application/json", 400, "tools"),
    ("/v1/nowhere", {"prompt": "Hello"}, "application/json", 404, None),
]


def test_bad_requests_get_openai_errors_and_the_service_goes_on(server: Server) -> None:
    for path, body, content_type, status, param in BAD:
        got, answer = _post(server, path, body, content_type=content_type)
        assert got == status, (path, body, answer)
        error = answer["error"]
        assert set(error) == {"message", "type", "param", "code"}, answer
        assert error["param"] == param and error["type"] == "invalid_request_error", answer
        assert error["message"], answer
    got, answer = _post(server, "/v1/completions", b"", method="GET")
    assert got == 405 and answer["error"]["message"]
    assert _complete(server, "Hello", 3)


# -- the batch -------------------------------------------------------------------------

def test_32_concurrent_greedy_requests_equal_each_alone(server: Server) -> None:
    prompts = ["Hello", "The weather today is", "Once upon a time there was", "Numbers: one, two",
               "Where do you live?", "A mixture of experts layer sends every token", "Good", "The market was busy:"]
    max_tokens = 12
    alone = {p: _complete(server, p, max_tokens) for p in prompts}
    jobs = [prompts[i % len(prompts)] for i in range(32)]
    busiest = 0
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(_complete, server, p, max_tokens) for p in jobs]
        deadline = time.monotonic() + CALL_TIMEOUT_S * 2
        while not all(f.done() for f in futures) and time.monotonic() < deadline:
            busiest = max(busiest, server.running())
            time.sleep(0.01)
        together = [f.result(timeout=CALL_TIMEOUT_S) for f in futures]
    assert together == [alone[p] for p in jobs]
    # Batched, not one after another: the engine ran several at once.
    assert busiest > 1, "the engine never ran two requests at once"


# -- clients that leave ----------------------------------------------------------------------

def _send(server: Server, path: str, body: dict[str, Any]) -> socket.socket:
    """A raw HTTP/1.1 request, sent; its socket."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=CALL_TIMEOUT_S)
    sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def _start_stream(server: Server, path: str, body: dict[str, Any]) -> tuple[socket.socket, bytes]:
    """A raw HTTP/1.1 streaming request; its socket and what it read, once the first event
    arrived."""
    sock = _send(server, path, body)
    seen = b""
    while b"data: " not in seen:
        chunk = sock.recv(4096)
        assert chunk, f"the server closed the stream: {seen!r}"
        seen += chunk
    assert seen.startswith(b"HTTP/1.1 200"), seen
    return sock, seen


def test_client_leaving_mid_stream_frees_its_slot(server: Server) -> None:
    common = {"model": MODEL, "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    long = {**common, "prompt": "Hello"}
    for path, body in (("/v1/completions", long),
                       ("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": "Hi"}]})):
        sock, _ = _start_stream(server, path, body)
        wait_until(lambda: server.running() == 1, 15.0, f"one request running ({path})")
        sock.close()
        wait_until(lambda: server.running() == 0, 15.0, f"the slot of a client that left {path}")
    # A client that leaves before a whole (non-streamed) answer is ready frees its slot too.
    sock = _send(server, "/v1/completions", {**long, "stream": False})
    wait_until(lambda: server.running() == 1, 15.0, "the whole-answer request to run")
    sock.close()
    wait_until(lambda: server.running() == 0, 15.0, "the slot of a client that left before its answer")
    assert _complete(server, "Hello", 3)


def test_full_engine_answers_429_and_recovers(server: Server) -> None:
    long = {"model": MODEL, "prompt": "Hello", "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    socks: list[socket.socket] = []
    try:
        for _ in range(MAX_BATCH):
            socks.append(_start_stream(server, "/v1/completions", long)[0])
        for _ in range(MAX_WAITING):
            socks.append(_send(server, "/v1/completions", long))
        wait_until(lambda: server.load() == (MAX_BATCH, MAX_WAITING), 30.0, "every slot and the waiting line taken")
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=CALL_TIMEOUT_S)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hello"}),
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            error = json.loads(response.read())["error"]
        finally:
            conn.close()
        assert response.status == 429 and response.getheader("Retry-After") == "1", error
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    finally:
        for sock in socks:
            sock.close()
    wait_until(lambda: server.load() == (0, 0), 30.0, "the slots of the clients that left")
    assert _complete(server, "Hello", 3)


# Last: it stops the module's server.
def test_sigterm_ends_running_streams_with_an_error(server: Server) -> None:
    sock, received = _start_stream(server, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 1000,
                                                               "ignore_eos": True, "stream": True})
    server.proc.send_signal(signal.SIGTERM)
    sock.settimeout(CALL_TIMEOUT_S)
    while chunk := sock.recv(65536):
        received += chunk
    sock.close()
    assert server.proc.wait(30) == 0, server.tail()
    body = received.split(b"\r\n\r\n", 1)[1].decode(errors="replace")
    assert '"code":"unavailable"' in body.split("data: ")[-1], body[-500:]
