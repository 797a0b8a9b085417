"""The benchmark's cost by hop: the CPU-time reader, and the --echo-experts worker that the
fabric-only path uses (right shapes, wrong values: audits catch it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import pytest
import torch
from helpers import wait_until

from kvasir.bench import decode_hop_figures, hop_figures, hop_table
from kvasir.bench.cpu import CpuMeter, ProcessGoneError, cpu_seconds, ns_per_byte
from kvasir.bench.floors import hop_floors, measure_primitives
from kvasir.bench.hops import add_trio_bounds
from kvasir.swarm import LocalSwarm, SwarmError
from kvasir_rpc import (
    TARGET_KEY_METADATA,
    decode_tensor,
    encode_tensor,
    expert_pb2,
    expert_pb2_grpc,
    target_key,
)

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint('done', flush=True)\ninput()"


def test_cpu_seconds_of_a_process_that_burns_cpu():
    proc = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        with CpuMeter({"burner": proc.pid, "me": None}) as meter:
            assert proc.stdout is not None and proc.stdout.readline() == b"done\n"  # burnt 0.3 s of CPU
        assert meter.reading.cpu_s["burner"] >= 0.2
        assert meter.reading.cpu_s["me"] >= 0.0
        assert cpu_seconds(proc.pid) >= 0.2
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_cpu_seconds_of_a_process_that_is_gone():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    # Ended, not reaped yet (a zombie): its CPU time is no longer counted, so no reading.
    gone: list[ProcessGoneError] = []

    def ended() -> bool:
        try:
            cpu_seconds(proc.pid)
        except ProcessGoneError as exc:
            gone.append(exc)
        return bool(gone)

    wait_until(ended, 30, "the child to end")
    assert str(proc.pid) in str(gone[0]) and "ended" in str(gone[0])
    proc.wait(timeout=10)
    with pytest.raises(ProcessGoneError, match=f"process {proc.pid} is gone"):
        cpu_seconds(proc.pid)


def test_cpu_seconds_of_this_process_and_a_meter_read_too_soon():
    assert cpu_seconds() == pytest.approx(time.process_time(), abs=0.05)
    assert cpu_seconds(os.getpid()) > 0
    with pytest.raises(RuntimeError, match="once its with block has ended"):
        CpuMeter({}).reading  # noqa: B018
    assert ns_per_byte(0.5, 10**9) == 0.5 and ns_per_byte(1.0, 0) is None


def test_hop_figures_and_table_of_a_result():
    point = {"ns_per_byte": {"client": 1.0, "hub": 2.0, "gateway": 3.0, "worker": 4.0}, "ns_per_byte_total": 10.0,
             "mb_s": 90.0}
    hops = {"batch": 512, "calls": 4, "fabric": point, "fabric_b1": {"p50_ms": 3.0}}
    figures = hop_figures(hops)
    assert figures["fabric_ns_per_byte_gateway_b512"] == 3.0 and figures["fabric_mb_s_b512"] == 90.0
    assert figures["fabric_ns_per_byte_total_b512"] == 10.0 and figures["fabric_p50_ms_b1"] == 3.0
    table = hop_table(hops).splitlines()
    assert table[3].split() == ["fabric", "1.0", "2.0", "3.0", "-", "4.0", "10.0", "90.0"]
    remote = {"ns_per_byte": {"hub": 2.5, "latency": 0.5}, "latency_proxy_cpu_share": 0.01,
              "backbone_decode_cpu_ms_per_token": 3.0}
    decode = {"hops": {"local": {"backbone_decode_cpu_ms_per_token": 4.0}, "rtt0": remote, "rtt13": remote,
                       "rtt50": {**remote, "latency_proxy_cpu_share": 0.02}}}
    figures = decode_hop_figures(decode)
    assert figures["decode_rtt0_ns_per_byte_hub"] == 2.5 and figures["latency_proxy_cpu_share_rtt50"] == 0.02
    assert figures["decode_backbone_cpu_ms_per_token_local"] == 4.0
    assert decode_hop_figures({}) == {}


def test_each_hops_floor_adds_up_what_it_must_do_to_a_byte():
    """One byte in each direction through each hop: kernel copies in and out, TLS on the
    gateway's legs, the end-to-end AEAD, the mask on what WebSocket clients send."""
    p = {"tcp_send": 0.2, "tcp_receive": 0.3, "unix_send": 0.1, "unix_receive": 0.1, "tls_encrypt": 0.6,
         "tls_decrypt": 0.4, "aes_256_gcm_seal": 0.14, "aes_256_gcm_open": 0.1, "chacha20_poly1305_seal": 0.5,
         "chacha20_poly1305_open": 0.3, "mask": 0.04, "tls_cipher": "TLS_AES_256_GCM_SHA384"}
    f = hop_floors(p)
    assert f["gateway"]["gateway"] == pytest.approx(0.5 + 1.0 + 0.04)
    assert f["gateway"]["hub"] == pytest.approx(0.5 + 0.5 + 0.12 + 0.02)
    assert f["gateway"]["worker"] == pytest.approx(0.25 + 0.5 + 0.12 + 0.02 + 0.2)
    assert f["hub"]["hub"] == pytest.approx(0.52) and f["hub"]["client"] == pytest.approx(0.25)
    assert hop_floors(p, aead="chacha20_poly1305")["gateway"]["hub"] == pytest.approx(0.5 + 0.5 + 0.4 + 0.02)
    point = {"ns_per_byte": {"client": 0.5, "hub": 2.0, "gateway": 3.0, "worker": 4.0}, "ns_per_byte_total": 9.5,
             "mb_s": 90.0, "floor_ns_per_byte": {"client": 0.25, "hub": 1.14, "gateway": 1.54, "worker": 1.09},
             "over_floor": {"client": 2.0, "hub": 1.75, "gateway": 1.95, "worker": 3.67}}
    hops = {"batch": 512, "calls": 4, "fabric": point}
    assert hop_figures(hops)["fabric_floor_ns_per_byte_gateway_b512"] == 1.54
    assert hop_figures(hops)["fabric_over_floor_worker_b512"] == 3.67
    assert hop_table(hops).splitlines()[4].split() == ["floor", "0.25", "1.14", "1.54", "-", "1.09"]
    assert hop_table(hops).splitlines()[5].split() == ["/floor", "2.0", "1.75", "1.95", "-", "3.67"]
    # The direct path: the client and the worker, and grpcio's floor (the kernel's copy) for both.
    assert hop_floors(p)["direct"] == {"client": pytest.approx(0.25), "worker": pytest.approx(0.25)}
    assert hop_floors(p)["relay"]["relay"] == pytest.approx(0.5)


