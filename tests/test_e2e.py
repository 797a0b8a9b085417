"""The end-to-end channel against a malicious relay, with real processes: a gateway, a hub,
workers that dial tests/evil_relay.py instead of the gateway (or the hub), and a backbone.

(a) an eavesdropper between worker and gateway learns nothing after the accept; between a
    worker and a hub that need not encrypt (what --e2e off gives) it reads the HTTP/2 bytes;
(b) a relay that flips one bit of a worker's message: the hub closes that session 1008 and a
    live decode stays bitwise equal to local;
(c) a relay that answers as a hub with its own key: a pinned worker refuses it and never
    sends a hello;
(d) a relay that clears ``encrypted`` in the accept: the hub's signature fails (1008).
(c) and (d) share one test, so that their workers load at the same time;
(e) a relay that keeps the hub's WebSocket up, answering its pings, for a worker it has made
    silent: an encrypted session is dropped (1001) within the hub's keepalive bound by the
    sealed heartbeat, which the relay cannot answer; a clear one, checked by pings, stays.
"""

from __future__ import annotations

import json
import pathlib
import time

import grpc
import pytest
import torch
from helpers import trustme_certs, wait_until

from kvasir.swarm import LocalSwarm
from kvasir_rpc import TARGET_KEY_METADATA, encode_tensor, expert_pb2, expert_pb2_grpc, preferred_aeads, target_key
from kvasir_rpc.protocol import AEAD_CHACHA20_POLY1305, AEAD_NAMES

# Integration: real gateway, hub, relays, workers and a backbone.
pytestmark = pytest.mark.integration

RELAY = str(pathlib.Path(__file__).with_name("evil_relay.py"))
PREFACE = b"PRI * HTTP/2.0"


@pytest.fixture(scope="module")
def sw(tiny_models, tmp_path_factory):
    with LocalSwarm(tmp_path_factory.mktemp("e2e")) as swarm:
        trustme_certs(swarm.workdir)
        swarm.start_gateway()
        swarm.start_hub(gateway=True)
        swarm.model = tiny_models("qwen3_moe")  # type: ignore[attr-defined]
        yield swarm


def start_relay(sw: LocalSwarm, name: str, mode: str, upstream: str = "", *extra: str) -> tuple[str, pathlib.Path]:
    """Start an evil relay; its ws:// URL and its folder (events.jsonl, after_accept.bin)."""
    folder = sw.workdir / name
    folder.mkdir()
    sw._spawn(name, [RELAY, mode, "--upstream", upstream, "--ca-file", str(sw.ca_file), "--workdir", str(folder),
                     *extra])
    ready = folder / "ready.json"
    wait_until(lambda: ready.exists() or sw.procs[name].poll() is not None, 30, f"{name} to listen")
    sw._check_alive(name)
    return f"ws://127.0.0.1:{json.loads(ready.read_text())['port']}", folder


def events(folder: pathlib.Path) -> list[dict]:  # type: ignore[type-arg]
    path = folder / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def session_of(sw: LocalSwarm, name: str):  # type: ignore[no-untyped-def]
    from kvasir_rpc import Wallet

    wallet = Wallet.load_or_create(sw.workdir / f"{name}.wallet").address
    found = [s for s in sw.list_sessions() if s.wallet == wallet]
    return found[0] if found else None


