"""The gate in front of a session's gRPC target, sans I/O (after h11/wsproto): only a
connection whose first request carries the session's target key reaches the worker.

A gRPC client sends the HTTP/2 preface, its SETTINGS (often a WINDOW_UPDATE), and waits for
the server's SETTINGS before its first request. The hub answers at once with an empty
SETTINGS frame (``server_preface()``), the client acknowledges it and sends the HEADERS of
its first call, whose HPACK block carries the call metadata. The gate reads frames up to and
including that first header block (and the client's acknowledgement of our SETTINGS), checks
``kvasir-target-key``, and gives a verdict:

* ``Admitted(forward)``: splice the connection; send ``forward`` to the worker first. It is
  every byte received, in order, except the client's first SETTINGS ACK, which answered the
  hub's SETTINGS, not the worker's (the worker sends its own SETTINGS, which the client
  acknowledges through the splice).
* ``Refused(reason, reply)``: send ``reply`` (a trailers-only PERMISSION_DENIED answer to the
  request), let the caller hang up, then close, so the caller reads why. No GOAWAY: a client
  that reads one together with the answer may fail its call as UNAVAILABLE instead.

Malformed input, or more than ``max_bytes`` before a verdict, raises RemoteProtocolError.
The gate never looks past the verdict: the worker's gRPC server validates the rest.
"""

from __future__ import annotations

import dataclasses
import enum

import hpack

from kvasir_rpc import TARGET_KEY_METADATA, LocalProtocolError, RemoteProtocolError, target_key_matches

__all__ = ["Admitted", "PREFACE", "Refused", "TargetGate", "Verdict"]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HEADER_BYTES = 9
# We send no SETTINGS values, so the client must keep to the defaults (RFC 9113 6.5.2).
_MAX_FRAME_SIZE = 16_384
DEFAULT_MAX_BYTES = 64 << 10

_HEADERS, _SETTINGS, _PUSH_PROMISE, _GOAWAY, _CONTINUATION = 0x1, 0x4, 0x5, 0x7, 0x9
_FLAG_ACK = 0x1
_FLAG_END_STREAM = 0x1
_FLAG_END_HEADERS = 0x4
_FLAG_PADDED = 0x8
_FLAG_PRIORITY = 0x20
_GRPC_PERMISSION_DENIED = 7
_GRPC_RESOURCE_EXHAUSTED = 8


@dataclasses.dataclass(frozen=True)
class Admitted:
    """The first request carries the session's key. ``forward``: the bytes to send the worker
    before splicing (everything received so far minus the client's first SETTINGS ACK)."""

    forward: bytes


@dataclasses.dataclass(frozen=True)
class Refused:
    """The first request does not carry the session's key. ``reply``: bytes to send the client
    before closing (a PERMISSION_DENIED answer naming ``reason``)."""

    reason: str
    reply: bytes


Verdict = Admitted | Refused


class _State(enum.Enum):
    PREFACE = "preface"  # waiting for the 24-byte client preface
    SETTINGS = "settings"  # the client's first frame must be SETTINGS
    OPEN = "open"  # frames before the first header block
    HEADER_BLOCK = "header block"  # inside HEADERS + CONTINUATION
    AWAIT_ACK = "awaiting settings ack"  # the key matched; the client has not yet acknowledged our SETTINGS
    DONE = "done"


class _Kind(enum.Enum):
    SETTINGS = "SETTINGS"
    SETTINGS_ACK = "SETTINGS ACK"
    HEADERS = "HEADERS"  # without END_HEADERS: CONTINUATION follows
    HEADERS_END = "HEADERS with END_HEADERS"
    CONTINUATION = "CONTINUATION"
    CONTINUATION_END = "CONTINUATION with END_HEADERS"
    OTHER = "other frame"


# Rule: the only legal (state, frame) pairs and the state each leads to. Anything else is
# the client's protocol error, named with the frame and the state. A completed header block
# goes to _State.DONE or AWAIT_ACK by its verdict (see _header_block_done).
_TRANSITIONS: dict[tuple[_State, _Kind], _State] = {
    (_State.SETTINGS, _Kind.SETTINGS): _State.OPEN,
    (_State.OPEN, _Kind.SETTINGS): _State.OPEN,
    (_State.OPEN, _Kind.SETTINGS_ACK): _State.OPEN,
    (_State.OPEN, _Kind.OTHER): _State.OPEN,
    (_State.OPEN, _Kind.HEADERS): _State.HEADER_BLOCK,
    (_State.OPEN, _Kind.HEADERS_END): _State.DONE,
    (_State.HEADER_BLOCK, _Kind.CONTINUATION): _State.HEADER_BLOCK,
    (_State.HEADER_BLOCK, _Kind.CONTINUATION_END): _State.DONE,
    # After the first request the gate only looks for the client's SETTINGS ACK.
    (_State.AWAIT_ACK, _Kind.SETTINGS): _State.AWAIT_ACK,
    (_State.AWAIT_ACK, _Kind.SETTINGS_ACK): _State.DONE,
    (_State.AWAIT_ACK, _Kind.OTHER): _State.AWAIT_ACK,
    (_State.AWAIT_ACK, _Kind.HEADERS): _State.AWAIT_ACK,
    (_State.AWAIT_ACK, _Kind.HEADERS_END): _State.AWAIT_ACK,
    (_State.AWAIT_ACK, _Kind.CONTINUATION): _State.AWAIT_ACK,
    (_State.AWAIT_ACK, _Kind.CONTINUATION_END): _State.AWAIT_ACK,
}


