"""What ``python -m backbone serve`` takes in is bounded before it works on it, against one real
process (a tiny checkpoint, experts local, gRPC and HTTP on 127.0.0.1): prompts of megabytes
are refused at once without being tokenized and leave its memory as it was, text that is no
Unicode gets INVALID_ARGUMENT or 400 naming the field, clients that send nothing or half a
request are disconnected while others are served, and an address beyond loopback needs an
API key or an explicit --no-auth. The rules themselves: tests/test_serve_limits.py."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import psutil
import pytest
from helpers import ROOT

from kvasir.swarm import LocalSwarm
from kvasir_rpc import backbone_pb2, backbone_pb2_grpc

pytestmark = pytest.mark.integration

START_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 60.0
# A refusal that needs no tokenizing comes at once; this bounds it on a loaded CI machine.
REFUSED_WITHIN_S = 5.0
# What the backbone's memory may grow by while it refuses every oversized prompt of a test.
RSS_GROWTH_BYTES = 200 << 20
# The server's --http-timeout; a disconnect is expected by then plus this margin.
HTTP_TIMEOUT_S = 3.0
DISCONNECT_MARGIN_S = 10.0
# The tiny checkpoint's context (2048 tokens) times 16 bytes a token.
PROMPT_LIMIT = 32768
MEGABYTES_4 = 4_000_000


@dataclass
class Server:
    pid: int
    grpc_port: int
    http_port: int
    channel: grpc.Channel
    stub: Any
    log: pathlib.Path

    def rss(self) -> int:
        return int(psutil.Process(self.pid).memory_info().rss)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with LocalSwarm(tmp_path_factory.mktemp("intake")) as sw:
        info = sw.start_backbone_service("intake", tiny_models("qwen3_moe"),
                                         ["--threads", "1", "--http-timeout", str(HTTP_TIMEOUT_S)],
                                         hub=False, http=True, timeout=START_TIMEOUT_S)
        with grpc.insecure_channel(f"127.0.0.1:{info['grpc_port']}") as channel:
            ports: dict[str, Any] = info
            srv = Server(sw.procs["intake"].pid, int(ports["grpc_port"]), int(ports["http_port"]), channel,
                         backbone_pb2_grpc.BackboneServiceStub(channel), sw.logs / "intake.log")
            # Warm: the first decode and the first refusal allocate what every later one reuses.
            assert _generate(srv, "Hello")
            _refused_grpc(srv, "x" * (PROMPT_LIMIT + 1))
            assert _post(srv, "/v1/completions", {"prompt": "x" * (PROMPT_LIMIT + 1)})[0] == 400
            yield srv


def _generate(server: Server, prompt: str) -> str:
    request = backbone_pb2.GenerateRequest(prompt=prompt, max_tokens=3, ignore_eos=True)
    return "".join(m.text for m in server.stub.Generate(request, timeout=CALL_TIMEOUT_S))


def _refused_grpc(server: Server, prompt: str) -> tuple[grpc.RpcError, float]:
    """The error of a Generate with ``prompt`` and how long it took to come."""
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        list(server.stub.Generate(backbone_pb2.GenerateRequest(prompt=prompt, max_tokens=2), timeout=CALL_TIMEOUT_S))
    return refused.value, time.monotonic() - t0


def _post(server: Server, path: str, body: bytes | object) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of one plain HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=CALL_TIMEOUT_S)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _until_closed(sock: socket.socket, timeout: float) -> bytes:
    """What the server sends on ``sock`` until it closes the connection, within ``timeout``."""
    sock.settimeout(timeout)
    received = b""
    deadline = time.monotonic() + timeout
    while chunk := sock.recv(65536):
        received += chunk
        sock.settimeout(max(0.01, deadline - time.monotonic()))
    return received


def _one_response(sock: socket.socket, timeout: float) -> bytes:
    """One whole HTTP/1.1 response with a Content-Length, read from ``sock`` within ``timeout``."""
    sock.settimeout(timeout)
    received = b""
    deadline = time.monotonic() + timeout
    while True:
        head, sep, body = received.partition(b"\r\n\r\n")
        if sep:
            lengths = [line.split(b":", 1)[1] for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")]
            assert lengths, head
            if len(body) >= int(lengths[0]):
                return received
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection mid-response: {received!r}"
        received += chunk
        sock.settimeout(max(0.01, deadline - time.monotonic()))


def _concurrently(n: int, call: Any) -> list[Any]:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return [f.result(timeout=CALL_TIMEOUT_S) for f in [pool.submit(call) for _ in range(n)]]


# -- prompts of megabytes ----------------------------------------------------------------------

def test_three_4mb_prompts_over_grpc_are_refused_at_once_untokenized(server: Server) -> None:
    before = server.rss()
    results = _concurrently(3, lambda: _refused_grpc(server, "x" * MEGABYTES_4))
    for err, took in results:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        # The size check's message: the tokenizer would have said "prompt: is N tokens".
        assert err.details().startswith(f"prompt: {MEGABYTES_4} bytes of UTF-8 text, more than this backbone's "
                                        f"limit of {PROMPT_LIMIT} bytes"), err.details()
        assert "--max-prompt-bytes" in err.details()
        assert took < REFUSED_WITHIN_S, took
    # Past the largest message a valid request may take, grpc refuses it unread.
    huge = backbone_pb2.GenerateRequest(prompt="x" * 100_000_000, max_tokens=2)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        list(server.stub.Generate(huge, timeout=CALL_TIMEOUT_S))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    assert "larger than max" in refused.value.details() and time.monotonic() - t0 < REFUSED_WITHIN_S * 2
    del huge
    assert server.rss() - before < RSS_GROWTH_BYTES, (before, server.rss())
    assert _generate(server, "still serving")


def _too_large_over_http(server: Server) -> tuple[bytes, float]:
    """A 4 MB completion body announced in Content-Length, its first 64 KiB sent: the answer
    (read before sending more, as a client that expects 100-continue would)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=CALL_TIMEOUT_S) as sock:
        body = b'{"prompt": "' + b"x" * (MEGABYTES_4 - 14) + b'"}'
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:65536])
        return _until_closed(sock, CALL_TIMEOUT_S), time.monotonic() - t0