def dispatch(sw: LocalSwarm, session, hidden: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    rows = hidden.shape[0]
    req = expert_pb2.DispatchRequest(call_id=1, layer=0, hidden=encode_tensor(hidden),
                                     weights=encode_tensor(torch.ones(rows)),
                                     segments=[expert_pb2.ExpertSegment(expert=0, rows=rows)])
    key = ((TARGET_KEY_METADATA, target_key(sw.backbone_token, session.session_id)),)
    with grpc.insecure_channel(session.target) as ch:
        grpc.channel_ready_future(ch).result(timeout=15)
        resp = next(iter(expert_pb2_grpc.ExpertServiceStub(ch).Dispatch(iter([req]), timeout=15, metadata=key)))
    assert list(resp.partials.partials.shape) == [rows, hidden.shape[1]]


def test_an_eavesdropping_relay_sees_only_ciphertext(sw):
    through_gw, gw_dir = start_relay(sw, "relay_gw", "record", sw.gateway_url)
    through_hub, hub_dir = start_relay(sw, "relay_hub", "record", sw.hub_ws_url)
    # Through a gateway (the relay stands where it or an edge would): sealed by default.
    sw.start_worker("sealed", sw.model, "0:0-3", via="gateway", gateway_url=through_gw)
    # Direct to a hub under --e2e auto by a worker that does not require it: in clear, as
    # every session is under --e2e off.
    sw.start_worker("clear", sw.model, "0:0-3", via="hub", hub_url=through_hub)
    wait_until(lambda: session_of(sw, "sealed") is not None and session_of(sw, "clear") is not None, 120,
               "both workers' sessions")
    sealed, clear = session_of(sw, "sealed"), session_of(sw, "clear")
    assert sealed.encrypted and not clear.encrypted
    # Sealed with what the worker offered: AES-256-GCM where it seals faster, as here on x86.
    offered = preferred_aeads()
    assert sealed.aead == (offered[0] if offered else AEAD_CHACHA20_POLY1305) and clear.aead == 0
    assert f'"aead": "{AEAD_NAMES[sealed.aead]}"' in (sw.logs / "sealed.log").read_text()
    hidden = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    for session in (sealed, clear):
        dispatch(sw, session, hidden)
    needle = hidden.numpy().tobytes()[:64]
    seen_sealed, seen_clear = (gw_dir / "after_accept.bin").read_bytes(), (hub_dir / "after_accept.bin").read_bytes()
    assert len(seen_sealed) > hidden.numel() * 4  # the call crossed the relay
    assert PREFACE not in seen_sealed and needle not in seen_sealed and b"kvasir.v1.ExpertService" not in seen_sealed
    assert not [e for e in events(gw_dir) if e["event"] == "text after the handshake"]
    assert PREFACE in seen_clear and needle in seen_clear
    for name in ("sealed", "clear", "relay_gw", "relay_hub"):
        sw.stop_process(name)


def test_a_flipped_bit_ends_the_session_and_the_decode_stays_exact(sw):
    url, folder = start_relay(sw, "relay_flip", "flip", sw.gateway_url, "--flip-at", "6")
    sw.start_worker("flipped", sw.model, "all", via="gateway", gateway_url=url)
    wait_until(lambda: session_of(sw, "flipped") is not None, 120, "the worker's session")
    first = session_of(sw, "flipped").session_id
    result = sw.run_backbone(["--model", str(sw.model), "--prompt", "tamper with me", "--max-new-tokens", "8",
                              "--compare-local", "--wait-sessions", "1"], timeout=300)
    assert result["backbone_exit_code"] == 0
    assert result["tokens_identical"] is True and result["max_abs_logit_diff"] == 0.0
    flips = [e for e in events(folder) if e["event"] == "flipped a bit"]
    assert len(flips) == 1, events(folder)
    closes = [e for e in events(folder) if e["event"] == "closed" and e["by"] == "hub" and e["conn"] == flips[0]["conn"]]
    assert closes and closes[0]["code"] == 1008 and "authentication tag" in closes[0]["reason"], events(folder)
    hub_log = (sw.logs / "hub.log").read_text()
    assert "failed its authentication tag" in hub_log
    # The worker came back on a fresh session (fresh keys) and is served again.
    wait_until(lambda: (s := session_of(sw, "flipped")) is not None and s.session_id != first, 60, "a new session")
    for name in ("flipped", "relay_flip"):
        sw.stop_process(name)


def test_a_relay_impersonating_the_hub_or_stripping_the_encryption_is_refused(sw):
    fake_url, fake = start_relay(sw, "relay_fake_hub", "impersonate")
    strip_url, strip = start_relay(sw, "relay_strip", "strip", sw.gateway_url)
    sw.start_worker("pinned", sw.model, "0:0", via="gateway", gateway_url=fake_url)  # pinned by LocalSwarm
    sw.start_worker("stripped", sw.model, "0:0", via="gateway", gateway_url=strip_url)

    def closed_by_worker(folder: pathlib.Path) -> list[dict]:  # type: ignore[type-arg]
        return [e for e in events(folder) if e["event"] == "closed" and e["by"] == "worker"]

    wait_until(lambda: closed_by_worker(fake) and closed_by_worker(strip), 120, "the workers' refusals")
    # (c) The impersonator's challenge names another key: refused before any hello, and the
    # worker stops there (exit 2, naming --hub-key): the next dial would meet the same key.
    assert sw.procs["pinned"].wait(timeout=30) == 2
    evs = events(fake)
    assert not [e for e in evs if e["event"] == "hello received"], evs
    assert all(e["code"] == 4104 and "unexpected hub key" in e["reason"] for e in closed_by_worker(fake)), evs
    log = (sw.logs / "pinned.log").read_text()
    assert "unexpected hub key" in log and "session established" not in log
    assert "(--hub-key)" in log.strip().splitlines()[-1] and "Traceback" not in log
    # (d) The hub's signature covers the flag: the stripped accept does not verify.
    evs = events(strip)
    assert [e for e in evs if e["event"] == "stripped encrypted from the accept"]
    refusal = closed_by_worker(strip)[0]
    assert refusal["code"] == 1008 and "bad signature" in refusal["reason"], evs
    assert not [e for e in evs if e["event"] == "text after the handshake"]
    assert "session established" not in (sw.logs / "stripped.log").read_text()
    assert session_of(sw, "pinned") is None
    for name in ("pinned", "stripped", "relay_fake_hub", "relay_strip"):
        sw.stop_process(name)


def test_a_relay_answering_pings_for_a_silent_worker_cannot_keep_its_encrypted_session(tiny_models, tmp_path):
    # A hub of its own (direct, no gateway) with a short keepalive, so the bound is small.
    keepalive, timeout = 0.5, 1.0
    bound = keepalive + timeout
    # Past the bound: the hub's close handshake (at most 2 s) and a loaded machine's scheduling.
    slack = 5.0
    with LocalSwarm(tmp_path) as swarm:
        swarm.start_hub(extra=["--keepalive", str(keepalive), "--keepalive-timeout", str(timeout)])
        model = tiny_models("qwen3_moe")
        sealed_url, sealed_dir = start_relay(swarm, "mute_sealed", "mute", swarm.hub_ws_url)
        clear_url, clear_dir = start_relay(swarm, "mute_clear", "mute", swarm.hub_ws_url)
        # Direct to a hub under --e2e auto: sealed because this worker requires it; the other in clear.
        swarm.start_worker("silent_sealed", model, "0:0", via="hub", hub_url=sealed_url, extra=["--e2e", "require"])
        swarm.start_worker("silent_clear", model, "0:0", via="hub", hub_url=clear_url)

        wait_until(lambda: session_of(swarm, "silent_sealed") is not None, 120, "the sealed session")
        sealed = session_of(swarm, "silent_sealed")
        seen_at = time.monotonic()
        assert sealed.encrypted
        wait_until(lambda: sealed.session_id not in {s.session_id for s in swarm.list_sessions()}, bound + slack,
                   f"the silent worker's encrypted session to be dropped within {bound:g} s")
        dropped_after = time.monotonic() - seen_at
        closes = [e for e in events(sealed_dir) if e["event"] == "closed" and e["by"] == "hub"]
        assert closes, events(sealed_dir)
        assert closes[0]["code"] == 1001, closes
        assert closes[0]["reason"] == (f"no sealed heartbeat answer within {timeout:g} s: the worker is gone or a "
                                       "relay is answering for it"), closes
        assert [e for e in events(sealed_dir) if e["event"] == "muted the worker"]  # its acks went nowhere

        # The clear session's liveness is WebSocket pings, which the relay answers: it stays.
        wait_until(lambda: session_of(swarm, "silent_clear") is not None, 120, "the clear session")
        clear = session_of(swarm, "silent_clear")
        assert not clear.encrypted
        time.sleep(3 * bound)  # what is measured is that nothing happens in three keepalive rounds
        assert clear.session_id in {s.session_id for s in swarm.list_sessions()}
        assert not [e for e in events(clear_dir) if e["event"] == "closed"], events(clear_dir)
        print(f"encrypted session of a silent worker dropped {dropped_after:.2f} s after it was first listed "
              f"(keepalive {keepalive:g} s + timeout {timeout:g} s)")
