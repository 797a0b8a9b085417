"""The Python implementation against the committed test vectors (tests/vectors/*.json).

The vectors are the contract docs/PROTOCOL.md points worker authors to: the weights digest,
the session handshake, the expert computation and the tensor codec, as exact bytes. These
tests compare the implementation with the committed files; they never regenerate a file to
compare it with itself. ``python tests/test_vectors.py --write`` rewrites the files from the
implementation (for a deliberate change of the contract, reviewed as such).

The tunnel control sequences and the gateway pairing messages (tunnel_control.json,
gateway_pairing.json) are tested in tests/test_protocol.py.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import struct
import sys

import pytest
import torch

from kvasir_rpc import (
    HELLO_SIGNATURE_DOMAIN,
    CloseCode,
    close_class,
    ExpertFunction,
    HubHandshake,
    RemoteProtocolError,
    TensorCodecError,
    TunnelCipher,
    Wallet,
    WorkerHandshake,
    decode_tensor,
    encode_tensor,
    expert_digest,
    expert_forward,
    expert_forward_projections,
    expert_pb2,
    get_activation,
    session_pb2,
    slices_digest,
    tensor_pb2,
    verify_signature,
)
from kvasir_rpc._channel import Heartbeat, HeartbeatAck, KeyExchange, derive_tunnel_keys, transcript_hash
from kvasir_rpc._handshake import accept_signed_message
from kvasir_rpc.protocol import (
    ACCEPT_AEAD_SIGNATURE_DOMAIN,
    ACCEPT_SIGNATURE_DOMAIN,
    AEAD_AES_256_GCM,
    SEALED_CONTROL,
    SEALED_DATA,
    SEALED_HEARTBEAT,
    SEALED_HEARTBEAT_ACK,
    TUNNEL_KEYS_INFO,
)

# The sealed kinds of channel.json by name, with the plaintext byte and the payload's meaning.
_KIND_BYTES = {"data": SEALED_DATA, "control": SEALED_CONTROL, "heartbeat": SEALED_HEARTBEAT,
               "heartbeat_ack": SEALED_HEARTBEAT_ACK}


def _kind(msg: object) -> str:
    return {Heartbeat: "heartbeat", HeartbeatAck: "heartbeat_ack", str: "control"}.get(type(msg), "data")


def _payload(msg: object) -> bytes:
    if isinstance(msg, (Heartbeat, HeartbeatAck)):
        return msg.seq.to_bytes(8, "big")
    return msg.encode() if isinstance(msg, str) else bytes(msg)  # type: ignore[arg-type]


def _message(kind: str, payload: bytes) -> object:
    """What a cipher seals for a vector's kind and payload (and what it opens back)."""
    if kind in ("heartbeat", "heartbeat_ack"):
        return (Heartbeat if kind == "heartbeat" else HeartbeatAck)(int.from_bytes(payload, "big"))
    return payload.decode() if kind == "control" else payload

VECTORS = pathlib.Path(__file__).resolve().parent / "vectors"

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int32": torch.int32, "int64": torch.int64}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _load(name: str) -> dict:  # type: ignore[type-arg]
    return json.loads((VECTORS / name).read_text())


# -- tensors as JSON: dtype, shape, the raw little-endian bytes in hex, and the values -----


def _tensor_json(t: torch.Tensor) -> dict:  # type: ignore[type-arg]
    t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    values = t.to(torch.float64 if t.is_floating_point() else torch.int64).reshape(-1).tolist()
    return {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_hex": raw.hex(), "values": values}


def _tensor(obj: dict) -> torch.Tensor:  # type: ignore[type-arg]
    """The tensor of a JSON entry, from its bytes; its listed values must agree with them."""
    dtype = _DTYPES[obj["dtype"]]
    raw = bytes.fromhex(obj["data_hex"])
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(obj["shape"]) if raw \
        else torch.empty(obj["shape"], dtype=dtype)
    assert t.reshape(-1).tolist() == obj["values"], "a vector's values disagree with its bytes"
    return t


# -- generation (python tests/test_vectors.py --write) ----------------------------------------


def _dyadic(gen: torch.Generator, shape: tuple[int, ...], steps: int = 8, scale: float = 0.25) -> torch.Tensor:
    """Small multiples of ``scale``: every product and short sum of them is exact in float32,
    so only the activation and the final roundings can differ between implementations."""
    return torch.randint(-steps, steps + 1, shape, generator=gen).to(torch.float32) * scale


def _powers_of_two(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    choice = torch.tensor([-2.0, -1.0, -0.5, -0.25, 0.25, 0.5, 1.0, 2.0])
    return choice[torch.randint(0, len(choice), shape, generator=gen)]


def _digest_case(name: str, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                 layer: int, expert: int) -> dict:  # type: ignore[type-arg]
    gate_up = torch.cat([gate, up], dim=0)
    preimage = b""
    for t in (gate_up, down):
        preimage += str(t.dtype).encode() + b"\x00" + struct.pack(f"<{t.dim()}Q", *t.shape)
        preimage += t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    digest = expert_digest(gate_up, down)
    assert hashlib.sha256(preimage).digest() == digest
    return {"name": name, "layer": layer, "expert": expert, "gate": _tensor_json(gate), "up": _tensor_json(up),
            "down": _tensor_json(down), "preimage_hex": preimage.hex(), "expert_digest_hex": digest.hex()}


def build_weights_digest() -> dict:  # type: ignore[type-arg]
    gen = torch.Generator().manual_seed(1)
    experts = [
        # The worked example of docs/PROTOCOL.md: hidden_size 2, intermediate size 1.
        _digest_case("layer 0 expert 0, float32, H=2 I=1", torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0]]),
                     torch.tensor([[0.5], [-1.0]]), layer=0, expert=0),
        _digest_case("layer 0 expert 1, float32, H=2 I=1", torch.tensor([[-1.0, 0.25]]),
                     torch.tensor([[0.0, -2.0]]), torch.tensor([[1.5], [0.125]]), layer=0, expert=1),
        _digest_case("layer 3 expert 2, float32, H=4 I=2", _dyadic(gen, (2, 4)), _dyadic(gen, (2, 4)),
                     _dyadic(gen, (4, 2)), layer=3, expert=2),
        _digest_case("layer 0 expert 0, bfloat16, H=2 I=1", torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16),
                     torch.tensor([[3.0, 4.0]], dtype=torch.bfloat16),
                     torch.tensor([[0.5], [-1.0]], dtype=torch.bfloat16), layer=0, expert=0),
    ]

    def combine(name: str, picks: list[int]) -> dict:  # type: ignore[type-arg]
        chosen = {(experts[i]["layer"], experts[i]["expert"]): bytes.fromhex(experts[i]["expert_digest_hex"])
                  for i in picks}
        preimage = b"kvasir.v1.weights\x00" + b"".join(
            struct.pack("<II", layer, e) + d for (layer, e), d in sorted(chosen.items()))
        digest = slices_digest(chosen)
        assert hashlib.sha256(preimage).digest() == digest
        slices: dict[int, list[int]] = {}
        for layer, e in sorted(chosen):
            slices.setdefault(layer, []).append(e)
        return {"name": name, "experts": picks, "slices": [{"layer": k, "experts": v} for k, v in slices.items()],
                "preimage_hex": preimage.hex(), "weights_digest_hex": digest.hex()}

    return {
        "description": (
            "Weights digests (docs/PROTOCOL.md, 'The weights digest'). An expert's digest is "
            "sha256(preimage): for gate_up (gate rows then up rows, [2I, H]) and then down ([H, I]): the "
            "dtype's name as torch spells it, a NUL byte, each dimension as a little-endian uint64, then the "
            "raw little-endian bytes in row-major order. A worker announces one digest over all its experts: "
            "sha256('kvasir.v1.weights' NUL, then per (layer, expert) in ascending order: layer and expert as "
            "little-endian uint32, then that expert's 32-byte digest). 'experts' of a slices case index the "
            "'experts' list (the bfloat16 case stands alone: a checkpoint has one dtype)."),
        "experts": experts,
        "slices": [combine("one expert", [0]), combine("three experts over two layers", [2, 1, 0])],
    }


