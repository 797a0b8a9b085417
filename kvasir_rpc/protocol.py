"""The wire between hub, gateway and worker, without I/O (in the manner of h11 and wsproto).

Every wire constant lives here once, with the two protocols that run over WebSockets after
the session handshake (``_handshake``):

* the tunnel control: which backbone connection the HTTP/2 bytes of a tunnel belong to
  (``HubTunnel`` and ``WorkerTunnel``);
* the gateway pairing: how the public gateway tells a hub that a worker is waiting
  (``encode_pair`` / ``decode_pair``).

Each side is a plain object: its methods return what to send, and ``receive`` turns a
message from the peer into an event. A message the peer may not send in the current state
raises ``RemoteProtocolError`` carrying the WebSocket close code to answer with; calling a
method in the wrong state raises ``LocalProtocolError``. The trio code in the hub, the
worker and the gateway only moves bytes around these objects.

docs/PROTOCOL.md is the normative description; tests/vectors/tunnel_control.json pins the
sequences. This module imports no protobuf, gRPC or torch module.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from collections.abc import Sequence

from kvasir_rpc._errors import CloseCode, LocalProtocolError, RemoteProtocolError

__all__ = [
    "ACCEPT_AEAD_SIGNATURE_DOMAIN",
    "ACCEPT_CHANNELS_SIGNATURE_DOMAIN",
    "CHANNEL_PREFIX_BYTES",
    "MAX_TUNNEL_CHANNELS",
    "MuxHubTunnel",
    "MuxWorkerTunnel",
    "kept",
    "ACCEPT_SIGNATURE_DOMAIN",
    "AEAD_AES_256_GCM",
    "AEAD_CHACHA20_POLY1305",
    "AEAD_NAMES",
    "CLOSE_TIMEOUT_S",
    "CONTROL_WORDS",
    "GATEWAY_SUBPROTOCOL",
    "HEALTH_PATH",
    "HELLO_SIGNATURE_DOMAIN",
    "MAX_CHALLENGE_AGE_MS",
    "MAX_EXPERTS_PER_LAYER",
    "MAX_AEADS_OFFERED",
    "MAX_HELLO_BYTES",
    "MAX_LAYERS",
    "MAX_SESSION_ID_CHARS",
    "NONCE_BYTES",
    "TARGET_KEY_DOMAIN",
    "TARGET_KEY_METADATA",
    "WEIGHTS_DIGEST_DOMAIN",
    "E2E_HUB_MODES",
    "E2E_WORKER_MODES",
    "HUB_CONTROL_PATH",
    "HUB_DATA_PREFIX",
    "HEARTBEAT_SEQ_BYTES",
    "HUB_HANDSHAKE_TIMEOUT_S",
    "KEEPALIVE_S",
    "KEEPALIVE_TIMEOUT_S",
    "KX_PUBLIC_BYTES",
    "MAX_MESSAGE_BYTES",
    "PAIRING_VERSION",
    "PING",
    "READ_BYTES",
    "SEALED_CONTROL",
    "SEALED_DATA",
    "SEALED_HEARTBEAT",
    "SEALED_HEARTBEAT_ACK",
    "SEAL_OVERHEAD",
    "TUNNEL_KEYS_INFO",
    "TUNNEL_SUBPROTOCOL",
    "TUNNEL_SUBPROTOCOLS",
    "WORKER_HANDSHAKE_TIMEOUT_S",
    "WORKER_PATH",
    "Close",
    "CloseCode",
    "Closed",
    "Control",
    "Data",
    "Discarded",
    "Eof",
    "Event",
    "HubTunnel",
    "LocalProtocolError",
    "Open",
    "PairRequest",
    "RemoteProtocolError",
    "TunnelState",
    "WorkerTunnel",
    "choose_subprotocol",
    "decode_pair",
    "encode_pair",
]

# --- Subprotocols and paths -------------------------------------------------------------

TUNNEL_SUBPROTOCOL = "kvasir.tunnel.v1"
# Every tunnel version this implementation speaks, newest first. A later version is a new
# subprotocol name: a worker offers all it speaks, the hub picks its newest one offered.
TUNNEL_SUBPROTOCOLS: tuple[str, ...] = (TUNNEL_SUBPROTOCOL,)
GATEWAY_SUBPROTOCOL = "kvasir.gateway.v1"

WORKER_PATH = "/v1/worker"  # gateway: workers dial here
HUB_CONTROL_PATH = "/v1/hub/control"  # gateway: the hub's control WebSocket (bearer token)
HUB_DATA_PREFIX = "/v1/hub/data/"  # gateway: the hub dials this + pair id for each worker
HEALTH_PATH = "/healthz"

# --- Limits and timers --------------------------------------------------------------------

# The largest WebSocket message either side accepts (larger: close 1009).
MAX_MESSAGE_BYTES = 4 << 20
# A tunnel data message carries at most this many bytes (reads of about 1 MiB beat small
# reads for bulk, see PERF_NOTES).
READ_BYTES = 1 << 20
# Both ends check the peer this often (a sealed heartbeat on an encrypted session, else a
# WebSocket ping); no answer within the timeout: the peer is gone (close 1001).
KEEPALIVE_S = 15.0
KEEPALIVE_TIMEOUT_S = 10.0
# The hub gives a worker this long from the upgrade to a verified hello (then close 4200).
HUB_HANDSHAKE_TIMEOUT_S = 10.0
# The worker gives the hub this long to connect, challenge and accept (then close 4200).
WORKER_HANDSHAKE_TIMEOUT_S = 15.0
# A worker must answer "close" with "closed" within this (else the hub closes 1008).
CLOSE_TIMEOUT_S = 10.0


# --- The session handshake (kvasir_rpc._handshake runs it) ------------------------------------

# The worker signs HELLO_SIGNATURE_DOMAIN + HelloBody bytes with its wallet (Ed25519).
HELLO_SIGNATURE_DOMAIN = b"kvasir.v1.SessionHello\x00"
NONCE_BYTES = 32
# A hello answering a challenge older than this is stale (close 4201).
MAX_CHALLENGE_AGE_MS = 30_000
# Bounds on what a stranger may claim, so a hello cannot make the hub allocate without limit.
MAX_HELLO_BYTES = 4 << 20
MAX_LAYERS = 4096
MAX_EXPERTS_PER_LAYER = 65536
MAX_SESSION_ID_CHARS = 128

# --- The end-to-end channel (kvasir_rpc._channel; docs/PROTOCOL.md "End-to-end channel") -----

# The hub signs ACCEPT_SIGNATURE_DOMAIN + transcript hash + session id + encrypted flag byte.
ACCEPT_SIGNATURE_DOMAIN = b"kvasir.v1.SessionAccept\x00"
# X25519 public keys, one fresh pair per connection on each side.
KX_PUBLIC_BYTES = 32
# HKDF-SHA256 info for the two tunnel keys (hub -> worker, then worker -> hub); for a tunnel
# sealed with another AEAD than the default, followed by a space and the AEAD's name.
TUNNEL_KEYS_INFO = b"kvasir.v1.tunnel keys"
# The AEADs that can seal a tunnel (TunnelAead in session.proto), by wire value: the default
# (0, which every side supports) and AES-256-GCM, which a worker offers where it seals faster.
AEAD_CHACHA20_POLY1305 = 0
AEAD_AES_256_GCM = 1
AEAD_NAMES = {AEAD_CHACHA20_POLY1305: "chacha20-poly1305", AEAD_AES_256_GCM: "aes-256-gcm"}
# A hello offers at most this many AEADs (more is refused, 4100).
MAX_AEADS_OFFERED = 16
# With another AEAD than the default the hub signs ACCEPT_AEAD_SIGNATURE_DOMAIN + transcript
# hash + AEAD byte + encrypted flag byte + session id.
ACCEPT_AEAD_SIGNATURE_DOMAIN = b"kvasir.v1.SessionAccept.aead\x00"
# A multiplexed tunnel (SessionAccept.tunnel_channels >= 2) has the hub sign
# ACCEPT_CHANNELS_SIGNATURE_DOMAIN + transcript hash + AEAD byte + encrypted flag byte +
# channels (2 bytes, big-endian) + session id.
ACCEPT_CHANNELS_SIGNATURE_DOMAIN = b"kvasir.v1.SessionAccept.channels\x00"
# A tunnel carries at most this many backbone connections at once (HelloBody.tunnel_channels).
MAX_TUNNEL_CHANNELS = 64
# A data message of a multiplexed tunnel starts with its channel, this many bytes big-endian.
CHANNEL_PREFIX_BYTES = 2
# The first plaintext byte of a sealed message: what the rest is.
SEALED_DATA = 0  # HTTP/2 bytes
SEALED_CONTROL = 1  # a control word in UTF-8 ("open", "eof", "close", "closed")
# End-to-end liveness: a heartbeat carries a sequence number (HEARTBEAT_SEQ_BYTES, big-endian)
# that the peer echoes at once in a heartbeat ack. Outside the tunnel control state machine:
# valid in every tunnel state, either way. A relay cannot answer one (it has no key).
SEALED_HEARTBEAT = 2
SEALED_HEARTBEAT_ACK = 3
HEARTBEAT_SEQ_BYTES = 8
# A sealed message is this much longer than its payload: the kind byte and the 16-byte tag.
SEAL_OVERHEAD = 1 + 16
# The hub's --e2e: "auto" encrypts sessions that come through a gateway, and direct ones whose
# worker requires it; "on" every session; "off" none (a worker that requires it is refused).
E2E_HUB_MODES = ("auto", "on", "off")
# The worker's --e2e: "require" refuses an unencrypted accept; "auto" takes what the hub chooses.
E2E_WORKER_MODES = ("auto", "require")

# --- Domains and metadata ---------------------------------------------------------------------

# The weights digest: sha256(WEIGHTS_DIGEST_DOMAIN + ...), see docs/PROTOCOL.md section 12.
WEIGHTS_DIGEST_DOMAIN = b"kvasir.v1.weights\x00"
# A session's target admits a connection whose first request carries this metadata:
# hex HMAC-SHA256(backbone token, TARGET_KEY_DOMAIN + session id).
TARGET_KEY_METADATA = "kvasir-target-key"
TARGET_KEY_DOMAIN = b"kvasir.v1.target\x00"


def choose_subprotocol(offered: Sequence[str], supported: Sequence[str] = TUNNEL_SUBPROTOCOLS) -> str | None:
    """The newest tunnel version both sides speak, or None (the hub then answers HTTP 400)."""
    for name in supported:
        if name in offered:
            return name
    return None


# --- Tunnel control -----------------------------------------------------------------------


class Control(str, enum.Enum):
    """The text messages of the tunnel. Any other text message is a protocol error."""

    OPEN = "open"  # hub -> worker: a backbone connection was admitted; dial your gRPC server
    EOF = "eof"  # worker -> hub: your gRPC server ended the connection
    CLOSE = "close"  # hub -> worker: the connection ended; drop your side
    CLOSED = "closed"  # worker -> hub: dropped; bytes after this belong to the next "open"


CONTROL_WORDS = frozenset(c.value for c in Control)


class TunnelState(enum.Enum):
    IDLE = "IDLE"  # no backbone connection
    OPEN = "OPEN"  # bytes flow both ways
    EOF = "EOF"  # the worker's gRPC server ended the connection ("eof" sent / received)
    CLOSING = "CLOSING"  # "close" sent / received, "closed" not yet


@dataclasses.dataclass(frozen=True)
class Open:
    """The hub opened a connection: dial the local gRPC server."""


@dataclasses.dataclass(frozen=True)
class Data:
    """HTTP/2 bytes of the current connection: bytes, or a read-only view of them (what an
    encrypted session opens), passed on without a copy."""

    data: bytes | memoryview


@dataclasses.dataclass(frozen=True)
class Eof:
    """The worker's gRPC server ended the connection: the hub closes it."""


