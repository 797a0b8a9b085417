"""The end-to-end channel between hub and worker, without I/O.

The session handshake (``_handshake``) carries one ephemeral X25519 public key each way and
ends with an accept the hub signs over the transcript; from that exchange both sides derive
two keys here and, when the accept says ``encrypted``, seal every tunnel message with the
accept's AEAD, ChaCha20-Poly1305 unless both chose AES-256-GCM (the ``cryptography``
package does all the cryptography):

    shared  = X25519(own ephemeral private key, peer's ephemeral public key)
    keys    = HKDF-SHA256(ikm = shared, salt = transcript hash, info, 64 bytes)
              info = TUNNEL_KEYS_INFO (ChaCha20-Poly1305), or TUNNEL_KEYS_INFO + " aes-256-gcm"
              hub -> worker key = keys[:32], worker -> hub key = keys[32:]
    sealed  = AEAD(key, nonce = message counter as 12 bytes big-endian,
                   plaintext = kind byte + payload, no associated data)

ChaCha20-Poly1305 is the default every side supports, quick without AES instructions (a
phone's CPU). With them AES-256-GCM seals several times faster (0.13 against 0.49 ns a byte
on the x86 machines we measure on), so a worker offers it where it measures faster
(``preferred_aeads``).

Each direction counts its own messages from 0, so a message replayed, reordered, dropped or
sent back the other way fails its tag. Besides data and control, a sealed message may be a
heartbeat (an 8-byte sequence number) or its ack (the same number): the session's liveness
check, which a relay cannot answer for a peer that is gone (``HeartbeatMonitor``). A relay between the two (the gateway, a CDN edge)
sees only the WebSocket framing and the sizes. docs/PROTOCOL.md ("End-to-end channel") is
the normative text; tests/vectors/channel.json pins the bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import struct
import time

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from kvasir_rpc._errors import CloseCode, LocalProtocolError, RemoteProtocolError
from kvasir_rpc.protocol import (
    HEARTBEAT_SEQ_BYTES,
    KX_PUBLIC_BYTES,
    SEAL_OVERHEAD,
    SEALED_CONTROL,
    SEALED_DATA,
    SEALED_HEARTBEAT,
    SEALED_HEARTBEAT_ACK,
    AEAD_AES_256_GCM,
    AEAD_CHACHA20_POLY1305,
    AEAD_NAMES,
    TUNNEL_KEYS_INFO,
)

__all__ = ["Heartbeat", "HeartbeatAck", "HeartbeatMonitor", "KeyExchange", "TunnelCipher", "derive_tunnel_keys",
           "preferred_aeads", "transcript_hash"]

_NONCE_BYTES = 12
_MAX_COUNTER = (1 << 64) - 1  # far beyond any session; past it a key would repeat a nonce
_MAX_SEQ = (1 << (8 * HEARTBEAT_SEQ_BYTES)) - 1


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """A sealed liveness probe from the peer (or to it): answer at once with HeartbeatAck(seq)."""

    seq: int


@dataclasses.dataclass(frozen=True)
class HeartbeatAck:
    """The answer to the Heartbeat numbered ``seq``."""

    seq: int


def transcript_hash(challenge: bytes, hello: bytes) -> bytes:
    """sha256 over the challenge and the hello exactly as sent, each prefixed with its length
    (4 bytes, big-endian): what the hub's accept signature and the key schedule are bound to."""
    h = hashlib.sha256()
    for part in (challenge, hello):
        h.update(struct.pack(">I", len(part)))
        h.update(part)
    return h.digest()


class KeyExchange:
    """One side's ephemeral X25519 key pair (fresh per connection unless ``private`` is given,
    as the test vectors do)."""

    def __init__(self, private: bytes | None = None) -> None:
        self._key = X25519PrivateKey.from_private_bytes(private) if private is not None else X25519PrivateKey.generate()
        self.public = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def shared_secret(self, peer_public: bytes) -> bytes:
        """X25519 with the peer's public key. Raises RemoteProtocolError (1008) for a key that
        is not 32 bytes or that gives the all-zero secret (a low-order point: whoever sent it
        would know the keys)."""
        if len(peer_public) != KX_PUBLIC_BYTES:
            raise RemoteProtocolError(f"key exchange: the peer's public key must be {KX_PUBLIC_BYTES} bytes, "
                                      f"got {len(peer_public)}", close_code=CloseCode.POLICY_VIOLATION)
        try:
            shared = self._key.exchange(X25519PublicKey.from_public_bytes(peer_public))
        except ValueError:
            shared = bytes(32)
        if shared == bytes(32):
            raise RemoteProtocolError("key exchange: the peer's public key gives an all-zero shared secret "
                                      "(a low-order point); refusing it", close_code=CloseCode.POLICY_VIOLATION)
        return shared