def test_a_relay_hops_trio_bound_is_the_bare_relay_plus_its_own_floors_extra_work():
    """The bare trio relay measured 0.9 ns/B against its floor's 0.5: the hub on the hub path
    may cost that plus its mask (0.02), the gateway that plus TLS and its mask (1.04)."""
    p = {"tcp_send": 0.2, "tcp_receive": 0.3, "unix_send": 0.1, "unix_receive": 0.1, "tls_encrypt": 0.6,
         "tls_decrypt": 0.4, "aes_256_gcm_seal": 0.14, "aes_256_gcm_open": 0.1, "chacha20_poly1305_seal": 0.5,
         "chacha20_poly1305_open": 0.3, "mask": 0.04}
    hops: dict[str, object] = {
        "batch": 512, "calls": 4,
        "relay": {"ns_per_byte": {"client": 0.5, "relay": 0.9, "worker": 1.0}, "ns_per_byte_total": 2.4, "mb_s": 1.0},
        "hub": {"ns_per_byte": {"client": 0.5, "hub": 1.84, "worker": 1.0}, "ns_per_byte_total": 3.3, "mb_s": 1.0},
        "fabric": {"ns_per_byte": {"client": 0.5, "hub": 2.0, "gateway": 3.88, "worker": 1.0},
                   "ns_per_byte_total": 7.4, "mb_s": 1.0}}
    add_trio_bounds(hops, hop_floors(p))
    assert hops["hub"]["trio_bound_ns_per_byte"] == {"hub": 0.92}  # type: ignore[index]
    assert hops["hub"]["over_trio_bound"] == {"hub": 2.0}  # type: ignore[index]
    assert hops["fabric"]["trio_bound_ns_per_byte"]["gateway"] == pytest.approx(1.94)  # type: ignore[index]
    assert hops["fabric"]["over_trio_bound"]["gateway"] == 2.0  # type: ignore[index]
    assert hop_figures(hops)["hub_over_trio_bound_hub_b512"] == 2.0
    assert [line.split() for line in hop_table(hops).splitlines() if line.startswith("  /trio")] == [
        ["/trio", "-", "2.0", "-", "-", "-"], ["/trio", "-", "1.3", "2.0", "-", "-"]]
    add_trio_bounds({"hub": hops["hub"]}, hop_floors(p))  # no relay measured: nothing to add, no error


