"""The session handshake, without I/O (in the manner of h11 and wsproto).

Over the tunnel's WebSocket, after the HTTP upgrade, three binary messages:

    hub    -> worker   SessionChallenge{nonce, hub_key, issued_at}
    worker -> hub      SessionHello{body = HelloBody{nonce, hub_key, wallet, slices, ...},
                                    signature = Ed25519(wallet, DOMAIN + body)}
    hub    -> worker   SessionAccept{session_id}

then raw tunnel bytes. Each side is a plain object fed bytes; it returns bytes to send or
raises RemoteProtocolError carrying the WebSocket close code to answer with (1008, policy
violation, for a bad signature or a stale challenge; 1002 for malformed messages).
"""

from __future__ import annotations

import dataclasses
import enum
import secrets
import time
from collections.abc import Callable, Mapping, Sequence

from google.protobuf.message import DecodeError

from kvasir_rpc._errors import CloseCode, LocalProtocolError, RemoteProtocolError
from kvasir_rpc._experts import ExpertSet, ModelShape
from kvasir_rpc._gen.kvasir.v1 import session_pb2
from kvasir_rpc._wallet import Wallet, is_address, verify_signature
from kvasir_rpc.protocol import (
    HELLO_SIGNATURE_DOMAIN,
    MAX_CHALLENGE_AGE_MS,
    MAX_EXPERTS_PER_LAYER,
    MAX_HELLO_BYTES,
    MAX_LAYERS,
    MAX_SESSION_ID_CHARS,
    NONCE_BYTES,
)

__all__ = [
    "HELLO_SIGNATURE_DOMAIN",
    "HelloInfo",
    "HubHandshake",
    "WorkerHandshake",
    "slices_from_proto",
    "slices_to_proto",
]

DEFAULT_MAX_CHALLENGE_AGE_MS = MAX_CHALLENGE_AGE_MS

Slices = Mapping[int, Sequence[int]]


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def slices_to_proto(slices: Slices) -> list[session_pb2.ExpertSlice]:
    return [
        session_pb2.ExpertSlice(layer=layer, experts=experts.to_list() if isinstance(experts, ExpertSet)
                                else sorted(experts))
        for layer, experts in sorted(slices.items())
        if experts
    ]


def slices_from_proto(
    items: Sequence[session_pb2.ExpertSlice], shape: ModelShape | None = None
) -> dict[int, ExpertSet]:
    """Validate announced slices and store them compactly (ExpertSet). Without ``shape`` the
    protocol's bounds apply; with it every layer and expert must exist in that model.
    Raises ValueError saying what is wrong."""
    out: dict[int, ExpertSet] = {}
    if len(items) > MAX_LAYERS:
        raise ValueError(f"{len(items)} layers announced, at most {MAX_LAYERS}")
    for item in items:
        if item.layer in out:
            raise ValueError(f"layer {item.layer} announced twice")
        if shape is not None and item.layer >= shape.layers:
            raise ValueError(f"layer {item.layer} is not in the model served ({shape.layers} layers)")
        n = len(item.experts)
        if n > MAX_EXPERTS_PER_LAYER:
            raise ValueError(f"layer {item.layer}: {n} experts, at most {MAX_EXPERTS_PER_LAYER}")
        if not n:
            raise ValueError(f"layer {item.layer}: no experts")
        try:
            experts = ExpertSet.from_sorted(item.experts)
        except ValueError:
            raise ValueError(f"layer {item.layer}: experts must be sorted and unique") from None
        if shape is not None and item.experts[-1] >= shape.experts:  # ascending: the last is the largest
            raise ValueError(f"layer {item.layer}: expert {item.experts[-1]} is not in the model served "
                             f"({shape.experts} experts per layer)")
        out[item.layer] = experts
    return out


@dataclasses.dataclass(frozen=True)
class HelloInfo:
    """What a verified worker claims."""

    wallet: str
    slices: dict[int, ExpertSet]
    weights_digest: bytes
    device: str
    model_type: str
    worker_version: str


class _HubState(enum.Enum):
    START = "START"
    CHALLENGED = "CHALLENGED"
    VERIFIED = "VERIFIED"
    DONE = "DONE"
    FAILED = "FAILED"