@dataclasses.dataclass(frozen=True)
class Close:
    """The hub ended the connection: drop it, then send "closed"."""


@dataclasses.dataclass(frozen=True)
class Closed:
    """The worker dropped the connection: the tunnel is idle."""


@dataclasses.dataclass(frozen=True)
class Discarded:
    """Late bytes (or "eof") of a connection the hub already closed: dropped, not counted."""

    nbytes: int


Event = Open | Data | Eof | Close | Closed | Discarded

_S = TunnelState
_C = Control

# The one place the transitions live: (state, what happens) -> next state. "send X" is this
# side sending X; "recv X" is X arriving from the peer ("recv data" is a binary message).
HUB_TRANSITIONS: dict[tuple[TunnelState, str], TunnelState] = {
    (_S.IDLE, "send open"): _S.OPEN,
    (_S.OPEN, "send data"): _S.OPEN,
    (_S.OPEN, "recv data"): _S.OPEN,
    (_S.OPEN, "recv eof"): _S.EOF,
    (_S.OPEN, "send close"): _S.CLOSING,
    (_S.EOF, "send data"): _S.EOF,  # the backbone's, sent before the hub saw "eof"
    (_S.EOF, "send close"): _S.CLOSING,
    (_S.CLOSING, "recv data"): _S.CLOSING,  # discarded
    (_S.CLOSING, "recv eof"): _S.CLOSING,  # discarded
    (_S.CLOSING, "recv closed"): _S.IDLE,
}
WORKER_TRANSITIONS: dict[tuple[TunnelState, str], TunnelState] = {
    (_S.IDLE, "recv open"): _S.OPEN,
    (_S.OPEN, "recv data"): _S.OPEN,
    (_S.OPEN, "send data"): _S.OPEN,
    (_S.OPEN, "send eof"): _S.EOF,
    (_S.OPEN, "recv close"): _S.CLOSING,
    (_S.EOF, "recv data"): _S.EOF,  # sent before the hub saw "eof": dropped by the worker
    (_S.EOF, "recv close"): _S.CLOSING,
    (_S.CLOSING, "send data"): _S.CLOSING,  # in flight when "close" came: the hub discards it
    (_S.CLOSING, "send eof"): _S.CLOSING,
    (_S.CLOSING, "send closed"): _S.IDLE,
}


