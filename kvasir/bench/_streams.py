"""Dispatch streams this process drives, as the backbone's client side (``_Stream``; ``_RawStream``
of serialized messages), and the summary of a path's call times (``_summary``).
"""

from __future__ import annotations

import queue
import statistics
import time
from collections.abc import Iterator


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class _Stream:
    """One Dispatch stream; ``call`` is a blocking round trip, ``burst`` keeps k in flight."""

    def __init__(self, target: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        import grpc

        from kvasir_rpc import expert_pb2_grpc

        self.channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 256 << 20),
                                                             ("grpc.max_send_message_length", 256 << 20)])
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.responses = expert_pb2_grpc.ExpertServiceStub(self.channel).Dispatch(self._iter(), metadata=metadata)

    def _iter(self) -> Iterator[object]:
        while True:
            item = self.q.get()
            if item is None:
                return
            yield item

    def call(self, req: object) -> object:
        self.q.put(req)
        return next(self.responses)

    def burst(self, req: object, n: int, k: int) -> float:
        """Send n calls keeping k in flight; seconds taken."""
        t0 = time.perf_counter()
        sent = 0
        for _ in range(min(k, n)):
            self.q.put(req)
            sent += 1
        for _ in range(n):
            next(self.responses)
            if sent < n:
                self.q.put(req)
                sent += 1
        return time.perf_counter() - t0

    def close(self) -> None:
        self.q.put(None)
        self.responses.cancel()
        self.channel.close()


class _RawStream(_Stream):
    """A Dispatch stream of serialized messages, both ways: the caller pays no protobuf
    encoding or parsing, so the relays, not this process, carry the load."""

    def __init__(self, target: str, metadata: tuple[tuple[str, str], ...] = (), *,
                 timeout: float | None = None) -> None:
        import grpc

        self.channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 256 << 20),
                                                             ("grpc.max_send_message_length", 256 << 20)])
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.q = queue.SimpleQueue()
        dispatch = self.channel.stream_stream("/kvasir.v1.ExpertService/Dispatch")  # no (de)serializers: bytes
        # ``timeout``: a deadline for the whole stream, so no call of it can wait for ever.
        self.responses = dispatch(self._iter(), metadata=metadata, timeout=timeout)


def _summary(times: list[float], batch: int, payload: int, *, in_flight_rows_s: float | None) -> dict[str, float]:
    med = statistics.median(times)
    out = {
        "p50_ms": round(med * 1000, 3),
        "p90_ms": round(_pct(times, 0.9) * 1000, 3),
        "rows_s": round(batch / med, 1),
        "mb_s": round(payload / med / 1e6, 1),
    }
    if in_flight_rows_s is not None:
        out["rows_s_in_flight"] = round(in_flight_rows_s, 1)
    return out