def _frame(ftype: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([ftype, flags]) + stream_id.to_bytes(4, "big") + payload


class TargetGate:
    """Decides whether one client connection to a session's target may reach the worker.

    ``token`` and ``session_id`` define the key (``kvasir_rpc.target_key``).
    Send ``server_preface()`` at once; feed ``receive_data`` until it returns a verdict.
    """

    def __init__(self, token: str, session_id: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._token = token
        self._session_id = session_id
        self.max_bytes = max_bytes
        self._state = _State.PREFACE
        self._buf = bytearray()  # received, not yet parsed
        self._forward: list[bytes] = []  # parsed frames to forward, in order
        self._received = 0  # bytes parsed so far (the bound)
        self._acked = False  # the client's first SETTINGS ACK seen (and dropped)
        self._block = bytearray()  # the first header block's fragments
        self._block_stream = 0
        self.verdict: Verdict | None = None

    @property
    def state(self) -> str:
        return self._state.value

    def server_preface(self) -> bytes:
        """The hub's side of the connection preface: an empty SETTINGS frame."""
        return _frame(_SETTINGS, 0, 0, b"")

    def receive_data(self, data: bytes) -> Verdict | None:
        """Feed bytes from the client; the verdict once there is one, else None (feed more).

        Raises RemoteProtocolError on malformed HTTP/2, a first request that cannot be
        decoded, or more than ``max_bytes`` without a verdict; LocalProtocolError when fed
        after the verdict (the caller splices or closes then)."""
        if self._state is _State.DONE:
            raise LocalProtocolError(f"target gate: bytes fed in state {self._state.value!r}")
        self._buf += data
        if self._state is _State.PREFACE:
            n = min(len(self._buf), len(PREFACE))
            if self._buf[:n] != PREFACE[:n]:
                raise RemoteProtocolError("target gate: not an HTTP/2 client preface (a gRPC client is expected)")
            if n < len(PREFACE):
                return None
            self._forward.append(bytes(self._buf[:n]))
            self._received += n
            del self._buf[:n]
            self._state = _State.SETTINGS
        while self._state is not _State.DONE and len(self._buf) >= _HEADER_BYTES:
            length = int.from_bytes(self._buf[:3], "big")
            if length > _MAX_FRAME_SIZE:
                raise RemoteProtocolError(f"target gate: a {length}-byte frame exceeds the default maximum "
                                          f"{_MAX_FRAME_SIZE}")
            if len(self._buf) < _HEADER_BYTES + length:
                break
            self._check_bound(_HEADER_BYTES + length)
            frame = bytes(self._buf[:_HEADER_BYTES + length])
            del self._buf[:_HEADER_BYTES + length]
            self._received += len(frame)
            self._on_frame(frame)
        if self._state is not _State.DONE:
            self._check_bound(len(self._buf))
            return None
        if self.verdict is None:  # the key matched and the client acknowledged our SETTINGS
            self.verdict = Admitted(b"".join(self._forward) + bytes(self._buf))
        self._forward.clear()
        self._buf.clear()
        return self.verdict

    def _check_bound(self, more: int) -> None:
        if self._received + more > self.max_bytes:
            raise RemoteProtocolError(f"target gate: more than {self.max_bytes} bytes before the first request "
                                      f"(state {self._state.value!r})")

    def _on_frame(self, frame: bytes) -> None:
        ftype, flags = frame[3], frame[4]
        stream_id = int.from_bytes(frame[5:9], "big") & 0x7FFF_FFFF
        payload = frame[_HEADER_BYTES:]
        kind = self._kind(ftype, flags, stream_id, payload)
        after = _TRANSITIONS.get((self._state, kind))
        if after is None:
            raise RemoteProtocolError(f"target gate: client sent {kind.value} (type {ftype:#x}) in state "
                                      f"{self._state.value!r}")
        if kind is _Kind.SETTINGS_ACK and not self._acked:
            self._acked = True  # it answers the hub's SETTINGS: the worker must not see it
        else:
            self._forward.append(frame)
        if self._state is _State.AWAIT_ACK:
            self._state = after
            return
        if kind is _Kind.HEADERS or kind is _Kind.HEADERS_END:
            self._block_stream = stream_id
            self._block += self._headers_fragment(flags, payload)
        elif kind is _Kind.CONTINUATION or kind is _Kind.CONTINUATION_END:
            if stream_id != self._block_stream:
                raise RemoteProtocolError(f"target gate: CONTINUATION on stream {stream_id} inside the header "
                                          f"block of stream {self._block_stream}")
            self._block += payload
        self._state = after
        if after is _State.DONE:
            self._header_block_done()

    @staticmethod
    def _kind(ftype: int, flags: int, stream_id: int, payload: bytes) -> _Kind:
        if ftype == _SETTINGS:
            if stream_id != 0:
                raise RemoteProtocolError("target gate: SETTINGS on a stream other than 0")
            if flags & _FLAG_ACK:
                if payload:
                    raise RemoteProtocolError("target gate: a SETTINGS ACK with a payload")
                return _Kind.SETTINGS_ACK
            if len(payload) % 6:
                raise RemoteProtocolError("target gate: a SETTINGS payload is a multiple of 6 bytes")
            return _Kind.SETTINGS
        if ftype == _HEADERS:
            if stream_id == 0 or stream_id % 2 == 0:
                raise RemoteProtocolError(f"target gate: HEADERS on stream {stream_id} (a client opens odd streams)")
            return _Kind.HEADERS_END if flags & _FLAG_END_HEADERS else _Kind.HEADERS
        if ftype == _CONTINUATION:
            return _Kind.CONTINUATION_END if flags & _FLAG_END_HEADERS else _Kind.CONTINUATION
        if ftype == _PUSH_PROMISE:
            raise RemoteProtocolError("target gate: a client cannot send PUSH_PROMISE")
        return _Kind.OTHER

    @staticmethod
    def _headers_fragment(flags: int, payload: bytes) -> bytes:
        """The header block fragment of a HEADERS payload (RFC 9113 6.2)."""
        start, pad = 0, 0
        if flags & _FLAG_PADDED:
            if not payload:
                raise RemoteProtocolError("target gate: PADDED HEADERS without a pad length")
            pad, start = payload[0], 1
        if flags & _FLAG_PRIORITY:
            start += 5
        if start + pad > len(payload):
            raise RemoteProtocolError("target gate: HEADERS padding or priority longer than the frame")
        return payload[start:len(payload) - pad]

    def _header_block_done(self) -> None:
        try:
            decoder = hpack.Decoder()
            decoder.max_header_list_size = self.max_bytes
            headers = decoder.decode(bytes(self._block), raw=True)
        except hpack.HPACKError as exc:
            raise RemoteProtocolError(f"target gate: the first request's headers do not decode: {exc}") from None
        key = TARGET_KEY_METADATA.encode()
        presented = [bytes(v) for k, v in headers if bytes(k) == key]
        if not presented:
            reason = f"no {TARGET_KEY_METADATA} in the first request: only the hub's backbone may use this target"
        elif len(presented) > 1:
            reason = f"{len(presented)} {TARGET_KEY_METADATA} values in the first request"
        elif not target_key_matches(self._token, self._session_id, presented[0]):
            reason = f"wrong {TARGET_KEY_METADATA} for this session (is the backbone using the hub's token file?)"
        else:
            reason = ""
        if reason:
            self.verdict = Refused(reason, self._refusal(reason))
        elif not self._acked:
            self._state = _State.AWAIT_ACK

    def busy(self, reason: str) -> bytes:
        """For an admitted connection the hub cannot splice (every channel of the worker's
        tunnel carries another backbone's): a trailers-only RESOURCE_EXHAUSTED answer naming
        ``reason`` on its first request, so the caller's log says why it got no worker time."""
        if not isinstance(self.verdict, Admitted):
            raise LocalProtocolError("target gate: busy() answers an admitted connection")
        return self._refusal(reason, _GRPC_RESOURCE_EXHAUSTED)

    def _refusal(self, reason: str, status: int = _GRPC_PERMISSION_DENIED) -> bytes:
        """A trailers-only gRPC answer (``status``, PERMISSION_DENIED unless said, ``reason``)
        on the request's stream: the caller's error says why, not just that the line dropped."""
        block = hpack.Encoder().encode([
            (":status", "200"),
            ("content-type", "application/grpc"),
            ("grpc-status", str(status)),
            ("grpc-message", _percent_encode(reason)),
        ])
        return _frame(_HEADERS, _FLAG_END_HEADERS | _FLAG_END_STREAM, self._block_stream, block)


def _percent_encode(text: str) -> str:
    """grpc-message encoding: printable ASCII but '%' as is, every other UTF-8 byte as %XX."""
    return "".join(chr(b) if 0x20 <= b <= 0x7E and b != 0x25 else f"%{b:02X}" for b in text.encode())