def kept(msg: bytes | bytearray | memoryview) -> bytes | memoryview:
    """Data as received (or about to be sent on): bytes and read-only views as they are,
    anything writable copied (its owner may reuse it)."""
    if isinstance(msg, bytes) or (isinstance(msg, memoryview) and msg.readonly):
        return msg
    return bytes(msg)


def _what(msg: bytes | memoryview | str) -> str:
    if isinstance(msg, (bytes, bytearray, memoryview)):
        return "data"
    if msg not in CONTROL_WORDS:
        raise RemoteProtocolError(f"unknown control message {msg[:32]!r}: the tunnel's text messages are "
                                  f"{', '.join(repr(c.value) for c in Control)}", close_code=CloseCode.PROTOCOL_ERROR)
    return msg


class _Side:
    _name = ""
    _table: dict[tuple[TunnelState, str], TunnelState] = {}

    def __init__(self) -> None:
        self.state = TunnelState.IDLE
        # Connections opened so far (the first is 1): what a log line can name.
        self.connections = 0

    def _send(self, what: str) -> None:
        nxt = self._table.get((self.state, f"send {what}"))
        if nxt is None:
            raise LocalProtocolError(f"{self._name} tunnel: can't send {what} in state {self.state.value}")
        self.state = nxt

    def send_data(self, data: bytes) -> bytes:
        """HTTP/2 bytes of the current connection, as one binary message."""
        if len(data) > READ_BYTES:
            raise LocalProtocolError(f"a tunnel message carries at most {READ_BYTES} bytes, not {len(data)}")
        self._send("data")
        return data

    def _receive(self, msg: bytes | memoryview | str) -> str:
        what = _what(msg)
        nxt = self._table.get((self.state, f"recv {what}"))
        if nxt is None:
            peer = "worker" if self._name == "hub" else "hub"
            shown = f"{len(msg)} bytes of data" if what == "data" else repr(what)
            raise RemoteProtocolError(f"the {peer} sent {shown} while the tunnel is {self.state.value}",
                                      close_code=CloseCode.PROTOCOL_ERROR)
        before, self.state = self.state, nxt
        return f"{before.value} {what}"