_SEED = bytes(range(32))  # the worker's wallet seed
_HUB_SEED = bytes(range(32, 64))
# The ephemeral X25519 private keys (RFC 7748 scalars, clamped by X25519 itself).
_HUB_KX = bytes(range(0x80, 0xA0))
_WORKER_KX = bytes(range(0xA0, 0xC0))
_NONCE = bytes(range(0x40, 0x60))
_ISSUED_AT_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
_SESSION_ID = "s1-0123456789ab"


def _hello_fields(weights_digest: bytes) -> dict:  # type: ignore[type-arg]
    return {"slices": [{"layer": 0, "experts": [0, 1]}, {"layer": 3, "experts": [2]}],
            "weights_digest_hex": weights_digest.hex(), "device": "cpu", "model_type": "qwen3_moe",
            "worker_version": "0.1.0", "require_encryption": True}


def _worker_handshake(wallet: Wallet, hello: dict, kx_private: bytes) -> WorkerHandshake:  # type: ignore[type-arg]
    return WorkerHandshake(wallet, slices={s["layer"]: s["experts"] for s in hello["slices"]},
                           weights_digest=bytes.fromhex(hello["weights_digest_hex"]), device=hello["device"],
                           model_type=hello["model_type"], worker_version=hello["worker_version"],
                           require_encryption=hello["require_encryption"], kx_private=kx_private)


def build_handshake() -> dict:  # type: ignore[type-arg]
    wallet, hub = Wallet(_signing_key(_SEED)), Wallet(_signing_key(_HUB_SEED))
    digest = bytes.fromhex(build_weights_digest()["slices"][1]["weights_digest_hex"])
    hello = _hello_fields(digest)
    hub_hs = HubHandshake(hub, nonce=_NONCE, clock_ms=lambda: _ISSUED_AT_MS, kx_private=_HUB_KX)
    challenge = hub_hs.challenge()
    hello_bytes = _worker_handshake(wallet, hello, _WORKER_KX).receive_challenge(challenge)
    msg = session_pb2.SessionHello.FromString(hello_bytes)
    hub_hs.receive_hello(hello_bytes)
    accept_bytes = hub_hs.accept(_SESSION_ID)
    good = session_pb2.SessionHello.FromString(hello_bytes)
    bad_sig = bytearray(good.signature)
    bad_sig[0] ^= 0x01
    other_nonce = session_pb2.HelloBody.FromString(good.body)
    other_nonce.nonce = bytes(32)
    other_body = other_nonce.SerializeToString()
    short_digest = session_pb2.HelloBody.FromString(good.body)
    short_digest.weights_digest = digest[:16]
    short_body = short_digest.SerializeToString()

    def signed(body: bytes) -> str:
        return session_pb2.SessionHello(body=body, signature=wallet.sign(HELLO_SIGNATURE_DOMAIN + body)) \
            .SerializeToString().hex()

    refusals = [
        {"name": "signature with one bit flipped", "hello_hex": session_pb2.SessionHello(
            body=good.body, signature=bytes(bad_sig)).SerializeToString().hex(), "now_ms": _ISSUED_AT_MS,
         "close_code": CloseCode.HELLO_INVALID},
        {"name": "answers another nonce (validly signed)", "hello_hex": signed(other_body), "now_ms": _ISSUED_AT_MS,
         "close_code": CloseCode.HELLO_STALE},
        {"name": "answered 30001 ms after the challenge", "hello_hex": hello_bytes.hex(),
         "now_ms": _ISSUED_AT_MS + 30_001, "close_code": CloseCode.HELLO_STALE},
        {"name": "weights_digest of 16 bytes (validly signed)", "hello_hex": signed(short_body),
         "now_ms": _ISSUED_AT_MS, "close_code": CloseCode.HELLO_INVALID},
        {"name": "not a SessionHello (field 1 claims 127 bytes, 1 follows)", "hello_hex": "0a7f00",
         "now_ms": _ISSUED_AT_MS, "close_code": CloseCode.PROTOCOL_ERROR},
    ]
    return {
        "description": (
            "The session handshake (docs/PROTOCOL.md, 'Session handshake'): three binary WebSocket messages. "
            "The worker's wallet is the Ed25519 key of 'wallet_seed_hex' (RFC 8032; the address is the public "
            "key in lowercase hex); Ed25519 signatures are deterministic, so 'session_hello_hex' is exact. The "
            "signature covers signed_message = 'kvasir.v1.SessionHello' NUL + hello_body. A hub verifies the "
            "body bytes as received: another encoder's HelloBody bytes may differ and still be valid. "
            "'refusals': SessionHello messages a hub that sent 'session_challenge_hex' must refuse, with the "
            "WebSocket close code shown, when it receives them at 'now_ms'. The key exchange (docs/PROTOCOL.md, "
            "'End-to-end channel'): 'hub_kx_private_hex' and 'worker_kx_private_hex' are the ephemeral X25519 "
            "keys; the hub (its Ed25519 key from 'hub_seed_hex') signs accept_signed_message = "
            "'kvasir.v1.SessionAccept' NUL + transcript_hash + session_id + 01 (encrypted); transcript_hash = "
            "sha256(u32be(len(challenge)) + challenge + u32be(len(hello)) + hello). channel.json continues "
            "this handshake with the tunnel keys and sealed messages."),
        "wallet_seed_hex": _SEED.hex(),
        "wallet_address": wallet.address,
        "hub_seed_hex": _HUB_SEED.hex(),
        "hub_key": hub.address,
        "hub_kx_private_hex": _HUB_KX.hex(),
        "hub_kx_public_hex": session_pb2.SessionChallenge.FromString(challenge).kx_public.hex(),
        "worker_kx_private_hex": _WORKER_KX.hex(),
        "worker_kx_public_hex": session_pb2.HelloBody.FromString(msg.body).kx_public.hex(),
        "nonce_hex": _NONCE.hex(),
        "issued_at_unix_ms": _ISSUED_AT_MS,
        "session_challenge_hex": challenge.hex(),
        "hello": hello,
        "hello_body_hex": msg.body.hex(),
        "signed_message_hex": (HELLO_SIGNATURE_DOMAIN + msg.body).hex(),
        "signature_hex": msg.signature.hex(),
        "session_hello_hex": hello_bytes.hex(),
        "session_id": _SESSION_ID,
        "transcript_hash_hex": transcript_hash(challenge, hello_bytes).hex(),
        "accept_signed_message_hex": accept_signed_message(transcript_hash(challenge, hello_bytes), _SESSION_ID,
                                                           True).hex(),
        "accept_signature_hex": session_pb2.SessionAccept.FromString(accept_bytes).signature.hex(),
        "session_accept_hex": accept_bytes.hex(),
        "max_challenge_age_ms": 30_000,
        "refusals": refusals,
    }


