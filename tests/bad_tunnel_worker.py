"""A worker that breaks the tunnel protocol, for the conformance tests: the real
``python -m worker`` with one fault patched in at its WebSocket.

    python tests/bad_tunnel_worker.py FAULT -- <python -m worker arguments>

FAULT is one of:
  no-subprotocol  offers kvasir.tunnel.v0 instead of kvasir.tunnel.v1
  digest          announces (and describes) a weights digest with one bit flipped
  idle-eof        sends "eof" as soon as the hub accepts it, with no connection open
  no-closed       never answers "close" with "closed"
  mux-stray       on a multiplexed tunnel, once MUX_AFTER data messages went, sends the next on a
                  channel the hub never opened (the one after its own)
  mux-short       on a multiplexed tunnel, once MUX_AFTER data messages went, sends one byte: a
                  data message too short to name its channel
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import AsyncIterator
from typing import Any

FAULTS = ("no-subprotocol", "digest", "idle-eof", "no-closed", "mux-stray", "mux-short")
MUX_AFTER = 30  # honest data messages first: the backbone is mid-decode when the fault comes
CHANNEL_PREFIX_BYTES = 2


class _FaultyWebSocket:
    """The worker's WebSocket, with the fault applied to what passes through it."""

    def __init__(self, ws: Any, fault: str) -> None:
        self._ws = ws
        self._fault = fault
        self._binary_received = 0
        self._data_sent = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ws, name)

    async def receive_message(self) -> bytes | str:
        msg = await self._ws.receive_message()
        if isinstance(msg, bytes):
            self._binary_received += 1
            # The second binary message is SessionAccept: the session is up and idle.
            if self._fault == "idle-eof" and self._binary_received == 2:
                await self._ws.send_message("eof")
        return msg  # type: ignore[no-any-return]

    async def send_message(self, message: bytes | str | tuple[bytes | memoryview, ...], **kwargs: Any) -> bool:
        if self._fault == "no-closed" and message == "closed":
            return True
        if isinstance(message, tuple):  # a message in pieces (a channel's prefix, then its data)
            message = b"".join(message)
        if self._fault.startswith("mux-") and isinstance(message, bytes) and self._binary_received >= 2:
            self._data_sent += 1  # past the handshake: tunnel data, channel-prefixed
            if self._data_sent > MUX_AFTER:
                if self._fault == "mux-short":
                    message = message[:1]
                else:
                    channel = int.from_bytes(message[:CHANNEL_PREFIX_BYTES], "big") + 1
                    message = channel.to_bytes(CHANNEL_PREFIX_BYTES, "big") + message[CHANNEL_PREFIX_BYTES:]
        return await self._ws.send_message(message, **kwargs)  # type: ignore[no-any-return]


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--")
    fault = argv[0] if split == 1 else ""
    if fault not in FAULTS:
        print(f"usage: bad_tunnel_worker.py {{{','.join(FAULTS)}}} -- WORKER ARGS", file=sys.stderr)
        return 2

    import worker.__main__ as worker_main
    import worker._load as load
    import worker._tunnel as tunnel

    if fault == "digest":
        # The worker's main imports load_experts from worker._load when it loads (after its checks).
        honest_load = load.load_experts

        def load_experts(*args: Any, **kwargs: Any) -> Any:
            experts = honest_load(*args, **kwargs)
            experts.weights_digest = bytes([experts.weights_digest[0] ^ 1]) + experts.weights_digest[1:]
            return experts

        load.load_experts = load_experts
    else:
        honest_open = tunnel.open_websocket

        @contextlib.asynccontextmanager
        async def open_websocket(url: str, **kwargs: Any) -> AsyncIterator[Any]:
            if fault == "no-subprotocol":
                kwargs["subprotocols"] = ["kvasir.tunnel.v0"]
            async with honest_open(url, **kwargs) as ws:
                yield _FaultyWebSocket(ws, fault)

        tunnel.open_websocket = open_websocket  # type: ignore[assignment]
    return worker_main.main(argv[split + 1 :])


if __name__ == "__main__":
    code = main()
    gc.freeze()  # as python -m worker does: a quick exit, without the last collection's walk
    sys.exit(code)