class _WorkerState(enum.Enum):
    AWAIT_CHALLENGE = "AWAIT_CHALLENGE"
    AWAIT_ACCEPT = "AWAIT_ACCEPT"
    DONE = "DONE"
    FAILED = "FAILED"


# The one place the transitions live: (state, event) -> next state.
_HUB_TRANSITIONS = {
    (_HubState.START, "challenge"): _HubState.CHALLENGED,
    (_HubState.CHALLENGED, "receive_hello"): _HubState.VERIFIED,
    (_HubState.VERIFIED, "accept"): _HubState.DONE,
}
_WORKER_TRANSITIONS = {
    (_WorkerState.AWAIT_CHALLENGE, "receive_challenge"): _WorkerState.AWAIT_ACCEPT,
    (_WorkerState.AWAIT_ACCEPT, "receive_accept"): _WorkerState.DONE,
}


def _parse(cls: type, data: bytes, what: str):  # type: ignore[no-untyped-def]
    msg = cls()
    try:
        msg.ParseFromString(data)
    except (DecodeError, RuntimeWarning, ValueError) as exc:
        raise RemoteProtocolError(f"malformed {what}: {exc}", close_code=CloseCode.PROTOCOL_ERROR) from exc
    return msg


class HubHandshake:
    """The hub's side. ``challenge()`` -> bytes; ``receive_hello(bytes)`` -> HelloInfo;
    ``accept(session_id)`` -> bytes."""

    def __init__(
        self,
        hub_key: str,
        *,
        clock_ms: Callable[[], int] = _now_ms,
        max_challenge_age_ms: int = DEFAULT_MAX_CHALLENGE_AGE_MS,
        nonce: bytes | None = None,
        shape: ModelShape | None = None,
    ) -> None:
        """``shape``: the model served; a hello announcing a layer or expert outside it is
        refused (1008). Without it only the protocol's bounds apply."""
        if not is_address(hub_key):
            raise ValueError("hub_key must be 64 lowercase hex characters")
        self.hub_key = hub_key
        self._clock = clock_ms
        self._max_age = max_challenge_age_ms
        self._nonce = nonce if nonce is not None else secrets.token_bytes(NONCE_BYTES)
        self._shape = shape
        self._issued_ms = 0
        self.state = _HubState.START

    def _step(self, event: str) -> None:
        nxt = _HUB_TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise LocalProtocolError(f"hub handshake: can't {event} in state {self.state.value}")
        self.state = nxt

    def challenge(self) -> bytes:
        self._step("challenge")
        self._issued_ms = self._clock()
        return session_pb2.SessionChallenge(
            nonce=self._nonce, hub_key=self.hub_key, issued_at_unix_ms=self._issued_ms
        ).SerializeToString()

    def receive_hello(self, data: bytes) -> HelloInfo:
        if self.state is not _HubState.CHALLENGED:
            raise LocalProtocolError(f"hub handshake: can't receive_hello in state {self.state.value}")
        try:
            info = self._verify(data)
        except RemoteProtocolError:
            self.state = _HubState.FAILED
            raise
        self._step("receive_hello")
        return info

    def _verify(self, data: bytes) -> HelloInfo:
        if len(data) > MAX_HELLO_BYTES:
            raise RemoteProtocolError(
                f"hello of {len(data)} bytes, at most {MAX_HELLO_BYTES}", close_code=CloseCode.MESSAGE_TOO_BIG
            )
        hello = _parse(session_pb2.SessionHello, data, "SessionHello")
        body = _parse(session_pb2.HelloBody, hello.body, "HelloBody")
        if not is_address(body.wallet):
            raise RemoteProtocolError(
                "hello: wallet must be 64 lowercase hex characters", close_code=CloseCode.POLICY_VIOLATION
            )
        if body.nonce != self._nonce or body.hub_key != self.hub_key:
            raise RemoteProtocolError(
                "stale challenge: the hello answers another challenge", close_code=CloseCode.POLICY_VIOLATION
            )
        if self._clock() - self._issued_ms > self._max_age:
            raise RemoteProtocolError(
                f"stale challenge: answered after more than {self._max_age} ms",
                close_code=CloseCode.POLICY_VIOLATION,
            )
        if not verify_signature(body.wallet, HELLO_SIGNATURE_DOMAIN + hello.body, hello.signature):
            raise RemoteProtocolError(
                "bad signature: the hello is not signed by its wallet", close_code=CloseCode.POLICY_VIOLATION
            )
        try:
            slices = slices_from_proto(body.slices, self._shape)
        except ValueError as exc:
            raise RemoteProtocolError(f"hello: {exc}", close_code=CloseCode.POLICY_VIOLATION) from exc
        if len(body.weights_digest) != 32:
            raise RemoteProtocolError(
                "hello: weights_digest must be 32 bytes (sha256)", close_code=CloseCode.POLICY_VIOLATION
            )
        return HelloInfo(
            wallet=body.wallet,
            slices=slices,
            weights_digest=bytes(body.weights_digest),
            device=body.device[:64],
            model_type=body.model_type[:64],
            worker_version=body.worker_version[:64],
        )

    def accept(self, session_id: str) -> bytes:
        self._step("accept")
        return session_pb2.SessionAccept(session_id=session_id).SerializeToString()