_AEADS: dict[int, type[ChaCha20Poly1305] | type[AESGCM]] = {AEAD_CHACHA20_POLY1305: ChaCha20Poly1305,
                                                       AEAD_AES_256_GCM: AESGCM}


def derive_tunnel_keys(shared: bytes, transcript: bytes, aead: int = AEAD_CHACHA20_POLY1305) -> tuple[bytes, bytes]:
    """(hub -> worker key, worker -> hub key) from the X25519 secret and the transcript hash,
    for the tunnel's ``aead`` (each AEAD gets keys of its own)."""
    info = TUNNEL_KEYS_INFO if aead == AEAD_CHACHA20_POLY1305 else TUNNEL_KEYS_INFO + b" " + AEAD_NAMES[aead].encode()
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=transcript, info=info).derive(shared)
    return okm[:32], okm[32:]


@functools.cache
def preferred_aeads() -> tuple[int, ...]:
    """The AEADs a worker offers besides the default: AES-256-GCM when it seals faster than
    ChaCha20-Poly1305 on this machine (measured once, a few milliseconds: 256 KiB each, best
    of three), else none."""
    data = bytes(256 << 10)
    nonce = bytes(12)
    best: dict[int, float] = {}
    for aead, cls in _AEADS.items():
        sealer = cls(bytes(32))
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            sealer.encrypt(nonce, data, None)
            times.append(time.perf_counter() - t0)
        best[aead] = min(times)
    return (AEAD_AES_256_GCM,) if best[AEAD_AES_256_GCM] < best[AEAD_CHACHA20_POLY1305] else ()


class TunnelCipher:
    """Seals what one side sends and opens what it receives, each direction with its own key
    and message counter, with the session's ``aead`` (a TunnelAead wire value). ``for_hub`` /
    ``for_worker`` pick the directions.

    ``seal`` takes what the tunnel would have sent in clear (bytes of data, or a control word)
    and returns one binary message; ``open`` takes one received message and returns what the
    peer sealed. Messages must be sealed in the order they are sent and opened in the order
    they arrive. A text message, a failed tag (a flipped bit, a replayed, reordered, dropped or
    truncated message, the wrong key) or an unknown kind raises RemoteProtocolError with 1008;
    after one failure every later ``open`` fails too (the session is over)."""

    def __init__(self, send_key: bytes, receive_key: bytes, *, peer: str, aead: int = AEAD_CHACHA20_POLY1305) -> None:
        cls = _AEADS[aead]
        self.aead = aead
        self._send = cls(send_key)
        self._receive = cls(receive_key)
        # Who sent what ``open`` opens ("worker" in the hub's cipher): error messages name it.
        self.peer = peer
        self.sent = 0
        self.received = 0
        self._broken = False

    @classmethod
    def for_hub(cls, keys: tuple[bytes, bytes], aead: int = AEAD_CHACHA20_POLY1305) -> TunnelCipher:
        return cls(keys[0], keys[1], peer="worker", aead=aead)

    @classmethod
    def for_worker(cls, keys: tuple[bytes, bytes], aead: int = AEAD_CHACHA20_POLY1305) -> TunnelCipher:
        return cls(keys[1], keys[0], peer="hub", aead=aead)

    @staticmethod
    def _nonce(counter: int) -> bytes:
        return counter.to_bytes(_NONCE_BYTES, "big")

    def seal(self, message: bytes | bytearray | memoryview | str | tuple[bytes | bytearray | memoryview, ...]
             | Heartbeat | HeartbeatAck) -> bytes:
        """One sealed binary message for ``message`` (data bytes or a view of them, or a tuple
        of such pieces, sealed as their concatenation; a control word, a heartbeat or a
        heartbeat ack); ``message`` is only read."""
        if self.sent >= _MAX_COUNTER:
            raise LocalProtocolError("the tunnel's message counter is exhausted: reconnect for fresh keys")
        if isinstance(message, str):
            plain = bytes([SEALED_CONTROL]) + message.encode()
        elif isinstance(message, (Heartbeat, HeartbeatAck)):
            if not 0 <= message.seq <= _MAX_SEQ:
                raise LocalProtocolError(f"a heartbeat sequence number is {HEARTBEAT_SEQ_BYTES} bytes, "
                                         f"not {message.seq}")
            kind = SEALED_HEARTBEAT if isinstance(message, Heartbeat) else SEALED_HEARTBEAT_ACK
            plain = bytes([kind]) + message.seq.to_bytes(HEARTBEAT_SEQ_BYTES, "big")
        else:
            pieces = message if isinstance(message, tuple) else (message,)
            plain = b"".join((bytes([SEALED_DATA]), *pieces))  # the one copy of the payload before the cipher's
        sealed = self._send.encrypt(self._nonce(self.sent), plain, None)
        self.sent += 1
        return sealed

    def _fail(self, why: str) -> RemoteProtocolError:
        self._broken = True
        return RemoteProtocolError(why, close_code=CloseCode.POLICY_VIOLATION)

    def open(self, message: bytes | bytearray | memoryview | str) -> memoryview | str | Heartbeat | HeartbeatAck:
        """What the peer sealed in ``message``: data (a read-only view of the opened bytes,
        not a copy), a control word (str), a Heartbeat or a HeartbeatAck (whose payload must
        be exactly the sequence number). ``message`` is only read."""
        if self._broken:
            raise self._fail("the end-to-end channel already failed; nothing more is accepted")
        if isinstance(message, str):
            raise self._fail(f"a text message on an encrypted tunnel: the {self.peer} or a relay sent clear text")
        if len(message) < SEAL_OVERHEAD:
            raise self._fail(f"a sealed message of {len(message)} bytes is shorter than its "
                             f"{SEAL_OVERHEAD} bytes of overhead (truncated on the way)")
        try:
            plain = self._receive.decrypt(self._nonce(self.received), message, None)
        except InvalidTag:
            raise self._fail(f"message {self.received} from the {self.peer} failed its authentication tag: "
                             "altered, replayed, reordered or dropped on the way") from None
        self.received += 1
        kind, payload = plain[0], memoryview(plain)[1:]  # a view: no copy of the payload
        if kind == SEALED_DATA:
            return payload
        if kind == SEALED_CONTROL:
            try:
                word = bytes(payload).decode()
            except UnicodeDecodeError:
                raise self._fail("a sealed control message is not UTF-8") from None
            return word  # an unknown word is the tunnel state machine's to refuse (1002)
        if kind in (SEALED_HEARTBEAT, SEALED_HEARTBEAT_ACK):
            name = "heartbeat" if kind == SEALED_HEARTBEAT else "heartbeat ack"
            if len(payload) != HEARTBEAT_SEQ_BYTES:
                raise self._fail(f"a sealed {name} carries {len(payload)} bytes, not its "
                                 f"{HEARTBEAT_SEQ_BYTES}-byte sequence number")
            seq = int.from_bytes(payload, "big")
            return Heartbeat(seq) if kind == SEALED_HEARTBEAT else HeartbeatAck(seq)
        raise self._fail(f"a sealed message of unknown kind {kind} (0: data, 1: control, 2: heartbeat, "
                         "3: heartbeat ack)")