def build_channel() -> dict:  # type: ignore[type-arg]
    """The handshake of handshake.json, continued: the X25519 secret, the two tunnel keys and
    the first sealed messages each way."""
    hs = build_handshake()
    hub_kx, worker_kx = KeyExchange(_HUB_KX), KeyExchange(_WORKER_KX)
    shared = hub_kx.shared_secret(worker_kx.public)
    transcript = bytes.fromhex(hs["transcript_hash_hex"])
    keys = derive_tunnel_keys(shared, transcript)
    hub, worker = TunnelCipher.for_hub(keys), TunnelCipher.for_worker(keys)
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    sent: list[tuple[str, object]] = [
        ("hub", "open"), ("hub", preface), ("worker", b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"),
        ("worker", "eof"), ("hub", "close"), ("worker", "closed"),
        # The liveness check, either way, in any tunnel state: sequence numbers from 0.
        ("hub", Heartbeat(0)), ("worker", HeartbeatAck(0)), ("worker", Heartbeat(0)), ("hub", HeartbeatAck(0)),
        ("hub", Heartbeat(1)), ("worker", HeartbeatAck(1))]
    messages = _sealed(hub, worker, sent)
    return {
        "description": (
            "The end-to-end channel (docs/PROTOCOL.md, 'End-to-end channel'), continuing handshake.json: "
            "shared = X25519(hub_kx_private, worker_kx_public) = X25519(worker_kx_private, hub_kx_public); "
            "okm = HKDF-SHA256(ikm = shared, salt = transcript_hash, info = 'kvasir.v1.tunnel keys', 64 bytes); "
            "hub_to_worker_key = okm[:32], worker_to_hub_key = okm[32:]. Each message is one binary WebSocket "
            "message: ChaCha20-Poly1305(key of its direction, nonce = 'counter' as 12 bytes big-endian, "
            "plaintext = kind byte (0 data, 1 control, 2 heartbeat, 3 heartbeat_ack) + payload, no associated "
            "data); each direction counts from 0. A heartbeat's payload is its 8-byte big-endian sequence number, "
            "which the ack echoes. 'messages' are in the order sent."),
        "hub_kx_private_hex": _HUB_KX.hex(),
        "worker_kx_private_hex": _WORKER_KX.hex(),
        "hub_kx_public_hex": hs["hub_kx_public_hex"],
        "worker_kx_public_hex": hs["worker_kx_public_hex"],
        "transcript_hash_hex": hs["transcript_hash_hex"],
        "shared_secret_hex": shared.hex(),
        "hkdf_info": TUNNEL_KEYS_INFO.decode(),
        "hub_to_worker_key_hex": keys[0].hex(),
        "worker_to_hub_key_hex": keys[1].hex(),
        "messages": messages,
        "aes_256_gcm": _aes_channel(shared, transcript, sent[:6]),
    }


def _sealed(hub: TunnelCipher, worker: TunnelCipher, sent: list[tuple[str, object]]) -> list[dict]:  # type: ignore[type-arg]
    """Each of ``sent`` sealed by its side in turn (and opened by the other), as channel.json
    lists them."""
    messages = []
    for side, msg in sent:
        sealer = hub if side == "hub" else worker
        counter = sealer.sent
        sealed = sealer.seal(msg)  # type: ignore[arg-type]
        assert (worker if side == "hub" else hub).open(sealed) == msg
        messages.append({"from": side, "counter": counter, "kind": _kind(msg), "payload_hex": _payload(msg).hex(),
                         "sealed_hex": sealed.hex()})
    return messages


def _aes_channel(shared: bytes, transcript: bytes, sent: list[tuple[str, object]]) -> dict:  # type: ignore[type-arg]
    """The same channel when the accept names AES-256-GCM (aead 1): the accept's signed bytes
    in their own form, the keys from their own HKDF info, and the first messages sealed."""
    keys = derive_tunnel_keys(shared, transcript, AEAD_AES_256_GCM)
    hub, worker = TunnelCipher.for_hub(keys, AEAD_AES_256_GCM), TunnelCipher.for_worker(keys, AEAD_AES_256_GCM)
    messages = _sealed(hub, worker, sent)
    return {
        "description": (
            "The accept with aead = 1 (AES-256-GCM) signs, with the hub key, ACCEPT_AEAD_SIGNATURE_DOMAIN "
            "('kvasir.v1.SessionAccept.aead' + 0x00) || transcript_hash || aead byte || encrypted byte || "
            "session_id (UTF-8); the keys are HKDF-SHA256 as above with info 'kvasir.v1.tunnel keys aes-256-gcm'; "
            "messages are sealed with AES-256-GCM, nonce and plaintext as above."),
        "aead": AEAD_AES_256_GCM,
        "session_id": _SESSION_ID,
        "accept_signed_message_hex": accept_signed_message(transcript, _SESSION_ID, True, AEAD_AES_256_GCM).hex(),
        "hkdf_info": (TUNNEL_KEYS_INFO + b" aes-256-gcm").decode(),
        "hub_to_worker_key_hex": keys[0].hex(),
        "worker_to_hub_key_hex": keys[1].hex(),
        "messages": messages,
    }


def _signing_key(seed: bytes):  # type: ignore[no-untyped-def]
    import nacl.signing

    return nacl.signing.SigningKey(seed)


def build_expert_compute() -> dict:  # type: ignore[type-arg]
    gen = torch.Generator().manual_seed(7)
    hidden_size, inter = 4, 2
    act_name = "silu"
    act = get_activation(act_name)
    # Two experts of layer 0; down and routing weights are powers of two, the rest small
    # multiples of 1/4, so that the only rounding steps are the activation, its product with
    # up, the down projection's one addition (I = 2) and the routing weight.
    weights = {e: (_dyadic(gen, (2 * inter, hidden_size)), _powers_of_two(gen, (hidden_size, inter))) for e in (0, 1)}
    x = _dyadic(gen, (3, hidden_size))
    w = torch.tensor([0.5, 0.25, 1.0])
    out = expert_forward(x, *weights[0], act, w)
    single = {"activation": act_name, "hidden": _tensor_json(x), "gate_up": _tensor_json(weights[0][0]),
              "down": _tensor_json(weights[0][1]), "routing_weights": _tensor_json(w), "output": _tensor_json(out)}
    dispatches = []
    for name, wire, projections in (("float32 wire", torch.float32, False),
                                    ("bfloat16 wire for a float32 model", torch.bfloat16, False),
                                    ("float32 wire, projections asked", torch.float32, True),
                                    ("bfloat16 wire, projections asked", torch.bfloat16, True)):
        rows = x.to(wire)
        req = expert_pb2.DispatchRequest(
            call_id=7, layer=0, hidden=encode_tensor(rows), weights=encode_tensor(torch.tensor([0.5, 0.25, 1.0, 0.5])),
            segments=[expert_pb2.ExpertSegment(expert=0, rows=2), expert_pb2.ExpertSegment(expert=1, rows=2)],
            row_index=[0, 2, 1, 2], projections=projections)
        answer = _dispatch(req, weights, act_name, hidden_size)
        case = {"name": name, "dispatch_request_hex": req.SerializeToString().hex(),
                "call_id": 7, "partials": _tensor_json(decode_tensor(answer.partials)),
                "partials_tensor_hex": answer.partials.SerializeToString().hex()}
        if projections:
            case["projections"] = _tensor_json(decode_tensor(answer.projections))
            case["projections_tensor_hex"] = answer.projections.SerializeToString().hex()
        dispatches.append(case)
    return {
        "description": (
            "The expert computation (docs/PROTOCOL.md, 'What an expert computes'), as kvasir_rpc's "
            "expert_forward computes it on the CPU with torch (float32 model, hidden_act 'silu'): "
            "[g | u] = x @ gate_up^T; out = ((silu(g) * u) @ down^T) * w. 'single': one expert over three rows. "
            "'dispatch': two experts of layer 0 ('experts', keyed by expert id) served through "
            "ExpertService.Dispatch: the serialized DispatchRequest and the Tensor its ExpertPartials must "
            "carry (call_id echoed; compute_micros is free); where the request asks for projections, the "
            "projections Tensor too ([g | u] per assignment, in the wire dtype: 'Row checks'). Inputs are "
            "chosen so that every product and sum before the activation is exact, so the projections are "
            "exact bytes on every CPU; the partials pass through the activation (exp), whose last bit may "
            "differ with the CPU and the library: an implementation that is not bit-identical there must "
            "stay within the audit bound and pass the row checks of docs/PROTOCOL.md."),
        "model": {"hidden_size": hidden_size, "intermediate_size": inter, "dtype": "float32",
                  "hidden_act": act_name},
        "single": single,
        "experts": {str(e): {"gate_up": _tensor_json(g), "down": _tensor_json(d)} for e, (g, d) in weights.items()},
        "dispatch": dispatches,
        "functions_description": (
            "One expert per distinct expert function (docs/PROTOCOL.md 11.2), as expert_forward_projections "
            "computes it on the CPU: 'function' is the kvasir.v1.ExpertFunction a worker announces (its fields, "
            "and its serialized bytes), the weights as the checkpoint stores them (transposed: gate_up [H, 2I], "
            "down [I, H]; interleaved: gate and up columns alternate), 'projections' [g | u] (all gates, then all "
            "ups, biases added) and 'output' the partials. The inputs are multiples of 1/4 and powers of two, so "
            "the projections are exact bytes on every CPU; some rows reach past gpt-oss's limit (7) on both "
            "sides, so its clamps are exercised. The outputs pass through exp: their last bit may differ with "
            "the CPU and library (the audit bound and the row checks allow it)."),
        "functions": build_expert_functions(),
    }


def build_expert_functions() -> list[dict]:  # type: ignore[type-arg]
    """The ``functions`` vectors: the default function and gpt-oss's, float32 and bfloat16."""
    from kvasir_rpc._function import CLAMPED_GLU, CLAMPED_SWIGLU

    gen = torch.Generator().manual_seed(11)
    hidden_size, inter = 4, 2
    x = _dyadic(gen, (4, hidden_size), steps=12, scale=0.5)
    x[3] = torch.tensor([6.0, -6.0, 4.0, 2.0])  # a row whose projections reach past +-7
    w = torch.tensor([0.5, 0.25, 1.0, 0.5])
    gate_up = _dyadic(gen, (2 * inter, hidden_size), steps=4, scale=0.25)
    down = _powers_of_two(gen, (hidden_size, inter))
    b_gu, b_d = _dyadic(gen, (2 * inter,), steps=4, scale=0.25), _dyadic(gen, (hidden_size,), steps=4, scale=0.25)
    default = ExpertFunction()
    gpt_oss = ExpertFunction(gate=CLAMPED_SWIGLU, activation="", alpha=1.702, limit=7.0, interleaved=True,
                             transposed=True, bias=True)
    clamped_glu = ExpertFunction(gate=CLAMPED_GLU, activation="silu", limit=7.0)
    cases = []
    for name, fn, dtype in (("default: GLU with silu, float32", default, torch.float32),
                            ("DeepSeek-V4: clamped GLU with silu, limit 7, float32", clamped_glu, torch.float32),
                            ("gpt-oss: clamped SwiGLU, interleaved, transposed, biases, float32", gpt_oss,
                             torch.float32),
                            ("gpt-oss: clamped SwiGLU, interleaved, transposed, biases, bfloat16", gpt_oss,
                             torch.bfloat16)):
        # The same [gate; up] rows, stored as the function says.
        stored = gate_up
        if fn.interleaved:
            stored = torch.stack([gate_up[:inter], gate_up[inter:]], dim=1).reshape(2 * inter, hidden_size)
        bias = torch.stack([b_gu[:inter], b_gu[inter:]], dim=1).reshape(-1) if fn.interleaved else b_gu
        stored_down = down
        if fn.transposed:
            stored, stored_down = stored.T.contiguous(), down.T.contiguous()
        args = [t.to(dtype) for t in (x, stored, stored_down)]
        biases = (bias.to(dtype), b_d.to(dtype)) if fn.bias else None
        out, projections = expert_forward_projections(*args, fn, w.to(dtype), biases)
        case = {"name": name, "dtype": str(dtype).replace("torch.", ""),
                "function": {"gate": fn.to_proto().gate, "activation": fn.activation, "alpha": fn.alpha,
                             "limit": fn.limit, "interleaved": fn.interleaved, "transposed": fn.transposed,
                             "bias": fn.bias},
                "function_proto_hex": fn.to_proto().SerializeToString().hex(),
                "hidden": _tensor_json(args[0]), "gate_up": _tensor_json(args[1]), "down": _tensor_json(args[2]),
                "routing_weights": _tensor_json(w.to(dtype))}
        if biases is not None:
            case["gate_up_bias"], case["down_bias"] = _tensor_json(biases[0]), _tensor_json(biases[1])
        case["projections"], case["output"] = _tensor_json(projections), _tensor_json(out)
        cases.append(case)
    return cases


def _dispatch(req: expert_pb2.DispatchRequest, weights: dict, act_name: str,  # type: ignore[type-arg]
              hidden_size: int) -> expert_pb2.ExpertPartials:
    """The Python worker's answer to one call (its real servicer, on the CPU)."""
    from worker._service import ExpertServicer, LoadedExperts

    experts = LoadedExperts({(0, e): gd for e, gd in weights.items()}, function=ExpertFunction(activation=act_name),
                            hidden_size=hidden_size, dtype=torch.float32, device=torch.device("cpu"),
                            model_type="qwen3_moe", weights_digest=bytes(32))
    (answer,) = list(ExpertServicer(experts, "0" * 64).Dispatch(iter([req]), None))
    resp = expert_pb2.DispatchResponse.FromString(answer)
    assert resp.partials.call_id == req.call_id
    return resp.partials


def build_tensor_codec() -> dict:  # type: ignore[type-arg]
    cases = [
        ("float32 [2, 3]", torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.25, -0.125]])),
        ("bfloat16 [2]", torch.tensor([1.0, -0.5], dtype=torch.bfloat16)),
        ("float16 [2, 1]", torch.tensor([[65504.0], [-0.000060975551605224609375]], dtype=torch.float16)),
        ("int64 [3]", torch.tensor([0, 1, -1], dtype=torch.int64)),
        ("int32 [2]", torch.tensor([7, -300], dtype=torch.int32)),
        ("float32 [0, 4] (no elements)", torch.empty(0, 4)),
        ("float32 [] (a scalar)", torch.tensor(1.0)),
    ]
    valid = [{"name": n, "tensor": _tensor_json(t), "message_hex": encode_tensor(t).SerializeToString().hex()}
             for n, t in cases]
    invalid = [
        {"name": "3 bytes for a float32 [1]", "message_hex": tensor_pb2.Tensor(
            dtype=tensor_pb2.D_TYPE_FLOAT32, shape=[1], data=b"\x00\x00\x80").SerializeToString().hex()},
        {"name": "dtype D_TYPE_UNSPECIFIED", "message_hex": tensor_pb2.Tensor(
            shape=[1], data=b"\x00\x00\x80\x3f").SerializeToString().hex()},
        {"name": "dtype 9 (unknown)", "message_hex": "0809120101" + "1a04" + "0000803f"},
        {"name": "shape [65536, 65536] (2^32 elements, over 2^31)", "message_hex": tensor_pb2.Tensor(
            dtype=tensor_pb2.D_TYPE_FLOAT32, shape=[65536, 65536]).SerializeToString().hex()},
    ]
    return {
        "description": (
            "kvasir.v1.Tensor (docs/PROTOCOL.md, 'Tensors'): dtype, shape and the raw little-endian bytes in "
            "row-major order; len(data) == prod(shape) * itemsize. 'valid': the exact message bytes the Python "
            "encoder writes for each tensor (a decoder must accept them and give these values). 'invalid': "
            "messages a decoder must refuse (ExpertService answers INVALID_ARGUMENT)."),
        "valid": valid,
        "invalid": invalid,
    }


