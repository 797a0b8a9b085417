"""Gateways on every core and on several hosts, for real: ``--processes 2`` sharing one port
(workers spread over both, a killed process restarted and its workers back), and two gateway
"hosts" behind Debian's HAProxy in TCP mode with a hub holding a control connection to each
(sessions on both, calls exact, one host killed and its workers back through the balancer)."""

from __future__ import annotations

import os
import re
import signal
import ssl
import urllib.error
import urllib.request

import grpc
import pytest
import torch
from helpers import trustme_certs, wait_until

from kvasir.swarm import LocalSwarm
from kvasir_rpc import (
    TARGET_KEY_METADATA,
    ExpertIndex,
    Wallet,
    decode_tensor,
    encode_tensor,
    expert_forward,
    expert_pb2,
    expert_pb2_grpc,
    get_activation,
    target_key,
)

HUB_ARGS = ["--keepalive", "0.5"]  # end-to-end checks keep spliced pairs from the idle timeout


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{name} not in the metrics of port {port}"
    return float(found.group(1))


def _sessions_by_port(ports: list[int]) -> list[int]:
    return [int(_metric(p, "kvasir_gateway_sessions")) for p in ports]


def _check_exact(sw: LocalSwarm, model, sessions) -> None:  # type: ignore[no-untyped-def]
    """One Dispatch through each session: partials equal the local kernel's, bit for bit."""
    gate_up, down = ExpertIndex(model).load(0, 0)
    hidden = torch.randn(24, gate_up.shape[1], generator=torch.Generator().manual_seed(5))
    weights = torch.rand(24, generator=torch.Generator().manual_seed(6))
    want = expert_forward(hidden, gate_up, down, get_activation("silu"), weights)
    req = expert_pb2.DispatchRequest(call_id=1, layer=0, hidden=encode_tensor(hidden), weights=encode_tensor(weights),
                                     segments=[expert_pb2.ExpertSegment(expert=0, rows=24)])
    for session in sessions:
        key = ((TARGET_KEY_METADATA, target_key(sw.backbone_token, session.session_id)),)
        with grpc.insecure_channel(session.target) as ch:
            grpc.channel_ready_future(ch).result(timeout=15)
            resp = next(iter(expert_pb2_grpc.ExpertServiceStub(ch).Dispatch(iter([req]), timeout=15, metadata=key)))
        got = decode_tensor(resp.partials.partials)
        assert torch.equal(got, want), f"session {session.session_id} is not exact"


def _wallets(sw: LocalSwarm, names: list[str]) -> set[str]:
    return {Wallet.load_or_create(sw.workdir / f"{n}.wallet").address for n in names}


def _all_back(sw: LocalSwarm, wallets: set[str], gone: set[str]) -> bool:
    live = {s.wallet for s in sw.list_sessions() if s.session_id not in gone}
    return wallets <= live


@pytest.mark.integration  # real gateways, HAProxy, hub and worker processes
def test_two_gateway_hosts_behind_haproxy(tiny_models, tmp_path):
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path) as sw:
        trustme_certs(sw.workdir)
        a = sw.start_gateway(name="gateway_a", http=True)
        b = sw.start_gateway(name="gateway_b", http=True)
        sw.start_hub(gateway=True, extra=HUB_ARGS)  # --gateway twice: straight to each host
        lb = sw.start_tcp_balancer([int(a["port"]), int(b["port"])])  # type: ignore[call-overload]
        names = ["worker1", "worker2"]  # round robin: one on each host
        for name in names:  # a worker knows only the balancer's address
            sw.start_worker(name, model, "0:0-7", via="gateway", gateway_url=f"wss://127.0.0.1:{lb}")
        sessions = sw.wait_sessions(2, timeout=60, watch=["gateway_a", "gateway_b", "balancer", *names])
        metrics = [sw.http_ports["gateway_a"], sw.http_ports["gateway_b"]]
        on = _sessions_by_port(metrics)
        assert on == [1, 1], f"round robin should use both hosts: {on}"
        _check_exact(sw, model, sessions)

        # One host dies: its workers reconnect through the balancer to the other, and the hub
        # keeps serving (its link to the dead host retries in the background).
        sw.stop_process("gateway_a", sig=signal.SIGKILL)
        wait_until(lambda: _all_back(sw, _wallets(sw, names), set()) and len(sw.list_sessions()) == 2
                   and _sessions_by_port(metrics[1:]) == [2], 30,
                   "every worker's session back through the surviving host")
        _check_exact(sw, model, sw.list_sessions())
        assert sw.procs["hub"].poll() is None