class HeartbeatMonitor:
    """The sending side of the sealed heartbeat, without I/O or clock: numbers the heartbeats
    (0, 1, 2, ...) and checks each ack against the one heartbeat waiting for it.

    ``beat`` gives the next Heartbeat to seal and send; ``receive_ack`` takes a HeartbeatAck
    opened from the peer. At most one heartbeat waits at a time (the caller sends the next
    only once this one is answered, or ends the session when the answer is late: the
    deadline is the caller's). An ack when none is waiting, or for another number, raises
    RemoteProtocolError (1008): an honest peer only echoes what it was sent."""

    def __init__(self, *, peer: str = "worker") -> None:
        self.peer = peer
        self.sent = 0  # heartbeats sent so far; the next one's number
        self.answered = 0
        self.waiting: int | None = None  # the number of the heartbeat sent and not yet answered

    def beat(self) -> Heartbeat:
        """The next heartbeat. Raises LocalProtocolError while the last one is unanswered."""
        if self.waiting is not None:
            raise LocalProtocolError(f"heartbeat {self.waiting} is still waiting for its answer")
        beat = Heartbeat(self.sent)
        self.waiting = self.sent
        self.sent += 1
        return beat

    def receive_ack(self, ack: HeartbeatAck) -> None:
        """Take the peer's ack; raises RemoteProtocolError (1008) unless it answers the
        heartbeat that is waiting."""
        if self.waiting is None:
            raise RemoteProtocolError(f"the {self.peer} acknowledged heartbeat {ack.seq}, but no heartbeat "
                                      "is waiting for an answer", close_code=CloseCode.POLICY_VIOLATION)
        if ack.seq != self.waiting:
            raise RemoteProtocolError(f"the {self.peer} acknowledged heartbeat {ack.seq}, but heartbeat "
                                      f"{self.waiting} is the one waiting", close_code=CloseCode.POLICY_VIOLATION)
        self.waiting = None
        self.answered += 1