def close_code_members() -> dict[str, int]:
    """CloseCode's codes by name, in the order the class lists them."""
    return {name: value for name, value in vars(CloseCode).items() if name.isupper() and isinstance(value, int)}


def build_close_codes() -> dict:  # type: ignore[type-arg]
    codes = [{"code": code, "name": name, "class": close_class(code)} for name, code in close_code_members().items()]
    # Codes no table names: a worker acts on their range (and never stops outside 4100-4199).
    unassigned = [{"code": c, "class": close_class(c)}
                  for c in (1006, 1012, 3000, 3999, 4000, 4009, 4011, 4099, 4105, 4150, 4199, 4211, 4250, 4299, 4300,
                            4500, 4999)]
    return {
        "description": (
            "The WebSocket close codes (docs/PROTOCOL.md, 'Close codes'): each code's name and what a worker "
            "does after it, its class, decided by the code alone (the reason is for people). 'permanent': do "
            "not dial again unchanged (4008, and 4100-4199 whether the code is known or not); 'retry': dial "
            "again after a backoff (4200-4299, RFC 6455's codes but 1000 and 1001, and every code not "
            "assigned); 'replan': a worker whose slice the hub planned asks for a slice again, any other "
            "dials again (4010); 'closed': an end with nothing refused, dial again (1000, 1001). 'codes' are "
            "the codes a hub, a gateway or a worker sends; 'unassigned' are codes no table names, with the "
            "class a worker gives them."),
        "ranges": [{"first": 4100, "last": 4199, "class": "permanent"}, {"first": 4200, "last": 4299, "class": "retry"}],
        "codes": codes,
        "unassigned": unassigned,
    }