def _too_large_in_chunks(server: Server) -> bytes:
    """A completion body with no Content-Length, sent in chunks until it is one byte over the
    limit: the answer (read before sending the rest)."""
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=CALL_TIMEOUT_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        left = (1 << 20) + 1
        while left:
            n = min(left, 60000)
            sock.sendall(f"{n:x}\r\n".encode() + b"x" * n + b"\r\n")
            left -= n
        return _until_closed(sock, CALL_TIMEOUT_S)


def _error_413(answer: bytes) -> dict[str, Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer[:300]
    error: dict[str, Any] = json.loads(body)["error"]
    assert error["code"] == "request_too_large" and f"limit of {1 << 20} bytes" in error["message"], error
    return error


def test_three_4mb_bodies_and_prompts_over_http_are_refused_at_once_untokenized(server: Server) -> None:
    before = server.rss()
    for answer, took in _concurrently(3, lambda: _too_large_over_http(server)):
        _error_413(answer)
        assert took < REFUSED_WITHIN_S, took
    # Without a Content-Length, the body is cut as soon as it is over the limit.
    _error_413(_too_large_in_chunks(server))
    # Under the body's limit, over the prompt's: 400 from the size check, before the tokenizer.
    prompt = "y" * 900_000
    for status, answer in _concurrently(3, lambda: _post(server, "/v1/completions", {"prompt": prompt})):
        assert status == 400 and answer["error"]["param"] == "prompt", answer
        assert answer["error"]["message"].startswith(f"prompt: 900000 bytes of UTF-8 text, more than this "
                                                     f"backbone's limit of {PROMPT_LIMIT} bytes"), answer
    # A chat's messages count together: each is under the limit, both are over it.
    half = "z" * (PROMPT_LIMIT // 2 + 1)
    messages = [{"role": "system", "content": half}, {"role": "user", "content": half}]
    status, answer = _post(server, "/v1/chat/completions", {"messages": messages})
    assert status == 400 and answer["error"]["param"] == "messages", answer
    assert answer["error"]["message"].startswith(f"messages: {2 * len(half)} bytes of UTF-8 text"), answer
    assert server.rss() - before < RSS_GROWTH_BYTES, (before, server.rss())
    status, answer = _post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert status == 200, answer


# -- text that is no Unicode -------------------------------------------------------------------

SURROGATES = [
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\ud800"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/completions", b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": "Hello", "stop": "\\ud800"}', "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\udfff"]}', "stop[0]"),
]


def test_a_lone_surrogate_over_http_is_a_400_naming_where(server: Server) -> None:
    for path, body, param in SURROGATES:
        status, answer = _post(server, path, body)
        assert status == 400, (path, body, answer)
        error = answer["error"]
        assert (error["param"], error["type"]) == (param, "invalid_request_error"), answer
        assert error["message"].startswith(f"{param}: ") and "lone UTF-16 surrogate" in error["message"], answer
    status, answer = _post(server, "/v1/completions", b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}')
    assert status == 200, answer


def test_a_grpc_string_that_is_not_utf8_is_invalid_argument_naming_the_field(server: Server) -> None:
    def field(number: int, payload: bytes) -> bytes:
        return bytes([number << 3 | 2, len(payload)]) + payload

    generate = server.channel.unary_stream("/kvasir.v1.BackboneService/Generate")
    describe = server.channel.unary_unary("/kvasir.v1.BackboneService/Describe")
    list_models = server.channel.unary_unary("/kvasir.v1.BackboneService/ListModels")
    t = CALL_TIMEOUT_S
    cases = [
        (lambda: list(generate(field(2, b"\xed\xa0\x80") + b"\x20\x02", timeout=t)), "prompt: is not UTF-8"),
        (lambda: list(generate(field(2, b"Hello") + field(6, b"\xff"), timeout=t)), "stop[0]: is not UTF-8"),
        (lambda: describe(field(1, b"\xed\xa0\x80"), timeout=t), "model: is not UTF-8"),
        (lambda: list_models(b"\xff\xff\xff", timeout=t), "the request is not a kvasir.v1.ListModelsRequest"),
    ]
    for call, starts in cases:
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
        assert refused.value.details().startswith(starts), refused.value.details()
    assert _generate(server, "still serving")


# -- clients that send nothing, or half ----------------------------------------------------------

def test_idle_and_half_sent_http_requests_are_disconnected_and_others_are_served_meanwhile(server: Server) -> None:
    def connect(data: bytes) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=CALL_TIMEOUT_S)
        sock.sendall(data)
        return sock

    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    opened = time.monotonic()
    socks = {
        "nothing": connect(b""),
        "half a head": connect(head[:40]),
        "half a body": connect(head + b"Content-Length: 100\r\n\r\n" + b'{"prompt": "Hello",'),
    }
    # An idle keep-alive connection, after a whole request and its answer.
    kept = connect(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    first = _one_response(kept, CALL_TIMEOUT_S)
    assert first.startswith(b"HTTP/1.1 200") and b'"status":"ok"' in first, first
    socks["idle after a request"] = kept
    try:
        # Served while those are held.
        status, answer = _post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        assert status == 200, answer
        answers = {what: _until_closed(sock, HTTP_TIMEOUT_S + DISCONNECT_MARGIN_S) for what, sock in socks.items()}
        waited = time.monotonic() - opened
    finally:
        for sock in socks.values():
            sock.close()
    assert answers["nothing"] == b"" and answers["half a head"] == b"" and answers["idle after a request"] == b""
    assert answers["half a body"].startswith(b"HTTP/1.1 408"), answers["half a body"][:300]
    assert b"--http-timeout" in answers["half a body"]
    # Disconnected by the timeout, not at once and not much later.
    assert HTTP_TIMEOUT_S - 0.5 <= waited < HTTP_TIMEOUT_S + DISCONNECT_MARGIN_S, waited
    status, answer = _post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert status == 200, answer


# -- who may call ---------------------------------------------------------------------------------

# A start-up mistake is reported before torch loads; this bounds it on a loaded CI machine.
FAIL_FAST_S = 30.0


@pytest.mark.parametrize("args, says", [
    (["--listen", "0.0.0.0:0"], "backbone: --listen 0.0.0.0:0 is beyond loopback"),
    (["--listen", "127.0.0.1:0", "--http", "0.0.0.0:0"], "backbone: --http 0.0.0.0:0 is beyond loopback"),
    (["--listen", "127.0.0.1:0", "--no-auth", "--api-key-file", "{tmp}/k"], "backbone: --no-auth and --api-key-file"),
], ids=["listen", "http", "both-flags"])
def test_serve_beyond_loopback_without_a_key_fails_in_one_line(tiny_models, tmp_path: pathlib.Path,
                                                               args: list[str], says: str) -> None:
    t0 = time.monotonic()
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = subprocess.run([sys.executable, "-m", "backbone", "serve", "--model", str(tiny_models("qwen3_moe")), *args],
                         capture_output=True, text=True, timeout=FAIL_FAST_S * 4, cwd=ROOT, stdin=subprocess.DEVNULL,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith(says), lines[0]
    if "contradict" not in lines[0]:
        assert "--api-key-file FILE" in lines[0] and "--no-auth" in lines[0], lines[0]
    assert time.monotonic() - t0 < FAIL_FAST_S
    assert not (tmp_path / "k").exists()