class HubTunnel(_Side):
    """The hub's side of one worker's tunnel."""

    _name = "hub"
    _table = HUB_TRANSITIONS

    def open(self) -> str:
        """A backbone connection was admitted: the message that opens it on the worker."""
        self._send("open")
        self.connections += 1
        return _C.OPEN.value

    def close(self) -> str:
        """The backbone's connection ended (or the worker said "eof")."""
        self._send("close")
        return _C.CLOSE.value

    def receive(self, msg: bytes | memoryview | str) -> Event:
        step = self._receive(msg)
        if step == "OPEN data":
            return Data(kept(msg))  # type: ignore[arg-type]
        if step == "OPEN eof":
            return Eof()
        if step == "CLOSING data":
            return Discarded(len(msg))
        if step == "CLOSING eof":
            return Discarded(0)
        return Closed()  # "CLOSING closed", the only other transition that receives


class WorkerTunnel(_Side):
    """The worker's side of its tunnel."""

    _name = "worker"
    _table = WORKER_TRANSITIONS

    def receive(self, msg: bytes | memoryview | str) -> Event:
        step = self._receive(msg)
        if step == "IDLE open":
            self.connections += 1
            return Open()
        if step.endswith(" close"):
            return Close()
        return Data(kept(msg))  # type: ignore[arg-type]

    def eof(self) -> str:
        """The local gRPC server ended the connection."""
        self._send("eof")
        return _C.EOF.value

    def closed(self) -> str:
        """The local connection is dropped: the hub may open the next one."""
        self._send("closed")
        return _C.CLOSED.value