BUILDERS = {
    "weights_digest.json": build_weights_digest,
    "handshake.json": build_handshake,
    "close_codes.json": build_close_codes,
    "channel.json": build_channel,
    "expert_compute.json": build_expert_compute,
    "tensor_codec.json": build_tensor_codec,
}


def _dumps(obj: object, indent: str = "") -> str:
    """JSON with one key per line and every list of numbers on one line."""
    inner = indent + "  "
    if isinstance(obj, dict):
        items = [f"{inner}{json.dumps(k)}: {_dumps(v, inner)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        return "[\n" + ",\n".join(inner + _dumps(v, inner) for v in obj) + "\n" + indent + "]"
    return json.dumps(obj)


def write_all() -> None:
    VECTORS.mkdir(exist_ok=True)
    for name, build in BUILDERS.items():
        (VECTORS / name).write_text(_dumps(build()) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_vectors.py --write   (rewrites tests/vectors/ from the implementation)")
    write_all()
    sys.exit(0)


# -- the tests ----------------------------------------------------------------------------------

DIGEST = _load("weights_digest.json")
HANDSHAKE = _load("handshake.json")
CLOSE_CODES = _load("close_codes.json")
CHANNEL = _load("channel.json")
COMPUTE = _load("expert_compute.json")
CODEC = _load("tensor_codec.json")


@pytest.mark.parametrize("case", DIGEST["experts"], ids=[c["name"] for c in DIGEST["experts"]])
def test_expert_digest(case):
    gate, up, down = _tensor(case["gate"]), _tensor(case["up"]), _tensor(case["down"])
    gate_up = torch.cat([gate, up], dim=0)
    assert hashlib.sha256(bytes.fromhex(case["preimage_hex"])).hexdigest() == case["expert_digest_hex"]
    assert expert_digest(gate_up, down).hex() == case["expert_digest_hex"]


@pytest.mark.parametrize("case", DIGEST["slices"], ids=[c["name"] for c in DIGEST["slices"]])
def test_slices_digest(case):
    experts = [DIGEST["experts"][i] for i in case["experts"]]
    digests = {(e["layer"], e["expert"]): bytes.fromhex(e["expert_digest_hex"]) for e in experts}
    assert hashlib.sha256(bytes.fromhex(case["preimage_hex"])).hexdigest() == case["weights_digest_hex"]
    assert slices_digest(digests).hex() == case["weights_digest_hex"]
    # The order a worker computes its experts in does not matter.
    assert slices_digest(dict(reversed(list(digests.items())))).hex() == case["weights_digest_hex"]


def test_worked_example_digest_is_the_one_in_the_spec():
    doc = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "PROTOCOL.md").read_text()
    assert DIGEST["experts"][0]["preimage_hex"] in doc.replace(" ", "").replace("\n", "")
    assert DIGEST["experts"][0]["expert_digest_hex"] in doc
    assert DIGEST["slices"][1]["weights_digest_hex"] in doc


def test_handshake_wallet():
    wallet = Wallet(_signing_key(bytes.fromhex(HANDSHAKE["wallet_seed_hex"])))
    assert wallet.address == HANDSHAKE["wallet_address"]
    body = bytes.fromhex(HANDSHAKE["hello_body_hex"])
    assert bytes.fromhex(HANDSHAKE["signed_message_hex"]) == HELLO_SIGNATURE_DOMAIN + body
    assert wallet.sign(HELLO_SIGNATURE_DOMAIN + body).hex() == HANDSHAKE["signature_hex"]


def _hub() -> tuple[HubHandshake, list[int]]:
    now = [HANDSHAKE["issued_at_unix_ms"]]
    key = Wallet(_signing_key(bytes.fromhex(HANDSHAKE["hub_seed_hex"])))
    assert key.address == HANDSHAKE["hub_key"]
    hub = HubHandshake(key, nonce=bytes.fromhex(HANDSHAKE["nonce_hex"]), clock_ms=lambda: now[0],
                       kx_private=bytes.fromhex(HANDSHAKE["hub_kx_private_hex"]))
    assert hub.challenge().hex() == HANDSHAKE["session_challenge_hex"]
    return hub, now


def test_handshake_messages():
    challenge = session_pb2.SessionChallenge.FromString(bytes.fromhex(HANDSHAKE["session_challenge_hex"]))
    assert challenge.nonce.hex() == HANDSHAKE["nonce_hex"]
    assert challenge.hub_key == HANDSHAKE["hub_key"]
    assert challenge.issued_at_unix_ms == HANDSHAKE["issued_at_unix_ms"]
    hub, _ = _hub()
    wallet = Wallet(_signing_key(bytes.fromhex(HANDSHAKE["wallet_seed_hex"])))
    worker = _worker_handshake(wallet, HANDSHAKE["hello"], bytes.fromhex(HANDSHAKE["worker_kx_private_hex"]))
    hello = worker.receive_challenge(bytes.fromhex(HANDSHAKE["session_challenge_hex"]))
    assert hello.hex() == HANDSHAKE["session_hello_hex"]
    msg = session_pb2.SessionHello.FromString(hello)
    assert msg.body.hex() == HANDSHAKE["hello_body_hex"]
    assert msg.signature.hex() == HANDSHAKE["signature_hex"]
    info = hub.receive_hello(hello)
    assert info.wallet == HANDSHAKE["wallet_address"]
    assert info.weights_digest.hex() == HANDSHAKE["hello"]["weights_digest_hex"]
    assert info.slices == {s["layer"]: tuple(s["experts"]) for s in HANDSHAKE["hello"]["slices"]}
    accept = hub.accept(HANDSHAKE["session_id"])
    assert accept.hex() == HANDSHAKE["session_accept_hex"]
    assert worker.receive_accept(accept) == HANDSHAKE["session_id"]
    assert hub.encrypted and worker.encrypted
    th = bytes.fromhex(HANDSHAKE["transcript_hash_hex"])
    assert transcript_hash(bytes.fromhex(HANDSHAKE["session_challenge_hex"]), hello) == th
    signed = bytes.fromhex(HANDSHAKE["accept_signed_message_hex"])
    assert signed == ACCEPT_SIGNATURE_DOMAIN + th + HANDSHAKE["session_id"].encode() + b"\x01"
    assert verify_signature(HANDSHAKE["hub_key"], signed, bytes.fromhex(HANDSHAKE["accept_signature_hex"]))


def test_channel_key_schedule():
    hub_kx = KeyExchange(bytes.fromhex(CHANNEL["hub_kx_private_hex"]))
    worker_kx = KeyExchange(bytes.fromhex(CHANNEL["worker_kx_private_hex"]))
    assert (hub_kx.public.hex(), worker_kx.public.hex()) == (CHANNEL["hub_kx_public_hex"], CHANNEL["worker_kx_public_hex"])
    shared = hub_kx.shared_secret(worker_kx.public)
    assert shared == worker_kx.shared_secret(hub_kx.public)
    assert shared.hex() == CHANNEL["shared_secret_hex"]
    assert CHANNEL["transcript_hash_hex"] == HANDSHAKE["transcript_hash_hex"]
    assert CHANNEL["hkdf_info"].encode() == TUNNEL_KEYS_INFO
    keys = derive_tunnel_keys(shared, bytes.fromhex(CHANNEL["transcript_hash_hex"]))
    assert (keys[0].hex(), keys[1].hex()) == (CHANNEL["hub_to_worker_key_hex"], CHANNEL["worker_to_hub_key_hex"])


def test_channel_sealed_messages():
    """Sealed with the library's cipher, and with ChaCha20-Poly1305 by hand from the stated
    recipe (what another implementation would write)."""
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    keys = (bytes.fromhex(CHANNEL["hub_to_worker_key_hex"]), bytes.fromhex(CHANNEL["worker_to_hub_key_hex"]))
    hub, worker = TunnelCipher.for_hub(keys), TunnelCipher.for_worker(keys)
    assert {m["kind"] for m in CHANNEL["messages"]} == set(_KIND_BYTES)
    for m in CHANNEL["messages"]:
        payload = bytes.fromhex(m["payload_hex"])
        msg = _message(m["kind"], payload)
        sealer, opener = (hub, worker) if m["from"] == "hub" else (worker, hub)
        assert sealer.sent == m["counter"]
        assert sealer.seal(msg).hex() == m["sealed_hex"]  # type: ignore[arg-type]
        assert opener.open(bytes.fromhex(m["sealed_hex"])) == msg
        key = keys[0] if m["from"] == "hub" else keys[1]
        plain = bytes([_KIND_BYTES[m["kind"]]]) + payload
        assert ChaCha20Poly1305(key).encrypt(m["counter"].to_bytes(12, "big"), plain, None).hex() == m["sealed_hex"]


def test_channel_with_aes_256_gcm():
    """The AES-256-GCM form: the accept's signed bytes, the HKDF info and keys, and messages
    sealed by hand from the stated recipe."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aes = CHANNEL["aes_256_gcm"]
    transcript = bytes.fromhex(CHANNEL["transcript_hash_hex"])
    signed = (ACCEPT_AEAD_SIGNATURE_DOMAIN + transcript + bytes([aes["aead"], 1]) + aes["session_id"].encode())
    assert signed.hex() == aes["accept_signed_message_hex"]
    assert accept_signed_message(transcript, aes["session_id"], True, AEAD_AES_256_GCM).hex() == signed.hex()
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=transcript, info=aes["hkdf_info"].encode()).derive(
        bytes.fromhex(CHANNEL["shared_secret_hex"]))
    assert (okm[:32].hex(), okm[32:].hex()) == (aes["hub_to_worker_key_hex"], aes["worker_to_hub_key_hex"])
    for m in aes["messages"]:
        key = okm[:32] if m["from"] == "hub" else okm[32:]
        plain = bytes([_KIND_BYTES[m["kind"]]]) + bytes.fromhex(m["payload_hex"])
        assert AESGCM(key).encrypt(m["counter"].to_bytes(12, "big"), plain, None).hex() == m["sealed_hex"]


@pytest.mark.parametrize("case", HANDSHAKE["refusals"], ids=[c["name"] for c in HANDSHAKE["refusals"]])
def test_handshake_refusals(case):
    hub, now = _hub()
    now[0] = case["now_ms"]
    with pytest.raises(RemoteProtocolError) as err:
        hub.receive_hello(bytes.fromhex(case["hello_hex"]))
    assert err.value.close_code == case["close_code"]


def test_close_codes():
    """The table in close_codes.json is CloseCode's, each code with close_class's class; the
    codes no table names get their range's."""
    assert {c["name"]: c["code"] for c in CLOSE_CODES["codes"]} == close_code_members()
    for case in CLOSE_CODES["codes"] + CLOSE_CODES["unassigned"]:
        assert close_class(case["code"]) == case["class"], case
    for r in CLOSE_CODES["ranges"]:
        assert {close_class(c) for c in range(r["first"], r["last"] + 1)} == {r["class"]}


def test_expert_forward_single():
    s = COMPUTE["single"]
    act = get_activation(s["activation"])
    out = expert_forward(_tensor(s["hidden"]), _tensor(s["gate_up"]), _tensor(s["down"]), act,
                         _tensor(s["routing_weights"]))
    assert _tensor_json(out) == s["output"]


@pytest.mark.parametrize("case", COMPUTE["dispatch"], ids=[c["name"] for c in COMPUTE["dispatch"]])
def test_dispatch(case):
    weights = {int(e): (_tensor(v["gate_up"]), _tensor(v["down"])) for e, v in COMPUTE["experts"].items()}
    req = expert_pb2.DispatchRequest.FromString(bytes.fromhex(case["dispatch_request_hex"]))
    assert req.call_id == case["call_id"]
    answer = _dispatch(req, weights, COMPUTE["model"]["hidden_act"], COMPUTE["model"]["hidden_size"])
    assert answer.partials.SerializeToString().hex() == case["partials_tensor_hex"]
    assert _tensor_json(decode_tensor(answer.partials)) == case["partials"]
    assert answer.HasField("projections") == req.projections
    if req.projections:
        assert answer.projections.SerializeToString().hex() == case["projections_tensor_hex"]
        # [g | u] = x @ gate_up^T of each assignment's row and expert, exact here.
        hidden = decode_tensor(req.hidden).float()
        rows = [hidden[i] for i in req.row_index]
        experts = [s.expert for s in req.segments for _ in range(s.rows)]
        want = torch.stack([weights[e][0] @ r for r, e in zip(rows, experts)]).to(decode_tensor(req.hidden).dtype)
        assert torch.equal(decode_tensor(answer.projections), want)


@pytest.mark.parametrize("case", COMPUTE["functions"], ids=[c["name"] for c in COMPUTE["functions"]])
def test_expert_functions(case):
    from kvasir_rpc import audit_rows
    from kvasir_rpc._gen.kvasir.v1 import function_pb2

    fn = ExpertFunction.from_proto(function_pb2.ExpertFunction.FromString(bytes.fromhex(case["function_proto_hex"])),
                                   default_activation="silu")
    f = case["function"]
    gates = {function_pb2.EXPERT_GATE_GLU: "glu", function_pb2.EXPERT_GATE_CLAMPED_SWIGLU: "clamped_swiglu",
             function_pb2.EXPERT_GATE_CLAMPED_GLU: "clamped_glu"}
    assert (fn.gate, fn.alpha, fn.limit, fn.interleaved, fn.transposed, fn.bias) == (
        gates[f["gate"]], f["alpha"], f["limit"], f["interleaved"], f["transposed"], f["bias"])
    x, gate_up, down, w = (_tensor(case[k]) for k in ("hidden", "gate_up", "down", "routing_weights"))
    biases = (_tensor(case["gate_up_bias"]), _tensor(case["down_bias"])) if fn.bias else None
    out, projections = expert_forward_projections(x, gate_up, down, fn, w, biases)
    # The projections are exact on every CPU: products and sums of multiples of 1/4.
    assert _tensor_json(projections) == case["projections"]
    # The partials pass through exp: equal here or, on another CPU, within the audit bound.
    want = _tensor(case["output"])
    verdict = audit_rows(want, x, gate_up, down, fn, w, list(range(x.shape[0])), biases)
    assert verdict.passed, verdict
    if fn.gate != "glu":  # the clamps are exercised: some projections lie past +-limit
        g, u = fn.split(projections.float())[0], projections.float()[:, projections.shape[1] // 2:]
        assert float(g.max()) > fn.limit and (float(u.min()) < -fn.limit or float(u.max()) > fn.limit)


def test_expert_function_vectors_follow_the_spec_by_hand():
    # gpt-oss's function written out from docs/PROTOCOL.md 11.2 in float64, against the float32 vector.
    case = next(c for c in COMPUTE["functions"] if c["dtype"] == "float32" and c["function"]["bias"])
    x, gu, d, w = (_tensor(case[k]).double() for k in ("hidden", "gate_up", "down", "routing_weights"))
    b_gu, b_d = _tensor(case["gate_up_bias"]).double(), _tensor(case["down_bias"]).double()
    p = x @ gu + b_gu  # transposed storage: x @ W
    g, u = p[:, ::2].clamp(max=7.0), p[:, 1::2].clamp(-7.0, 7.0)
    h = (u + 1) * (g * torch.sigmoid(g * 1.702))
    out = (h @ d + b_d) * w[:, None]
    assert torch.equal(_tensor(case["projections"]).double(), torch.cat([p[:, ::2], p[:, 1::2]], dim=1))
    assert torch.allclose(_tensor(case["output"]).double(), out, rtol=1e-5, atol=1e-5)


def test_dispatch_rows_are_the_single_expert_rows():
    # The float32 dispatch's expert-0 assignments are rows 0 and 2 of 'single' (weights 0.5, 0.25):
    # the same function, whoever calls it.
    single = _tensor(COMPUTE["single"]["output"])
    partials = _tensor(COMPUTE["dispatch"][0]["partials"])
    assert torch.equal(partials[0], single[0])
    assert torch.equal(partials[1], single[2] * 0.25)  # weight 1 there, 0.25 here: exact scaling


@pytest.mark.parametrize("case", CODEC["valid"], ids=[c["name"] for c in CODEC["valid"]])
def test_codec_valid(case):
    t = _tensor(case["tensor"])
    assert encode_tensor(t).SerializeToString().hex() == case["message_hex"]
    back = decode_tensor(tensor_pb2.Tensor.FromString(bytes.fromhex(case["message_hex"])))
    assert _tensor_json(back) == case["tensor"]


@pytest.mark.parametrize("case", CODEC["invalid"], ids=[c["name"] for c in CODEC["invalid"]])
def test_codec_invalid(case):
    with pytest.raises(TensorCodecError):
        decode_tensor(tensor_pb2.Tensor.FromString(bytes.fromhex(case["message_hex"])))