def test_the_primitives_are_measured_here():
    got = measure_primitives(reps=1, runs=1)
    names = ("tcp_send", "tcp_receive", "unix_send", "unix_receive", "tls_encrypt", "tls_decrypt",
             "chacha20_poly1305_seal", "chacha20_poly1305_open", "aes_256_gcm_seal", "aes_256_gcm_open", "mask")
    assert all(isinstance(got[n], float) and got[n] > 0 for n in names), got
    assert str(got["tls_cipher"]).startswith("TLS_") and "OpenSSL" in str(got["openssl"])


@pytest.mark.integration
def test_the_bare_trio_relay_carries_every_byte_both_ways_and_the_end(tmp_path):
    """The hop bench's bound is a real relay: 3 MB each way through it, in order, and the
    upstream's end of stream reaches the client."""
    import socket
    import threading

    data = os.urandom(3 << 20)
    with socket.create_server(("127.0.0.1", 0)) as ls:
        def upstream() -> None:
            conn, _ = ls.accept()
            with conn:
                conn.settimeout(30)
                got = bytearray()
                while len(got) < len(data):
                    chunk = conn.recv(1 << 20)
                    if not chunk:
                        break
                    got += chunk
                conn.sendall(bytes(reversed(got)))
                conn.shutdown(socket.SHUT_WR)

        th = threading.Thread(target=upstream, daemon=True)
        th.start()
        with LocalSwarm(tmp_path) as sw:
            port = sw.start_trio_relay("relay", ls.getsockname()[1])
            with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
                c.sendall(data)
                back = bytearray()
                while chunk := c.recv(1 << 20):
                    back += chunk
            th.join(timeout=30)
    assert bytes(back) == data[::-1]


def test_swarm_pid_of_an_unknown_process(tmp_path):
    with LocalSwarm(tmp_path) as sw, pytest.raises(SwarmError, match="no process named 'hub'"):
        sw.pid("hub")


@pytest.mark.integration
def test_echo_worker_answers_in_shape_and_an_audited_backbone_quarantines_it(tiny_models, tmp_path):
    model = tiny_models("qwen3_moe")
    hidden_size = json.loads((model / "config.json").read_text())["hidden_size"]
    with LocalSwarm(tmp_path) as sw:
        sw.start_hub()
        sw.start_worker("honest", model, "*:4-7")
        sw.start_worker("echo", model, "*:0-3", extra=["--echo-experts"])
        sw.wait_sessions(2, watch=["honest", "echo"])
        echo = {s.slices[0].experts[0]: s for s in sw.list_sessions()}[0]
        rows = torch.randn(2, hidden_size)
        meta = ((TARGET_KEY_METADATA, target_key(sw.backbone_token, echo.session_id)),)
        with grpc.insecure_channel(echo.target) as ch:
            stub = expert_pb2_grpc.ExpertServiceStub(ch)
            plain = expert_pb2.DispatchRequest(call_id=1, layer=0, hidden=encode_tensor(rows),
                                               weights=encode_tensor(torch.rand(2)),
                                               segments=[expert_pb2.ExpertSegment(expert=0, rows=2)])
            shared = expert_pb2.DispatchRequest(call_id=2, layer=0, hidden=encode_tensor(rows),
                                                weights=encode_tensor(torch.rand(3)), row_index=[1, 0, 1],
                                                segments=[expert_pb2.ExpertSegment(expert=0, rows=1),
                                                          expert_pb2.ExpertSegment(expert=1, rows=2)])
            bad = expert_pb2.DispatchRequest(call_id=3, layer=0, hidden=encode_tensor(rows),
                                             weights=encode_tensor(torch.rand(2)),
                                             segments=[expert_pb2.ExpertSegment(expert=0, rows=3)])
            answers = list(stub.Dispatch(iter([plain, shared]), metadata=meta, timeout=30))
            # Exactly the expected shape and bytes: the input rows, uncomputed.
            assert answers[0].partials.partials == plain.hidden
            assert torch.equal(decode_tensor(answers[1].partials.partials), rows[[1, 0, 1]])
            # Its requests are still checked like any worker's.
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Dispatch(iter([bad]), metadata=meta, timeout=30))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        result = sw.run_backbone(["--model", str(model), "--prompt", "echo", "--batch", "2", "--max-new-tokens", "6",
                                  "--compare-local", "--wait-sessions", "2"])
        assert result["backbone_exit_code"] == 0 and result["max_abs_logit_diff"] == 0.0
        assert result["sessions_quarantined"] == [echo.session_id]


