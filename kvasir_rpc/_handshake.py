"""The session handshake, without I/O (in the manner of h11 and wsproto).

Over the tunnel's WebSocket, after the HTTP upgrade, three binary messages:

    hub    -> worker   SessionChallenge{nonce, hub_key, issued_at, kx_public}
    worker -> hub      SessionHello{body = HelloBody{nonce, hub_key, wallet, slices, ...,
                                                     kx_public, hub_kx_public, require_encryption},
                                    signature = Ed25519(wallet, DOMAIN + body)}
    hub    -> worker   SessionAccept{session_id, encrypted,
                                     signature = Ed25519(hub key, ACCEPT_DOMAIN + transcript hash
                                                         + session_id + encrypted)}

then the tunnel, sealed end to end when ``encrypted`` (``_channel``; each side's ``cipher``).
The hub's signature over the transcript (both messages exactly as sent, with both ephemeral
keys) binds the session to this connection: a relay can neither replay a hello on another
connection (the nonce), nor put its own key exchange in (the signatures cover both keys),
nor strip the encryption (the flag is signed).

Each side is a plain object fed bytes; it returns bytes to send or raises
RemoteProtocolError carrying the WebSocket close code to answer with (``CloseCode``: 1002 for
malformed messages; on the hub's side 4100 for a hello that breaks the rules, 4201 for one
that answers another challenge, 4102 for slices outside the model, 4103 for encryption
policies the sides do not share; on the worker's side 4104 for an unpinned hub key, 4103,
and 1008 for an accept that does not verify).
"""

from __future__ import annotations

import dataclasses
import enum
import secrets
import time
from collections.abc import Callable, Mapping, Sequence

from google.protobuf.message import DecodeError

from kvasir_rpc._channel import KeyExchange, TunnelCipher, derive_tunnel_keys, transcript_hash
from kvasir_rpc._errors import CloseCode, LocalProtocolError, RemoteProtocolError
from kvasir_rpc._experts import ExpertSet, ModelShape
from kvasir_rpc._gen.kvasir.v1 import session_pb2
from kvasir_rpc._wallet import Wallet, is_address, verify_signature
from kvasir_rpc.protocol import (
    ACCEPT_AEAD_SIGNATURE_DOMAIN,
    ACCEPT_CHANNELS_SIGNATURE_DOMAIN,
    ACCEPT_SIGNATURE_DOMAIN,
    AEAD_CHACHA20_POLY1305,
    AEAD_NAMES,
    MAX_AEADS_OFFERED,
    E2E_HUB_MODES,
    HELLO_SIGNATURE_DOMAIN,
    KX_PUBLIC_BYTES,
    MAX_CHALLENGE_AGE_MS,
    MAX_EXPERTS_PER_LAYER,
    MAX_HELLO_BYTES,
    MAX_LAYERS,
    MAX_SESSION_ID_CHARS,
    MAX_TUNNEL_CHANNELS,
    NONCE_BYTES,
)