class WorkerHandshake:
    """The worker's side. ``receive_challenge(bytes)`` -> hello bytes;
    ``receive_accept(bytes)`` -> session id."""

    def __init__(
        self,
        wallet: Wallet,
        *,
        slices: Slices,
        weights_digest: bytes,
        device: str,
        model_type: str = "",
        worker_version: str = "",
        expected_hub_key: str | None = None,
    ) -> None:
        self._wallet = wallet
        self._slices = slices
        self._digest = weights_digest
        self._device = device
        self._model_type = model_type
        self._version = worker_version
        self._expected_hub_key = expected_hub_key
        self.hub_key: str | None = None
        self.state = _WorkerState.AWAIT_CHALLENGE

    def _step(self, event: str) -> None:
        nxt = _WORKER_TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise LocalProtocolError(f"worker handshake: can't {event} in state {self.state.value}")
        self.state = nxt

    def _fail(self, reason: str, code: int = CloseCode.PROTOCOL_ERROR) -> RemoteProtocolError:
        self.state = _WorkerState.FAILED
        return RemoteProtocolError(reason, close_code=code)

    def receive_challenge(self, data: bytes) -> bytes:
        if self.state is not _WorkerState.AWAIT_CHALLENGE:
            raise LocalProtocolError(f"worker handshake: can't receive_challenge in state {self.state.value}")
        try:
            ch = _parse(session_pb2.SessionChallenge, data, "SessionChallenge")
        except RemoteProtocolError:
            self.state = _WorkerState.FAILED
            raise
        if len(ch.nonce) != NONCE_BYTES:
            raise self._fail(f"challenge nonce must be {NONCE_BYTES} bytes, got {len(ch.nonce)}")
        if not is_address(ch.hub_key):
            raise self._fail("challenge hub_key must be 64 lowercase hex characters")
        if self._expected_hub_key is not None and ch.hub_key != self._expected_hub_key:
            raise self._fail(f"unexpected hub key {ch.hub_key}", CloseCode.POLICY_VIOLATION)
        self.hub_key = ch.hub_key
        body = session_pb2.HelloBody(
            nonce=ch.nonce,
            hub_key=ch.hub_key,
            wallet=self._wallet.address,
            slices=slices_to_proto(self._slices),
            weights_digest=self._digest,
            device=self._device,
            model_type=self._model_type,
            worker_version=self._version,
        ).SerializeToString()
        self._step("receive_challenge")
        signature = self._wallet.sign(HELLO_SIGNATURE_DOMAIN + body)
        return session_pb2.SessionHello(body=body, signature=signature).SerializeToString()

    def receive_accept(self, data: bytes) -> str:
        if self.state is not _WorkerState.AWAIT_ACCEPT:
            raise LocalProtocolError(f"worker handshake: can't receive_accept in state {self.state.value}")
        try:
            msg = _parse(session_pb2.SessionAccept, data, "SessionAccept")
        except RemoteProtocolError:
            self.state = _WorkerState.FAILED
            raise
        if not msg.session_id or len(msg.session_id) > MAX_SESSION_ID_CHARS:
            raise self._fail(f"accept: session_id must be 1 to {MAX_SESSION_ID_CHARS} characters")
        self._step("receive_accept")
        return msg.session_id
