"""Malformed WebSocket upgrades and the answer each deserves, for the fast tests
(tests/test_intake.py) and the real processes (tests/test_gateway.py)."""

from __future__ import annotations

from kvasir_rpc import MAX_HEADER_BYTES

__all__ = ["GOOD", "KEY", "PROBES", "head"]

KEY = b"dGhlIHNhbXBsZSBub25jZQ=="


def head(*lines: bytes, path: bytes = b"/v1/worker", version: bytes = b"HTTP/1.1", method: bytes = b"GET") -> bytes:
    return b"\r\n".join([method + b" " + path + b" " + version, *lines]) + b"\r\n\r\n"


HOST = b"Host: gw.example"
UP = (b"Upgrade: websocket", b"Connection: Upgrade")
SUB = b"Sec-WebSocket-Protocol: kvasir.tunnel.v1"
GOOD = head(HOST, *UP, b"Sec-WebSocket-Key: " + KEY, b"Sec-WebSocket-Version: 13", SUB)

# name: (request bytes, status, reason, a header the answer must carry or None)
PROBES: dict[str, tuple[bytes, int, str, tuple[str, str] | None]] = {
    "no-key": (head(HOST, *UP, b"Sec-WebSocket-Version: 13", SUB), 400, "ws_key", None),
    "short-key": (head(HOST, *UP, b"Sec-WebSocket-Key: c2hvcnQ=", b"Sec-WebSocket-Version: 13", SUB),
                  400, "ws_key", None),
    "key-not-base64": (head(HOST, *UP, b"Sec-WebSocket-Key: !!!!not base64!!!!!!!!", b"Sec-WebSocket-Version: 13",
                            SUB), 400, "ws_key", None),
    "no-version": (head(HOST, *UP, b"Sec-WebSocket-Key: " + KEY, SUB), 426, "ws_version",
                   ("sec-websocket-version", "13")),
    "version-8": (head(HOST, *UP, b"Sec-WebSocket-Key: " + KEY, b"Sec-WebSocket-Version: 8", SUB), 426,
                  "ws_version", ("sec-websocket-version", "13")),
    "no-key-no-version": (head(HOST, *UP, SUB), 426, "ws_version", ("sec-websocket-version", "13")),
    "http10-no-host": (head(*UP, b"Sec-WebSocket-Key: " + KEY, b"Sec-WebSocket-Version: 13", SUB,
                            version=b"HTTP/1.0"), 400, "http_version", None),
    "http11-no-host": (head(*UP, b"Sec-WebSocket-Key: " + KEY, b"Sec-WebSocket-Version: 13", SUB), 400,
                       "bad_request", None),
    "empty-host": (head(b"Host: ", *UP, b"Sec-WebSocket-Key: " + KEY, b"Sec-WebSocket-Version: 13", SUB), 400,
                   "no_host", None),
    "post-upgrade": (head(HOST, *UP, b"Sec-WebSocket-Key: " + KEY, b"Sec-WebSocket-Version: 13", SUB,
                          b"Content-Length: 0", method=b"POST"), 405, "bad_method", ("allow", "GET")),
    "no-upgrade": (head(HOST), 426, "not_websocket", ("upgrade", "websocket")),
    "garbage": (b"\x16\x03\x01\x02\x00garbage\r\n\r\n", 400, "bad_request", None),
    "header-too-big": (head(HOST, b"X: " + b"a" * MAX_HEADER_BYTES), 431, "header_too_big", None),
    "request-line-too-long": (b"GET /" + b"a" * (MAX_HEADER_BYTES + 10) + b" HTTP/1.1\r\n\r\n", 414,
                              "request_line_too_long", None),
}