@pytest.mark.parametrize(("rtt_ms", "mode"), [(0, []), (40, []), (40, ["--copy"])], ids=["rtt0", "rtt40", "rtt40-copy"])
def test_latency_proxy_delivers_every_byte_in_order_late_by_the_rtt(rtt_ms, mode, tmp_path):
    """Megabytes each way through the proxy arrive intact; a small message's round trip
    takes the emulated RTT (not much more), and a new one written to the RTT file; a
    half-close passes through both ways. By splice(2), and copying where there is none."""
    import socket
    import threading

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        rtt_file = tmp_path / "rtt"
        rtt_file.write_text(str(rtt_ms))
        ready = tmp_path / "ready.json"
        proxy = subprocess.Popen([sys.executable, "-m", "kvasir.latency", "--upstream",
                                  f"127.0.0.1:{server.getsockname()[1]}", "--rtt-file", str(rtt_file),
                                  "--ready-file", str(ready), *mode])
        try:
            wait_until(lambda: ready.exists() or proxy.poll() is not None, 30, "the proxy to start")
            assert proxy.poll() is None, "the proxy ended at start"
            client = socket.create_connection(("127.0.0.1", json.loads(ready.read_text())["port"]), timeout=30)
            server.settimeout(30)
            far, _ = server.accept()
            far.settimeout(30)

            def echo() -> None:  # the far end sends back all it gets, then half-closes
                while data := far.recv(1 << 16):
                    far.sendall(data)
                far.shutdown(socket.SHUT_WR)

            threading.Thread(target=echo, daemon=True).start()
            with client, far:
                blob = os.urandom(3 << 20)
                sender = threading.Thread(target=client.sendall, args=(blob,), daemon=True)
                sender.start()
                back = bytearray()
                while len(back) < len(blob):
                    chunk = client.recv(1 << 20)
                    assert chunk, "the proxy closed early"
                    back += chunk
                sender.join(timeout=30)
                assert bytes(back) == blob
                rounds = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    client.sendall(b"ping")
                    assert client.recv(16) == b"ping"
                    rounds.append((time.perf_counter() - t0) * 1000)
                assert rtt_ms <= min(rounds) < rtt_ms + 30, rounds
                # A new RTT in the file holds once bytes flow (the proxy looks at the file at most
                # every 0.1 s while they do, as the decode bench relies on): longer than the old.
                new_rtt = rtt_ms + 45
                rtt_file.write_text(str(new_rtt))
                deadline = time.monotonic() + 10
                while True:
                    t0 = time.perf_counter()
                    client.sendall(b"ping")
                    assert client.recv(16) == b"ping"
                    if (time.perf_counter() - t0) * 1000 >= new_rtt:
                        break
                    assert time.monotonic() < deadline, f"the proxy did not take up an RTT of {new_rtt} ms in 10 s"
                client.shutdown(socket.SHUT_WR)
                assert client.recv(16) == b""  # the far end saw our EOF and half-closed in turn
        finally:
            proxy.terminate()
            proxy.wait(timeout=15)