# --- The multiplexed tunnel (docs/PROTOCOL.md "Multiplexed tunnel") --------------------------
#
# Negotiated in the handshake (HelloBody.tunnel_channels, SessionAccept.tunnel_channels): the
# tunnel then carries up to ``channels`` backbone connections at once, each on its channel
# 0..channels-1 with the plain tunnel's state machine of its own. A control message is the word,
# one space and the channel in decimal ("open 3"); a data message starts with its channel,
# CHANNEL_PREFIX_BYTES big-endian, then the HTTP/2 bytes.


def _mux_word(word: str, channel: int) -> str:
    return f"{word} {channel}"


class _Mux:
    _side: type[_Side] = _Side
    _peer = ""

    def __init__(self, channels: int) -> None:
        if not 2 <= channels <= MAX_TUNNEL_CHANNELS:
            raise ValueError(f"a multiplexed tunnel has 2 to {MAX_TUNNEL_CHANNELS} channels, not {channels}")
        self.channels = [self._side() for _ in range(channels)]

    def state(self, channel: int) -> TunnelState:
        return self.channels[channel].state

    def _channel(self, text: str) -> int:
        if not text.isascii() or not text.isdigit() or len(text) > 5 or (len(text) > 1 and text[0] == "0"):
            raise RemoteProtocolError(f"the {self._peer} named channel {text[:8]!r}: a channel is a decimal number",
                                      close_code=CloseCode.PROTOCOL_ERROR)
        channel = int(text)
        if channel >= len(self.channels):
            raise RemoteProtocolError(f"the {self._peer} named channel {channel} of a tunnel of {len(self.channels)}",
                                      close_code=CloseCode.PROTOCOL_ERROR)
        return channel

    def _split(self, msg: bytes | memoryview | str) -> tuple[int, bytes | memoryview | str]:
        """(channel, the message the channel's own state machine reads)."""
        if isinstance(msg, str):
            word, sep, number = msg.partition(" ")
            if not sep or word not in CONTROL_WORDS:
                raise RemoteProtocolError(f"unknown control message {msg[:32]!r}: a multiplexed tunnel's text "
                                          "messages are a word and a channel, e.g. 'open 0'",
                                          close_code=CloseCode.PROTOCOL_ERROR)
            return self._channel(number), word
        if len(msg) <= CHANNEL_PREFIX_BYTES:
            raise RemoteProtocolError(f"a data message of {len(msg)} bytes: it starts with its channel "
                                      f"({CHANNEL_PREFIX_BYTES} bytes) and carries at least one byte",
                                      close_code=CloseCode.PROTOCOL_ERROR)
        view = memoryview(msg) if not isinstance(msg, memoryview) else msg
        channel = int.from_bytes(view[:CHANNEL_PREFIX_BYTES], "big")
        if channel >= len(self.channels):
            raise RemoteProtocolError(f"the {self._peer} sent data on channel {channel} of a tunnel of "
                                      f"{len(self.channels)}", close_code=CloseCode.PROTOCOL_ERROR)
        # A view, not a copy: read-only over bytes (what the state machine keeps as it is).
        return channel, view[CHANNEL_PREFIX_BYTES:]

    def _receive_on(self, channel: int, inner: bytes | memoryview | str) -> Event:
        """``channel``'s own state machine reads ``inner``; a refusal names the channel."""
        try:
            return self.channels[channel].receive(inner)  # type: ignore[attr-defined, no-any-return]
        except RemoteProtocolError as exc:
            raise RemoteProtocolError(f"channel {channel}: {exc.reason}", close_code=exc.close_code) from None

    def send_data(self, channel: int, data: bytes | memoryview) -> bytes:
        """HTTP/2 bytes of ``channel``'s connection, as one binary message (a copy, prefixed)."""
        return b"".join(self.send_parts(channel, data))

    def send_parts(self, channel: int, data: bytes | memoryview) -> tuple[bytes, bytes | memoryview]:
        """``send_data`` as the message's two pieces, the channel's prefix and ``data`` (not
        copied), for a WebSocket that sends pieces as one message."""
        self.channels[channel].send_data(data)  # type: ignore[arg-type]
        return channel.to_bytes(CHANNEL_PREFIX_BYTES, "big"), data