__all__ = [
    "ACCEPT_SIGNATURE_DOMAIN",
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


class OutsideModel(ValueError):
    """Announced slices name a layer or an expert the model served does not have."""


def slices_from_proto(
    items: Sequence[session_pb2.ExpertSlice], shape: ModelShape | None = None
) -> dict[int, ExpertSet]:
    """Validate announced slices and store them compactly (ExpertSet). Without ``shape`` the
    protocol's bounds apply; with it every layer and expert must exist in that model.
    Raises ValueError saying what is wrong (OutsideModel when a slice is not in the model)."""
    out: dict[int, ExpertSet] = {}
    if len(items) > MAX_LAYERS:
        raise ValueError(f"{len(items)} layers announced, at most {MAX_LAYERS}")
    for item in items:
        if item.layer in out:
            raise ValueError(f"layer {item.layer} announced twice")
        if shape is not None and item.layer >= shape.layers:
            raise OutsideModel(f"layer {item.layer} is not in the model served ({shape.layers} layers)")
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
            raise OutsideModel(f"layer {item.layer}: expert {item.experts[-1]} is not in the model served "
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
    # The worker returns projections when a call asks (row checks possible).
    projections: bool = False
    # The expert function it computes: a serialized kvasir.v1.ExpertFunction (b"": unset, the
    # default function), kept as bytes so the hub passes it on without interpreting it.
    expert_function: bytes = b""
    # The backbone connections it carries at once on a multiplexed tunnel (0: the plain tunnel).
    tunnel_channels: int = 0
    # A planning hello (--experts auto): it holds nothing yet, ``slices`` are the experts its
    # checkpoint has, and it can hold this many; the hub answers with a suggested slice.
    expert_capacity: int = 0


def _bounded_function(body: session_pb2.HelloBody) -> bytes:
    """The hello's expert function as the hub keeps and lists it: its activation name cut to 64
    characters, and no layers (a hello's function is for all its slices); b"" when unset."""
    if not body.HasField("expert_function"):
        return b""
    fn = body.expert_function
    fn.activation = fn.activation[:64]
    del fn.layers[:]
    return fn.SerializeToString(deterministic=True)


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


def accept_signed_message(transcript: bytes, session_id: str, encrypted: bool,
                          aead: int = AEAD_CHACHA20_POLY1305, channels: int = 0) -> bytes:
    """What the hub signs in SessionAccept: the domain, the transcript hash, the session id
    (UTF-8) and one byte, 1 when the tunnel is encrypted. With another AEAD than the default,
    a domain of its own, the transcript hash, the AEAD and encrypted bytes, then the session
    id (fixed-size fields first: no accept's bytes read as another's). A multiplexed tunnel
    (``channels``): a third domain, the same fixed fields and the channels (2 bytes)."""
    flag = b"\x01" if encrypted else b"\x00"
    if channels:
        return (ACCEPT_CHANNELS_SIGNATURE_DOMAIN + transcript + bytes([aead]) + flag + channels.to_bytes(2, "big")
                + session_id.encode())
    if aead == AEAD_CHACHA20_POLY1305:
        return ACCEPT_SIGNATURE_DOMAIN + transcript + session_id.encode() + flag
    return ACCEPT_AEAD_SIGNATURE_DOMAIN + transcript + bytes([aead]) + flag + session_id.encode()


def _parse(cls: type, data: bytes, what: str):  # type: ignore[no-untyped-def]
    msg = cls()
    try:
        msg.ParseFromString(data)
    except (DecodeError, RuntimeWarning, ValueError) as exc:
        raise RemoteProtocolError(f"malformed {what}: {exc}", close_code=CloseCode.PROTOCOL_ERROR) from exc
    return msg


class HubHandshake:
    """The hub's side. ``challenge()`` -> bytes; ``receive_hello(bytes)`` -> HelloInfo;
    ``accept(session_id)`` -> bytes, signed with the hub key. After ``accept``, ``encrypted``
    says whether the tunnel is sealed and ``cipher`` seals and opens it (None in clear)."""

    def __init__(
        self,
        key: Wallet,
        *,
        clock_ms: Callable[[], int] = _now_ms,
        max_challenge_age_ms: int = DEFAULT_MAX_CHALLENGE_AGE_MS,
        nonce: bytes | None = None,
        shape: ModelShape | None = None,
        e2e: str = "auto",
        via_gateway: bool = False,
        kx_private: bytes | None = None,
        tunnel_channels: int = 0,
    ) -> None:
        """``key``: the hub's wallet, which signs the accept. ``shape``: the model served; a
        hello announcing a layer or expert outside it is refused (4102). Without it only the
        protocol's bounds apply. ``e2e`` (one of E2E_HUB_MODES) with ``via_gateway`` decide
        whether the session is encrypted end to end: "auto" encrypts a session that came
        through a gateway or whose worker requires it, "on" every session, "off" none.
        ``nonce`` and ``kx_private`` (the ephemeral X25519 key) are fresh unless given.
        ``tunnel_channels``: the most backbone connections this hub puts on one worker's tunnel
        at once (below 2: the plain tunnel for every worker); a worker offering fewer gets its
        offer. After ``receive_hello``, ``channels`` is the choice (0: the plain tunnel)."""
        if e2e not in E2E_HUB_MODES:
            raise ValueError(f"e2e must be one of {', '.join(E2E_HUB_MODES)}, not {e2e!r}")
        self._key = key
        self.hub_key = key.address
        self._clock = clock_ms
        self._max_age = max_challenge_age_ms
        self._nonce = nonce if nonce is not None else secrets.token_bytes(NONCE_BYTES)
        self._shape = shape
        self._e2e = e2e
        self._via_gateway = via_gateway
        self._kx = KeyExchange(kx_private)
        self._issued_ms = 0
        self._challenge = b""
        self._transcript = b""
        self._keys: tuple[bytes, bytes] | None = None
        # The hello's wallet once its signature verifies (also when a later check refuses it).
        self.wallet: str | None = None
        self.encrypted = False
        # The AEAD sealing the tunnel (a TunnelAead value): the hello's first offer this hub
        # supports when encrypted, else the default.
        self.aead = AEAD_CHACHA20_POLY1305
        self.cipher: TunnelCipher | None = None
        self._max_channels = min(max(tunnel_channels, 0), MAX_TUNNEL_CHANNELS)
        self.channels = 0
        self.state = _HubState.START

    def _step(self, event: str) -> None:
        nxt = _HUB_TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise LocalProtocolError(f"hub handshake: can't {event} in state {self.state.value}")
        self.state = nxt

    def challenge(self) -> bytes:
        self._step("challenge")
        self._issued_ms = self._clock()
        self._challenge = session_pb2.SessionChallenge(
            nonce=self._nonce, hub_key=self.hub_key, issued_at_unix_ms=self._issued_ms, kx_public=self._kx.public
        ).SerializeToString()
        return self._challenge

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
                "hello: wallet must be 64 lowercase hex characters", close_code=CloseCode.HELLO_INVALID
            )
        if body.nonce != self._nonce or body.hub_key != self.hub_key:
            raise RemoteProtocolError(
                "stale challenge: the hello answers another challenge", close_code=CloseCode.HELLO_STALE
            )
        if self._clock() - self._issued_ms > self._max_age:
            raise RemoteProtocolError(
                f"stale challenge: answered after more than {self._max_age} ms",
                close_code=CloseCode.HELLO_STALE,
            )
        if not verify_signature(body.wallet, HELLO_SIGNATURE_DOMAIN + hello.body, hello.signature):
            raise RemoteProtocolError(
                "bad signature: the hello is not signed by its wallet", close_code=CloseCode.HELLO_INVALID
            )
        self.wallet = body.wallet
        try:
            slices = slices_from_proto(body.slices, self._shape)
        except ValueError as exc:
            code = CloseCode.OUTSIDE_MODEL if isinstance(exc, OutsideModel) else CloseCode.HELLO_INVALID
            raise RemoteProtocolError(f"hello: {exc}", close_code=code) from exc
        if len(body.weights_digest) != 32:
            raise RemoteProtocolError(
                "hello: weights_digest must be 32 bytes (sha256)", close_code=CloseCode.HELLO_INVALID
            )
        self._transcript = transcript_hash(self._challenge, data)
        self.encrypted = self._must_encrypt(body)
        if body.kx_public:
            if body.hub_kx_public != self._kx.public:
                raise RemoteProtocolError("hello: hub_kx_public is not the key exchange this hub sent "
                                          "(a relay put its own in)", close_code=CloseCode.HELLO_STALE)
            if self.encrypted:
                self.aead = next((a for a in body.aeads if a in AEAD_NAMES), AEAD_CHACHA20_POLY1305)
                try:
                    shared = self._kx.shared_secret(body.kx_public)
                except RemoteProtocolError as exc:  # a low-order point: no honest worker's key
                    raise RemoteProtocolError(f"hello: {exc.reason}", close_code=CloseCode.HELLO_INVALID) from None
                self._keys = derive_tunnel_keys(shared, self._transcript, self.aead)
        if body.tunnel_channels > MAX_TUNNEL_CHANNELS:
            raise RemoteProtocolError(f"hello: tunnel_channels {body.tunnel_channels}, at most {MAX_TUNNEL_CHANNELS}",
                                      close_code=CloseCode.HELLO_INVALID)
        chosen = min(body.tunnel_channels, self._max_channels)
        self.channels = chosen if chosen >= 2 else 0
        return HelloInfo(
            wallet=body.wallet,
            slices=slices,
            weights_digest=bytes(body.weights_digest),
            device=body.device[:64],
            model_type=body.model_type[:64],
            worker_version=body.worker_version[:64],
            projections=body.projections,
            expert_function=_bounded_function(body),
            tunnel_channels=self.channels,
            expert_capacity=int(body.expert_capacity),
        )

    def _must_encrypt(self, body: session_pb2.HelloBody) -> bool:
        """Whether this session is sealed; RemoteProtocolError when the two sides' policies
        cannot both hold (4103) or the hello's key exchange breaks the rules (4100)."""
        if body.require_encryption and self._e2e == "off":
            raise RemoteProtocolError("the worker requires end-to-end encryption and this hub runs with --e2e off "
                                      "(run the worker with --e2e auto)",
                                      close_code=CloseCode.E2E_MISMATCH)
        must = self._e2e == "on" or (self._e2e == "auto" and (self._via_gateway or body.require_encryption))
        if must and not body.kx_public:
            raise RemoteProtocolError(f"this hub encrypts this session end to end (--e2e {self._e2e}) and the hello has "
                                      "no key exchange: upgrade the worker", close_code=CloseCode.E2E_MISMATCH)
        if body.kx_public and len(body.kx_public) != KX_PUBLIC_BYTES:
            raise RemoteProtocolError(f"hello: kx_public must be {KX_PUBLIC_BYTES} bytes, got {len(body.kx_public)}",
                                      close_code=CloseCode.HELLO_INVALID)
        if len(body.aeads) > MAX_AEADS_OFFERED:
            raise RemoteProtocolError(f"hello: offers {len(body.aeads)} AEADs, at most {MAX_AEADS_OFFERED}",
                                      close_code=CloseCode.HELLO_INVALID)
        return must

    def accept(self, session_id: str, suggested: Mapping[int, Sequence[int]] | None = None) -> bytes:
        """The signed SessionAccept; from now on ``cipher`` seals the tunnel when ``encrypted``.
        ``suggested``: the slice suggested to a planning hello (advice, not signed)."""
        self._step("accept")
        signature = self._key.sign(accept_signed_message(self._transcript, session_id, self.encrypted, self.aead,
                                                         self.channels))
        if self._keys is not None:
            self.cipher = TunnelCipher.for_hub(self._keys, self.aead)
        return session_pb2.SessionAccept(session_id=session_id, encrypted=self.encrypted, signature=signature,
                                         aead=self.aead,  # type: ignore[arg-type]
                                         tunnel_channels=self.channels,
                                         suggested_slices=slices_to_proto(suggested or {})).SerializeToString()


class WorkerHandshake:
    """The worker's side. ``receive_challenge(bytes)`` -> hello bytes;
    ``receive_accept(bytes)`` -> session id, once the hub's signature over the transcript
    checks out. Then ``encrypted`` and ``cipher`` as on the hub's side."""

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
        require_encryption: bool = False,
        kx_private: bytes | None = None,
        aeads: Sequence[int] = (),
        projections: bool = False,
        expert_function: object | None = None,
        tunnel_channels: int = 0,
        expert_capacity: int = 0,
    ) -> None:
        """``expected_hub_key``: the pinned hub key (a challenge from another is refused,
        4104). ``require_encryption``: refuse a challenge or an accept that does not encrypt (4103).
        ``kx_private``: the ephemeral X25519 key, fresh unless given. ``aeads``: the AEADs
        offered besides the default, most preferred first (``preferred_aeads()``).
        ``projections``: the worker answers a call that asks for its projections with them.
        ``tunnel_channels``: the most backbone connections it carries at once (2 to
        MAX_TUNNEL_CHANNELS; below 2 the plain tunnel); after the accept, ``channels`` is the
        hub's choice (0: the plain tunnel). ``expert_capacity``: a planning hello (``slices``
        the experts its checkpoint has); after the accept, ``suggested`` is the hub's slice."""
        self._wallet = wallet
        self._slices = slices
        self._digest = weights_digest
        self._device = device
        self._model_type = model_type
        self._version = worker_version
        self._expected_hub_key = expected_hub_key
        self._require = require_encryption
        self._kx = KeyExchange(kx_private)
        self._aeads = tuple(aeads)
        self._projections = projections
        # The kvasir.v1.ExpertFunction announced (None: unset, the default function).
        self._expert_function = expert_function
        if not 0 <= tunnel_channels <= MAX_TUNNEL_CHANNELS:
            raise ValueError(f"tunnel_channels: 0 to {MAX_TUNNEL_CHANNELS}, not {tunnel_channels}")
        self._offered_channels = tunnel_channels if tunnel_channels >= 2 else 0
        self.channels = 0
        self._capacity = max(int(expert_capacity), 0)
        self.suggested: dict[int, tuple[int, ...]] = {}
        unknown = [a for a in self._aeads if a not in AEAD_NAMES or a == AEAD_CHACHA20_POLY1305]
        if unknown or len(self._aeads) > MAX_AEADS_OFFERED:
            raise ValueError(f"aeads: offer at most {MAX_AEADS_OFFERED} of {sorted(AEAD_NAMES)[1:]} "
                             f"(the default is always supported), not {list(aeads)}")
        self._challenge = b""
        self._hello = b""
        self._hub_kx = b""
        self.hub_key: str | None = None
        self.encrypted = False
        self.aead = AEAD_CHACHA20_POLY1305
        self.cipher: TunnelCipher | None = None
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
            # Close reasons hold 120 characters: the keys' first 16 hex digits name them.
            raise self._fail(f"unexpected hub key {ch.hub_key[:16]}…: this worker pins {self._expected_hub_key[:16]}… "
                             "(--hub-key); another answered as the hub", CloseCode.HUB_KEY_MISMATCH)
        if ch.kx_public and len(ch.kx_public) != KX_PUBLIC_BYTES:
            raise self._fail(f"challenge kx_public must be {KX_PUBLIC_BYTES} bytes, got {len(ch.kx_public)}",
                             CloseCode.POLICY_VIOLATION)
        if self._require and not ch.kx_public:
            raise self._fail("the hub offers no end-to-end encryption (no key exchange in its challenge) and this "
                             "worker requires it (--e2e require): upgrade the hub", CloseCode.E2E_MISMATCH)
        self.hub_key = ch.hub_key
        self._hub_kx = bytes(ch.kx_public)
        body = session_pb2.HelloBody(
            nonce=ch.nonce,
            hub_key=ch.hub_key,
            wallet=self._wallet.address,
            slices=slices_to_proto(self._slices),
            weights_digest=self._digest,
            device=self._device,
            model_type=self._model_type,
            worker_version=self._version,
            kx_public=self._kx.public,
            hub_kx_public=self._hub_kx,
            require_encryption=self._require,
            aeads=self._aeads,  # type: ignore[arg-type]
            projections=self._projections,
            expert_function=self._expert_function,  # type: ignore[arg-type]
            tunnel_channels=self._offered_channels,
            expert_capacity=self._capacity,
        ).SerializeToString()
        self._step("receive_challenge")
        signature = self._wallet.sign(HELLO_SIGNATURE_DOMAIN + body)
        self._challenge = bytes(data)
        self._hello = session_pb2.SessionHello(body=body, signature=signature).SerializeToString()
        return self._hello

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
        assert self.hub_key is not None
        transcript = transcript_hash(self._challenge, self._hello)
        if not msg.signature:
            raise self._fail("accept: not signed by the hub (a hub too old for this worker, or a relay that "
                             "stripped the signature)", CloseCode.POLICY_VIOLATION)
        aead = int(msg.aead)
        if aead not in AEAD_NAMES:  # nothing this worker offered (and not one byte to check a signature over)
            raise self._fail(f"accept: unknown tunnel AEAD {aead}, which this worker did not offer",
                             CloseCode.POLICY_VIOLATION)
        channels = int(msg.tunnel_channels)
        if channels and not 2 <= channels <= self._offered_channels:  # not one byte to check a signature over
            raise self._fail(f"accept: a tunnel of {channels} channels; this worker offered "
                             f"{self._offered_channels or 'none (the plain tunnel)'}", CloseCode.POLICY_VIOLATION)
        if not verify_signature(self.hub_key, accept_signed_message(transcript, msg.session_id, msg.encrypted, aead,
                                                                    channels), msg.signature):
            raise self._fail(f"accept: bad signature (not hub {self.hub_key[:16]}… over this connection's handshake: "
                             "altered on the way, or replayed)", CloseCode.POLICY_VIOLATION)
        if aead != AEAD_CHACHA20_POLY1305 and (aead not in self._aeads or not msg.encrypted):
            # Signed by the hub itself: a hub that misbehaves (or a bug), not a relay.
            raise self._fail(f"accept: tunnel AEAD {aead}, which this worker did not offer "
                             f"(it offered {[AEAD_NAMES[a] for a in self._aeads] or 'only the default'})"
                             if msg.encrypted else "accept: an AEAD named for a tunnel that is not encrypted",
                             CloseCode.POLICY_VIOLATION)
        if msg.encrypted:
            if not self._hub_kx:
                raise self._fail("accept: encrypted, but the challenge had no key exchange",
                                 CloseCode.POLICY_VIOLATION)
            try:
                shared = self._kx.shared_secret(self._hub_kx)
            except RemoteProtocolError:
                self.state = _WorkerState.FAILED
                raise
            self.cipher = TunnelCipher.for_worker(derive_tunnel_keys(shared, transcript, aead), aead)
            self.aead = aead
        elif self._require:
            raise self._fail("accept: the hub did not encrypt this session and this worker requires it "
                             "(--e2e require); the hub runs with --e2e off?", CloseCode.E2E_MISMATCH)
        self.encrypted = msg.encrypted
        self.channels = channels
        if self._capacity:
            try:  # advice inside the worker's own candidates, at most its capacity
                suggested = slices_from_proto(msg.suggested_slices)
            except ValueError as exc:
                raise self._fail(f"accept: suggested_slices: {exc}", CloseCode.POLICY_VIOLATION) from None
            self.suggested = {layer: tuple(es) for layer, es in suggested.items()}
        self._step("receive_accept")
        return msg.session_id