@pytest.mark.integration  # a real gateway (parent and children), hub and worker processes
def test_gateway_processes_share_one_port(tiny_models, tmp_path):
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path) as sw:
        trustme_certs(sw.workdir)
        info = sw.start_gateway(processes=2, http=True)
        children = info["children"]
        assert len(children) == 2 and len({c["pid"] for c in children}) == 2  # type: ignore[union-attr, index, arg-type]
        assert len({c["hub_port"] for c in children}) == 2  # type: ignore[union-attr, index]
        sw.start_hub(gateway=True, extra=HUB_ARGS)  # one --gateway per process, at its hub port
        metrics = [int(c["http_port"]) for c in children]  # type: ignore[union-attr, index]
        wait_until(lambda: all(_metric(p, "kvasir_gateway_hubs_connected") == 1 for p in metrics), 20,
                   "the hub's control connection to each process")
        names = ["worker1", "worker2", "worker3", "worker4"]
        for name in names:
            sw.start_worker(name, model, "0:0-7", via="gateway")  # all to the one shared port
        sessions = sw.wait_sessions(4, timeout=60, watch=["gateway", *names])
        # The kernel hashes each connection to a process; should all four land on one, a
        # worker restarted connects again from a new port (bounded: 1/8 each time).
        for attempt in range(6):
            on = _sessions_by_port(metrics)
            if min(on) >= 1:
                break
            victim = names[attempt % len(names)]
            sw.stop_process(victim)
            gone = {s.session_id for s in sessions if s.wallet in _wallets(sw, [victim])}
            sw.start_worker(victim, model, "0:0-7", via="gateway")
            wait_until(lambda: _all_back(sw, _wallets(sw, names), gone) and len(sw.list_sessions()) == 4, 30,
                       f"{victim} back")
            sessions = sw.list_sessions()
        assert sum(on) == 4 and min(on) >= 1, f"workers should spread over both processes: {on}"
        _check_exact(sw, model, sessions)  # through each process
        # A hub dialling the shared port is told where to go.
        with pytest.raises(urllib.error.HTTPError) as refused:
            ctx = ssl.create_default_context(cafile=str(sw.ca_file))
            urllib.request.urlopen(urllib.request.Request(
                f"https://127.0.0.1:{sw.gateway_port}/v1/hub/control",
                headers={"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                         "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}), timeout=5, context=ctx)
        assert refused.value.code == 421 and b"--hub-listen" in refused.value.read()

        # A process killed: the parent restarts it on the same sockets (its metrics on a new
        # port: --http port 0), the hub reconnects to it, and its workers come back (through
        # the shared port, to either process).
        victim = children[0]  # type: ignore[index]
        os.kill(int(victim["pid"]), signal.SIGKILL)
        again = sw.wait_gateway_restarted("gateway", 0, int(victim["pid"]))
        child = again["children"][0]  # type: ignore[index]
        assert child["hub_port"] == victim["hub_port"]
        metrics[0] = int(child["http_port"])
        wait_until(lambda: _metric(metrics[0], "kvasir_gateway_hubs_connected") == 1, 30,
                   "the hub's control connection to the restarted process")
        wait_until(lambda: len(sw.list_sessions()) == 4 and _all_back(sw, _wallets(sw, names), set()), 30,
                   "every worker's session back")
        wait_until(lambda: sum(_sessions_by_port(metrics)) == 4, 10, "both processes' sessions counted")
        _check_exact(sw, model, sw.list_sessions())
        assert sw.procs["gateway"].poll() is None
    # Leaving the swarm SIGTERMs the parent, which stops its children.
    for c in again["children"]:  # type: ignore[union-attr]
        wait_until(lambda c=c: not _alive(int(c["pid"])), 15, f"gateway process {c['index']} to end")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose; psutil tells them apart.
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("shared", [True, False])
def test_hub_paths_on_a_shared_port_are_refused_naming_the_hub_addresses(shared):
    """In memory: on the public port of one process of several, a hub's control path gets 421
    saying where to go; its own hub-facing port, and a one-process gateway, serve it."""
    import trio
    import trio.testing
    from wsmem import open_client

    from kvasir_rpc.protocol import GATEWAY_SUBPROTOCOL, HUB_CONTROL_PATH
    from relay.gateway._gateway import Gateway, GatewayConfig

    token = "s3cret-hub-token"
    gateway = Gateway(GatewayConfig(hub_token=token, shared_port=shared, keepalive_s=1000.0, idle_timeout_s=5000.0))

    async def dial(hub_side: bool):  # type: ignore[no-untyped-def]
        client, server = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            kwargs = {"hub_paths": True} if hub_side else {"hub_paths": not shared}
            nursery.start_soon(lambda: gateway._handle(server, "10.0.0.2:4000", **kwargs))  # type: ignore[arg-type]
            ws = await open_client(client, HUB_CONTROL_PATH, subprotocols=[GATEWAY_SUBPROTOCOL],
                                   headers=[(b"authorization", f"Bearer {token}".encode())])
            nursery.cancel_scope.cancel()
        return ws

    async def main() -> None:
        with trio.fail_after(10):
            public = await dial(hub_side=False)
            own = await dial(hub_side=True)
        if shared:
            assert public.status == 421 and b"--hub-listen" in public.body
            assert gateway.statistics().refused == {"hub_port": 1}
        else:
            assert public.status is None
        assert own.status is None

    trio.run(main)


@pytest.mark.integration  # a real process
def test_processes_without_hub_listen_stop_with_one_line(tmp_path):
    import subprocess
    import sys

    token = tmp_path / "hub.token"
    token.write_text("a-token-long-enough-for-the-gateway-0123456789\n")
    token.chmod(0o600)
    out = subprocess.run([sys.executable, "-m", "relay", "gateway", "--listen", "127.0.0.1:0", "--insecure-plain-ws",
                          "--hub-token-file", str(token), "--processes", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("gateway: --processes 2 needs --hub-listen HOST:PORT")