class MuxHubTunnel(_Mux):
    """The hub's side of a multiplexed tunnel: ``HubTunnel`` per channel."""

    _side = HubTunnel
    _peer = "worker"

    def free(self) -> int | None:
        """An idle channel (the lowest), or None when every channel carries a connection."""
        return next((i for i, c in enumerate(self.channels) if c.state is TunnelState.IDLE), None)

    def open(self, channel: int) -> str:
        word = self.channels[channel].open()  # type: ignore[attr-defined]
        return _mux_word(word, channel)

    def close(self, channel: int) -> str:
        return _mux_word(self.channels[channel].close(), channel)  # type: ignore[attr-defined]

    def receive(self, msg: bytes | memoryview | str) -> tuple[int, Event]:
        channel, inner = self._split(msg)
        return channel, self._receive_on(channel, inner)


class MuxWorkerTunnel(_Mux):
    """The worker's side of a multiplexed tunnel: ``WorkerTunnel`` per channel."""

    _side = WorkerTunnel
    _peer = "hub"

    def receive(self, msg: bytes | memoryview | str) -> tuple[int, Event]:
        channel, inner = self._split(msg)
        return channel, self._receive_on(channel, inner)

    def eof(self, channel: int) -> str:
        return _mux_word(self.channels[channel].eof(), channel)  # type: ignore[attr-defined]

    def closed(self, channel: int) -> str:
        return _mux_word(self.channels[channel].closed(), channel)  # type: ignore[attr-defined]


# --- Gateway pairing ------------------------------------------------------------------------

PAIRING_VERSION = 1
# The only message a hub sends on its control WebSocket.
PING = "ping"
_PAIR_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")
MAX_REMOTE_CHARS = 64
MAX_PAIR_MESSAGE_CHARS = 1024


@dataclasses.dataclass(frozen=True)
class PairRequest:
    """The gateway to the hub: a worker waits under ``pair_id``; dial HUB_DATA_PREFIX + pair_id."""

    pair_id: str
    remote: str = ""

    def __post_init__(self) -> None:
        if not _PAIR_ID.fullmatch(self.pair_id):
            raise ValueError("a pair id is 8 to 64 characters of A-Z a-z 0-9 _ -")


def encode_pair(request: PairRequest) -> str:
    """The control message announcing a waiting worker: a JSON object."""
    return json.dumps({"v": PAIRING_VERSION, "pair": request.pair_id, "remote": request.remote[:MAX_REMOTE_CHARS]},
                      separators=(",", ":"))


def decode_pair(message: bytes | str) -> PairRequest:
    """Parse a pairing announcement. Unknown keys are ignored (later versions add keys); a
    malformed one raises RemoteProtocolError (1002)."""

    def bad(why: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"malformed pairing message: {why}", close_code=CloseCode.PROTOCOL_ERROR)

    if not isinstance(message, str):
        raise bad("pairing messages are text")
    if len(message) > MAX_PAIR_MESSAGE_CHARS:
        raise bad(f"{len(message)} characters, at most {MAX_PAIR_MESSAGE_CHARS}")
    try:
        obj = json.loads(message)
    except ValueError as exc:
        raise bad(f"not JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise bad("not a JSON object")
    version = obj.get("v", PAIRING_VERSION)  # the first gateways sent no version
    if not isinstance(version, int) or version < PAIRING_VERSION:
        raise bad(f"version {version!r}")
    pid, remote = obj.get("pair"), obj.get("remote", "")
    if not isinstance(pid, str) or not _PAIR_ID.fullmatch(pid):
        raise bad("'pair' must be 8 to 64 characters of A-Z a-z 0-9 _ -")
    if not isinstance(remote, str):
        raise bad("'remote' must be a string")
    return PairRequest(pid, remote[:MAX_REMOTE_CHARS])
