"""``kvasir conformance``: drive a worker through everything a hub and a backbone ask of it
and report each step, so someone writing a worker (in any language) knows when it is done.

The check is a hub: a plain ``ws://`` server that the worker, a stranger, dials out to
(``--hub ws://HOST:PORT`` for the Python worker). With ``--worker-cmd`` it starts the worker
itself and stops it at the end. Over that one WebSocket it runs, in order:

    upgrade     the worker offers the subprotocol kvasir.tunnel.v1
    handshake   SessionChallenge -> SessionHello (signature, nonce, limits) -> SessionAccept
    idle        nothing comes from the worker while no connection is open
    digest      the announced weights digest is the checkpoint's digest of the announced slices
    open        on "open" the worker dials its gRPC server: HTTP/2 bytes come back
    describe    Describe answers, and agrees with the hello
    dispatch    seeded random calls (several experts, several rows, a packed call with
                row_index), every output row against the reference kernel on the checkpoint
    errors      malformed calls get the gRPC status the spec names; the connection stays up
    close       "close" is answered with "closed" within CLOSE_TIMEOUT_S
    reconnect   a second "open" gives a fresh HTTP/2 connection (Describe again), then closes
    keepalive   a WebSocket ping is answered with a pong within KEEPALIVE_TIMEOUT_S, and on an
                encrypted session a sealed heartbeat with its ack within the same time

Every message the worker sends is fed to the hub side of the sans-IO tunnel protocol
(``kvasir_rpc.protocol.HubTunnel``); the first violation fails the running step with the
protocol's reason, ends the session as a hub would, and skips the steps after it. The gRPC
in the tunnel is real: a generated-stub client on a local TCP listener whose bytes are
spliced into the tunnel, as the hub splices the backbone's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    import grpc
    import torch
    from trio_websocket import WebSocketConnection, WebSocketRequest

    from kvasir_rpc import ExpertFunction, ExpertIndex, HelloInfo, SealedHeartbeat, TunnelCipher, expert_pb2

__all__ = ["PASS", "FAIL", "SKIP", "StepResult", "add_parser", "judge_partials", "run", "run_check"]

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
STEPS = ("upgrade", "handshake", "idle", "digest", "open", "describe", "dispatch", "errors", "close",
         "reconnect", "keepalive")
# How long the worker must stay silent after the handshake for the idle step.
IDLE_WATCH_S = 0.5
# A gRPC call through the tunnel (a tiny model answers in milliseconds; a large expert on a
# slow CPU in well under this).
CALL_TIMEOUT_S = 30.0
# From "open" to the first HTTP/2 bytes of the worker's gRPC server.
OPEN_TIMEOUT_S = 10.0
# Rows of the packed call's hidden, and how each of its experts picks from them.
_PACKED_PICKS = ((0, 1, 3), (1, 2), (0, 3))
_MAX_CHANNEL_BYTES = 256 << 20


@dataclasses.dataclass
class StepResult:
    """One line of the report: ``status`` is PASS, FAIL or SKIP; ``detail`` says what was
    expected and what came; ``notes`` are things a PASS still wants the author to know."""

    step: str
    status: str
    detail: str
    notes: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


class _StepFailed(Exception):
    """A step found the worker wrong; the message is the report's detail."""


@dataclasses.dataclass(frozen=True)
class _Config:
    model: pathlib.Path
    host: str
    port: int
    worker_cmd: str | None
    worker_log: pathlib.Path
    timeout_s: float
    seed: int


# -- what a worker must compute ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Call:
    """One DispatchRequest and what the reference needs to judge its answer."""

    name: str
    request: expert_pb2.DispatchRequest
    layer: int
    hidden: torch.Tensor  # [n, H] as sent
    weights: torch.Tensor  # [assignments]
    segments: tuple[tuple[int, int], ...]  # (expert, rows), in order
    row_index: torch.Tensor | None  # [assignments] int64 when packed


def _make_call(name: str, call_id: int, layer: int, hidden: torch.Tensor, weights: torch.Tensor,
               segments: Sequence[tuple[int, int]], row_index: Sequence[int] = (), projections: bool = False) -> _Call:
    import torch

    from kvasir_rpc import encode_tensor, expert_pb2

    req = expert_pb2.DispatchRequest(
        call_id=call_id, layer=layer, hidden=encode_tensor(hidden), weights=encode_tensor(weights),
        segments=[expert_pb2.ExpertSegment(expert=e, rows=n) for e, n in segments], row_index=list(row_index),
        projections=projections)
    index = torch.tensor(list(row_index), dtype=torch.long) if row_index else None
    return _Call(name, req, layer, hidden, weights, tuple(segments), index)


def _pick_layer(slices: Mapping[int, Sequence[int]]) -> tuple[int, tuple[int, ...]]:
    """The layer with the most announced experts (the lowest on a tie), and up to three of them."""
    layer = max(sorted(slices), key=lambda k: len(slices[k]))
    return layer, tuple(slices[layer][:3])


def plan_calls(slices: Mapping[int, Sequence[int]], hidden_size: int, dtype: torch.dtype, seed: int,
               projections: bool = False) -> list[_Call]:
    """Seeded random calls over announced experts: one of several experts with several rows
    each, one of a single row, and a packed one (``row_index``) when the worker holds two or
    more experts of a layer. Inputs are float32 normals cast to the model's dtype. With
    ``projections`` (the worker announced them) every call asks for them."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def rand_rows(n: int) -> torch.Tensor:
        return torch.randn(n, hidden_size, generator=gen).to(dtype)

    def rand_weights(n: int) -> torch.Tensor:
        return torch.rand(n, generator=gen).to(dtype)

    layer, experts = _pick_layer(slices)
    counts = (3, 2, 4)[: len(experts)]
    segs = list(zip(experts, counts))
    calls = [
        _make_call("several experts", 1, layer, rand_rows(sum(counts)), rand_weights(sum(counts)), segs,
                   projections=projections),
        _make_call("one row", 2, layer, rand_rows(1), rand_weights(1), [(experts[-1], 1)], projections=projections),
    ]
    if len(experts) >= 2:
        picks = _PACKED_PICKS[: len(experts)]
        index = [i for p in picks for i in p]
        calls.append(_make_call("packed (row_index)", 3, layer, rand_rows(1 + max(index)),
                                rand_weights(len(index)), [(e, len(p)) for e, p in zip(experts, picks)], index,
                                projections=projections))
    return calls


class _IndexWeights:
    """The checkpoint's experts as the row checks read them (backbone's ExpertWeights)."""

    def __init__(self, experts: ExpertIndex) -> None:
        self._experts = experts

    def num_experts(self, layer: int) -> int:
        return self._experts.info.num_experts

    def get(self, layer: int, expert: int, *, keep: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        return self._experts.load(layer, expert)

    def biases(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._experts.biases(layer, expert)


def judge_projections(call: _Call, partials: torch.Tensor, answer: Any, experts: ExpertIndex,
                      fn: ExpertFunction) -> tuple[bool, str]:
    """The row checks the backbone runs on every row of an answer whose projections it asked
    for (docs/PROTOCOL.md 11.1), on a call's answer: ``(passed, why not)``."""
    import torch

    from kvasir_rpc import RowChecker, TensorCodecError, decode_tensor

    cid = call.request.call_id
    if not answer.HasField("projections"):
        return False, (f"call {cid} ({call.name}) asked for projections (the hello announced them) and the answer "
                       "has none: ExpertPartials.projections, [assignments, 2 x intermediate] (PROTOCOL.md 9.2)")
    try:
        got = decode_tensor(answer.projections)
    except TensorCodecError as exc:
        return False, f"call {cid} ({call.name}): malformed projections: {exc}"
    rows = sum(n for _, n in call.segments)
    want = (rows, 2 * experts.info.intermediate_size)
    if tuple(got.shape) != want or got.dtype != call.hidden.dtype:
        return False, (f"call {cid} ({call.name}): projections of shape {list(got.shape)} {got.dtype}, expected "
                       f"{list(want)} {call.hidden.dtype}")
    x = call.hidden if call.row_index is None else call.hidden[call.row_index]
    ids = torch.tensor([e for e, n in call.segments for _ in range(n)], dtype=torch.long)
    verdict = RowChecker(_IndexWeights(experts)).check(call.layer, fn, x, call.weights, ids, partials, got)
    if not verdict.passed:
        return False, (f"call {cid} ({call.name}), layer {call.layer}: the row checks fail: {verdict.detail} "
                       "(PROTOCOL.md 11.1: the projections must be [g | u], all gates then all ups, biases added, "
                       "and the partials computed from them)")
    return True, ""


def judge_partials(call: _Call, got: torch.Tensor, experts: ExpertIndex, fn: ExpertFunction) -> tuple[bool, str]:
    """Compare a worker's partials for ``call`` with the reference kernel on the checkpoint.

    Returns ``(passed, note)``: bit-equal passes with an empty note; within the backbone's audit
    tolerance passes with a note; anything else fails, the note naming the worst element."""
    import torch

    from kvasir_rpc import audit_rows, expert_forward

    rows = sum(n for _, n in call.segments)
    want = (rows, call.hidden.shape[1])
    if tuple(got.shape) != want or got.dtype != call.hidden.dtype:
        return False, (f"call {call.request.call_id} ({call.name}): partials of shape {list(got.shape)} "
                       f"{got.dtype}, expected {list(want)} {call.hidden.dtype} (one row per assignment, "
                       "in the request's dtype)")
    exact, start = 0, 0
    worst: tuple[float, str] | None = None
    for expert, n in call.segments:
        picked = torch.arange(start, start + n) if call.row_index is None else call.row_index[start : start + n]
        x, w, g = call.hidden[picked], call.weights[start : start + n], got[start : start + n]
        gate_up, down = experts.load(call.layer, expert)
        biases = experts.biases(call.layer, expert)
        verdict = audit_rows(g, x, gate_up, down, fn, w, list(range(start, start + n)), biases)
        exact += verdict.exact
        if not verdict.passed:
            ref = expert_forward(x.to(gate_up.dtype), gate_up, down, fn, w.to(gate_up.dtype), biases).to(got.dtype)
            diff = torch.nan_to_num((g - ref).abs().float(), nan=float("inf"))
            r, c = divmod(int(diff.argmax()), diff.shape[1])
            gap = float(diff[r, c])
            if worst is None or gap > worst[0]:
                worst = (gap, (f"call {call.request.call_id} ({call.name}), layer {call.layer} expert {expert}, "
                               f"assignment row {start + r} column {c}: got {float(g[r, c])!r}, the reference "
                               f"kernel gives {float(ref[r, c])!r} (|diff| {gap:.3g}; the backbone's audit "
                               f"allows {verdict.tolerance:.3g} on its worst element)"))
        start += n
    if worst is not None:
        return False, worst[1]
    if exact < rows:
        return True, (f"call {call.request.call_id} ({call.name}): {rows - exact} of {rows} rows within the "
                      "backbone's audit tolerance but not bit-exact: a backbone's --compare-local gives the verdict "
                      "'within the audit bound, tokens identical' (a pass; --require-bitwise fails it)")
    return True, ""


# -- the check ---------------------------------------------------------------------------


class _Check:
    """One run against one worker WebSocket. ``fatal`` is set once the session is over (the
    worker broke the protocol, closed, or we closed it); later steps are skipped."""

    def __init__(self, cfg: _Config, say: Callable[[StepResult], None]) -> None:
        from kvasir_rpc import ExpertIndex, Wallet
        from kvasir_rpc.protocol import HubTunnel

        self.cfg = cfg
        self.say = say
        self.experts = ExpertIndex(cfg.model)
        self.function = self.experts.function  # what the checkpoint says each expert computes
        self.hub_key = Wallet.generate()
        self.results: list[StepResult] = []
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.hello: HelloInfo | None = None
        self.ws: WebSocketConnection | None = None
        self.cipher: TunnelCipher | None = None  # the worker's session is sealed end to end
        self.heartbeat: SealedHeartbeat | None = None  # and then its liveness is checked so
        self.tunnel = HubTunnel()
        self.fatal: str | None = None
        self.finishing = False
        self.dialled = trio.Event()
        self.done = trio.Event()
        self._upgrade: StepResult | None = None
        self._scope: trio.CancelScope | None = None
        self._fatal_reported = False
        self.ended_at: str | None = None  # the step that failed with the session's end
        self._nursery: trio.Nursery | None = None
        # The current spliced connection (one at a time, as the hub does).
        self.stream: trio.SocketStream | None = None
        self.target = ""
        self.opens = 0
        self.eofs = 0
        self.discarded = 0
        self.opened = trio.Event()
        self.first_data = trio.Event()
        self.closed = trio.Event()
        self._worker_eof = trio.Event()
        self._close_sent_at = 0.0

    # reporting

    def skipped(self) -> str:
        """The detail of a step not run because the session is over."""
        if self.ended_at is not None:
            return f"not run: the session ended in step {self.ended_at}"
        return f"not run: {self.fatal or 'stopped'}"

    def record(self, result: StepResult) -> None:
        self.results.append(result)
        self.say(result)

    # the WebSocket server

    async def handle(self, request: WebSocketRequest) -> None:
        from kvasir_rpc.protocol import TUNNEL_SUBPROTOCOL, choose_subprotocol

        if self.dialled.is_set():
            await request.reject(409, body=b"this conformance check serves one session\n")
            return
        offered = list(request.proposed_subprotocols)
        chosen = choose_subprotocol(offered)
        if chosen is None:
            await request.reject(400, body=f"the tunnel needs the WebSocket subprotocol {TUNNEL_SUBPROTOCOL}\n".encode())
            self._upgrade = StepResult("upgrade", FAIL, (
                f"the worker offered subprotocols {offered or '(none)'}; it must offer {TUNNEL_SUBPROTOCOL} in "
                "Sec-WebSocket-Protocol (a hub refuses the upgrade with HTTP 400)"))
            self.dialled.set()
            return
        self.ws = await request.accept(subprotocol=chosen)
        self._upgrade = StepResult("upgrade", PASS, f"{request.path!r} upgraded with subprotocol {chosen}; "
                                                    f"offered {offered}")
        self.dialled.set()
        await self.done.wait()

    async def end(self, reason: str, close_code: int | None = None) -> None:
        """The session is over: close as a hub would, stop the running session step (it fails
        with ``reason``; with none running, the next one does) and skip the rest."""
        if self.fatal is None:
            self.fatal = reason
            self._fatal_reported = self._scope is not None
        if close_code is not None and self.ws is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(2):  # the worker may be gone
                await self.ws.aclose(close_code, reason[:120])
        if self._scope is not None:
            self._scope.cancel()

    # steps

    async def step(self, name: str, limit_s: float, body: Callable[[], Awaitable[tuple[str, list[str]]]],
                   *, session: bool = True) -> bool:
        """Run one step under ``limit_s``; a step raising _StepFailed, timing out or (a
        ``session`` step) cut short by the end of the session fails. A session step is skipped
        once the session is over; the first after an end no step saw fails with its reason."""
        from trio_websocket import ConnectionClosed

        if session and self.fatal is not None:
            if self._fatal_reported:
                self.record(StepResult(name, SKIP, self.skipped()))
            else:
                self._fatal_reported, self.ended_at = True, name
                self.record(StepResult(name, FAIL, self.fatal))
            return False
        t0 = time.monotonic()
        status, notes = FAIL, list[str]()
        with trio.CancelScope() as scope:
            if session:
                self._scope = scope
            try:
                with trio.fail_after(limit_s):
                    detail, notes = await body()
                status = PASS
            except _StepFailed as exc:
                detail = str(exc)
            except trio.TooSlowError:
                detail = f"not done within {limit_s:g} s"
            except ConnectionClosed as exc:
                why = exc.reason
                await self.end("the worker closed the WebSocket" + ("" if why is None else
                               f": {why.code} {why.reason or ''}".rstrip()))
                detail = self.fatal or ""
        self._scope = None
        if scope.cancelled_caught:
            detail = self.fatal or "stopped"
        result = StepResult(name, status, detail, notes, round(time.monotonic() - t0, 3))
        if self.fatal is not None and self._fatal_reported and self.ended_at is None:
            self.ended_at = name
        self.record(result)
        return status == PASS

    async def run(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        if not await self._wait_dial():
            return
        assert self.ws is not None
        if not await self.step("handshake", 30.0, self._handshake):
            return
        nursery.start_soon(self._read)
        await self.step("idle", 10.0, self._idle)
        # The digest is the checkpoint's business, not the session's: judged whatever happens.
        await self.step("digest", 3600.0, self._digest, session=False)
        target_port = await nursery.start(self._serve_target)
        self.target = f"127.0.0.1:{target_port}"
        channel = self._channel()
        try:
            await self.step("open", OPEN_TIMEOUT_S + 10, functools.partial(self._open, channel))
            await self.step("describe", CALL_TIMEOUT_S + 5, functools.partial(self._describe, channel))
            await self.step("dispatch", 4 * CALL_TIMEOUT_S, functools.partial(self._dispatch, channel))
            await self.step("errors", 5 * CALL_TIMEOUT_S, functools.partial(self._errors, channel))
            await self.step("close", self._close_limit(), functools.partial(self._close, channel))
        finally:
            channel.close()
        await self.step("reconnect", CALL_TIMEOUT_S + self._close_limit(), self._reconnect)
        await self.step("keepalive", 15.0, self._keepalive)
        if self.fatal is None:
            self.finishing = True
            await self.end("conformance check done", 1000)

    def _close_limit(self) -> float:
        from kvasir_rpc.protocol import CLOSE_TIMEOUT_S

        return CLOSE_TIMEOUT_S + 5.0

    async def _wait_dial(self) -> bool:
        deadline = trio.current_time() + self.cfg.timeout_s
        t0 = time.monotonic()
        while not self.dialled.is_set():
            code = self.proc.poll() if self.proc is not None else None
            if code is not None:
                self.fatal = f"the worker command exited with code {code} before dialling {self.url}"
                self.ended_at = "upgrade"
                self.record(StepResult("upgrade", FAIL, f"{self.fatal}; its output ends:\n{_tail(self.cfg.worker_log)}"))
                return False
            if trio.current_time() > deadline:
                self.fatal = f"no worker dialled {self.url} within {self.cfg.timeout_s:g} s"
                self.ended_at = "upgrade"
                self.record(StepResult("upgrade", FAIL, self.fatal))
                return False
            with trio.move_on_after(0.1):
                await self.dialled.wait()
        assert self._upgrade is not None
        self._upgrade.seconds = round(time.monotonic() - t0, 3)
        self.record(self._upgrade)
        if self._upgrade.status != PASS:
            self.fatal, self.ended_at = "the WebSocket upgrade failed", "upgrade"
            return False
        return True

    async def _handshake(self) -> tuple[str, list[str]]:
        from kvasir_rpc import HubHandshake, SealedHeartbeat, format_slices
        from kvasir_rpc.protocol import HUB_HANDSHAKE_TIMEOUT_S, CloseCode, RemoteProtocolError

        assert self.ws is not None
        # As a hub would for a direct worker (--e2e auto): encrypted when the worker requires it.
        hs = HubHandshake(self.hub_key)
        try:
            with trio.fail_after(HUB_HANDSHAKE_TIMEOUT_S):
                await self.ws.send_message(hs.challenge())
                data = await self.ws.get_message()
                if isinstance(data, str):
                    raise RemoteProtocolError(f"the SessionHello must be a binary message, got text {data[:40]!r}")
                info = hs.receive_hello(data)
                await self.ws.send_message(hs.accept("conformance-1"))
                self.cipher = hs.cipher
                self.heartbeat = SealedHeartbeat(self.ws, hs.cipher) if hs.cipher is not None else None
        except trio.TooSlowError:
            await self.end(f"no SessionHello within {HUB_HANDSHAKE_TIMEOUT_S:g} s of the challenge (a hub closes "
                           "1008 'handshake timed out')", CloseCode.POLICY_VIOLATION)
            raise _StepFailed(self.fatal) from None
        except RemoteProtocolError as exc:
            await self.end(f"hello refused: {exc.reason} (a hub closes {exc.close_code})", exc.close_code)
            raise _StepFailed(self.fatal) from None
        self.hello = info
        notes = []
        model_type = self.experts.info.model_type
        if info.model_type != model_type:
            notes.append(f"the hello says model_type {info.model_type!r}, the checkpoint {model_type!r}")
        n = sum(len(e) for e in info.slices.values())
        return (f"wallet {info.wallet[:16]}…, device {info.device!r}, version {info.worker_version!r}; "
                f"{n} experts in {len(info.slices)} layers ({format_slices(info.slices)})"), notes

    async def _digest(self) -> tuple[str, list[str]]:
        assert self.hello is not None
        want, missing = await trio.to_thread.run_sync(self._checkpoint_digest, self.hello.slices,
                                                      abandon_on_cancel=True)
        if missing:
            raise _StepFailed(f"the hello announces {len(missing)} experts the checkpoint does not have, "
                              f"e.g. (layer, expert) {missing[:4]}")
        got = self.hello.weights_digest
        why = self._other_function()
        if why:
            raise _StepFailed(why)
        if got != want:
            raise _StepFailed(
                f"announced digest {got.hex()}, the checkpoint's digest of the announced slices is {want.hex()}: "
                "the backbone will not route to these experts and computes them itself. Per expert, sha256 over "
                "(dtype, shape, raw bytes) of gate_up [2I, H] then down [H, I]; then sha256 of "
                "'kvasir.v1.weights\\0' and, by ascending (layer, expert), u32le layer, u32le expert, digest")
        return f"{got.hex()[:16]}… equals the checkpoint's digest of the announced slices", []

    def _other_function(self) -> str:
        """Why the hello's expert function is not the checkpoint's ("" when it is)."""
        from kvasir_rpc import announced_mismatch, function_pb2

        assert self.hello is not None
        raw = self.hello.expert_function
        why = announced_mismatch(function_pb2.ExpertFunction.FromString(raw) if raw else None, self.function)
        return (f"{why} (HelloBody.expert_function, PROTOCOL.md 11.2): a backbone will not route to this worker"
                if why else "")

    def _checkpoint_digest(self, slices: Mapping[int, Sequence[int]]) -> tuple[bytes, list[tuple[int, int]]]:
        from kvasir_rpc import slices_digest

        keys = [(layer, e) for layer, experts in sorted(slices.items()) for e in experts]
        missing = [k for k in keys if not self.experts.has(*k)]
        if missing:
            return b"", missing
        return slices_digest({k: self.experts.expert_digest(*k) for k in keys}), []

    async def _idle(self) -> tuple[str, list[str]]:
        # A message now is a violation: the reader ends the session and this step with it.
        await trio.sleep(IDLE_WATCH_S)
        return f"nothing sent while no connection was open ({IDLE_WATCH_S:g} s watched)", []

    def _channel(self) -> grpc.Channel:
        import grpc

        return grpc.insecure_channel(self.target, options=[
            ("grpc.use_local_subchannel_pool", 1),  # its own connection, not one shared in-process
            ("grpc.max_receive_message_length", _MAX_CHANNEL_BYTES),
            ("grpc.max_send_message_length", _MAX_CHANNEL_BYTES),
        ])

    async def _open(self, channel: grpc.Channel) -> tuple[str, list[str]]:
        import grpc

        ready = grpc.channel_ready_future(channel)  # starts connecting
        try:
            with trio.fail_after(OPEN_TIMEOUT_S):
                await self.opened.wait()
        except trio.TooSlowError:
            raise _StepFailed("internal: the gRPC client did not reach the local listener") from None
        t0 = time.monotonic()
        try:
            with trio.fail_after(OPEN_TIMEOUT_S):
                await self.first_data.wait()
        except trio.TooSlowError:
            # Nothing after this can be judged: every other step needs the connection.
            await self.end(f"no HTTP/2 bytes within {OPEN_TIMEOUT_S:g} s of 'open': on 'open' a worker dials "
                           "its gRPC server and copies its bytes into binary messages")
            raise _StepFailed(self.fatal) from None
        first_ms = (time.monotonic() - t0) * 1000
        try:
            await trio.to_thread.run_sync(ready.result, OPEN_TIMEOUT_S, abandon_on_cancel=True)
        except grpc.FutureTimeoutError:
            raise _StepFailed(f"bytes came back after 'open' but no HTTP/2 connection was up within "
                              f"{OPEN_TIMEOUT_S:g} s: are they the bytes of a gRPC server?") from None
        return f"first HTTP/2 bytes {first_ms:.1f} ms after 'open'; the gRPC channel is READY", []

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)

    async def _describe(self, channel: grpc.Channel) -> tuple[str, list[str]]:
        import grpc

        from kvasir_rpc import DTYPE_TO_WIRE, expert_pb2, expert_pb2_grpc, slices_from_proto

        stub = expert_pb2_grpc.ExpertServiceStub(channel)
        try:
            resp = await self._call(lambda: stub.Describe(expert_pb2.DescribeRequest(), timeout=CALL_TIMEOUT_S))
        except grpc.RpcError as exc:
            raise _StepFailed(f"Describe failed: {_status(exc)}") from None
        assert self.hello is not None
        info, wrong = self.experts.info, []
        try:
            slices = slices_from_proto(resp.slices)
        except ValueError as exc:
            slices = {}
            wrong.append(f"slices: {exc}")
        if slices and slices != self.hello.slices:
            wrong.append("slices differ from the hello's")
        if resp.weights_digest != self.hello.weights_digest:
            wrong.append(f"weights_digest {resp.weights_digest.hex()[:16]}… is not the hello's "
                         f"{self.hello.weights_digest.hex()[:16]}…")
        if resp.wallet != self.hello.wallet:
            wrong.append(f"wallet {resp.wallet[:16]!r} is not the hello's {self.hello.wallet[:16]}…")
        if resp.hidden_size != info.hidden_size:
            wrong.append(f"hidden_size {resp.hidden_size}, the checkpoint's is {info.hidden_size}")
        if resp.dtype != DTYPE_TO_WIRE.get(info.dtype):
            wrong.append(f"dtype {resp.dtype}, the checkpoint's is {info.dtype}")
        if wrong:
            raise _StepFailed("Describe disagrees: " + "; ".join(wrong))
        return f"agrees with the hello (device {resp.device!r}, hidden_size {resp.hidden_size}, {info.dtype})", []

    def _calls(self) -> list[_Call]:
        assert self.hello is not None
        info = self.experts.info
        return plan_calls(self.hello.slices, info.hidden_size, info.dtype, self.cfg.seed, self.hello.projections)

    async def _dispatch(self, channel: grpc.Channel) -> tuple[str, list[str]]:
        import grpc

        from kvasir_rpc import TensorCodecError, decode_tensor, expert_pb2_grpc

        stub = expert_pb2_grpc.ExpertServiceStub(channel)
        calls = self._calls()
        plain = [c for c in calls if c.row_index is None]
        packed = [c for c in calls if c.row_index is not None]
        notes: list[str] = []
        answers: dict[int, Any] = {}
        try:  # the plain calls on one stream, as the backbone streams many calls
            for resp in await self._call(lambda: list(stub.Dispatch(iter([c.request for c in plain]),
                                                                    timeout=CALL_TIMEOUT_S))):
                cid = resp.partials.call_id
                if cid in answers or cid not in {c.request.call_id for c in plain}:
                    raise _StepFailed(f"an answer with call_id {cid}, which was {'answered already' if cid in answers else 'never sent'}")
                answers[cid] = resp.partials
        except grpc.RpcError as exc:
            raise _StepFailed(f"Dispatch of {len(plain)} well-formed calls failed: {_status(exc)}") from None
        for c in packed:
            try:
                got = await self._call(lambda: list(stub.Dispatch(iter([c.request]), timeout=CALL_TIMEOUT_S)))
            except grpc.RpcError as exc:
                # row_index is part of DispatchRequest (PROTOCOL.md 9.2): the backbone packs a call
                # whenever a token hits two of this worker's experts in a layer, and a refused call
                # fails the whole stream to this worker.
                raise _StepFailed(f"Dispatch of a packed call (row_index) failed: {_status(exc)}") from None
            if len(got) != 1 or got[0].partials.call_id != c.request.call_id:
                raise _StepFailed(f"a packed call {c.request.call_id} got {len(got)} answers "
                                  f"(call_ids {[r.partials.call_id for r in got]}), expected one")
            answers[c.request.call_id] = got[0].partials
        missing = [c.request.call_id for c in plain if c.request.call_id not in answers]
        if missing:
            raise _StepFailed(f"no answer to calls {missing}: every DispatchRequest gets one ExpertPartials")
        judged = [c for c in calls if c.request.call_id in answers]
        for c in judged:
            try:
                out = decode_tensor(answers[c.request.call_id].partials)
            except TensorCodecError as exc:
                raise _StepFailed(f"call {c.request.call_id} ({c.name}): malformed partials: {exc}") from None
            ok, note = await trio.to_thread.run_sync(judge_partials, c, out, self.experts, self.function,
                                                     abandon_on_cancel=True)
            if not ok:
                raise _StepFailed(note)
            if note:
                notes.append(note)
            if c.request.projections:
                ok, note = await trio.to_thread.run_sync(judge_projections, c, out, answers[c.request.call_id],
                                                         self.experts, self.function, abandon_on_cancel=True)
                if not ok:
                    raise _StepFailed(note)
        assert self.hello is not None
        if not self.hello.projections:
            notes.append("the hello does not announce projections: a backbone checks this worker by sampled audits "
                         "alone, at a higher rate (PROTOCOL.md 11.1, 13); announce them and return them when asked")
        rows = sum(int(c.request.weights.shape[0]) for c in judged)
        verdict = ("within the audit bound of the reference kernel, not bitwise" if any(
            "not bit-exact" in n for n in notes) else "bitwise equal to the reference kernel (bit-exact)")
        if self.hello.projections:
            verdict += ", and its projections pass the row checks"
        return (f"{len(judged)} calls, {rows} assignment rows of layer {judged[0].layer}, experts "
                f"{sorted({e for c in judged for e, _ in c.segments})}: every row {verdict}"), notes

    async def _errors(self, channel: grpc.Channel) -> tuple[str, list[str]]:
        import grpc
        import torch

        from kvasir_rpc import expert_pb2, expert_pb2_grpc

        stub = expert_pb2_grpc.ExpertServiceStub(channel)
        good = self._calls()[1]  # one row through one expert
        layer = good.layer
        short = expert_pb2.DispatchRequest()
        short.CopyFrom(good.request)
        short.call_id = 11
        short.hidden.data = short.hidden.data[:-1]
        nan = _make_call("NaN rows", 12, layer, torch.full_like(good.hidden, float("nan")), good.weights,
                         good.segments).request
        held = set(self.hello.slices.get(layer, ())) if self.hello else set()
        absent = next(e for e in range(self.experts.info.num_experts + 1) if e not in held)
        unknown = _make_call("unknown expert", 13, layer, good.hidden, good.weights, [(absent, 1)]).request
        cases = [
            ("hidden one byte short of its shape", short, grpc.StatusCode.INVALID_ARGUMENT),
            ("hidden rows of NaN", nan, grpc.StatusCode.INVALID_ARGUMENT),
            (f"layer {layer} expert {absent}, which it did not announce", unknown, grpc.StatusCode.FAILED_PRECONDITION),
        ]
        opens, eofs = self.opens, self.eofs
        seen = []
        for what, req, code in cases:
            try:
                got = await self._call(lambda: list(stub.Dispatch(iter([req]), timeout=CALL_TIMEOUT_S)))
            except grpc.RpcError as exc:
                if exc.code() != code:
                    raise _StepFailed(f"a call with {what}: expected status {code.name}, got {_status(exc)}") from None
                seen.append(code.name)
                continue
            raise _StepFailed(f"a call with {what} was answered ({len(got)} responses); expected status {code.name}")
        try:
            await self._call(lambda: stub.Describe(expert_pb2.DescribeRequest(), timeout=CALL_TIMEOUT_S))
        except grpc.RpcError as exc:
            raise _StepFailed(f"after the refused calls, Describe failed: {_status(exc)}") from None
        if self.eofs != eofs or self.opens != opens:
            raise _StepFailed("the worker ended the HTTP/2 connection ('eof') after a refused call: a bad call "
                              "ends its own stream only")
        return (f"{len(cases)} malformed calls refused ({', '.join(seen)}); the same connection then answered "
                "Describe"), []

    async def _close(self, channel: grpc.Channel) -> tuple[str, list[str]]:
        # Ending the client's connection makes the splice send "close" (as the hub does when the
        # backbone's connection ends); the splice ends the session if "closed" is late.
        await self._call(channel.close)
        await self.closed.wait()
        return self._closed_detail(), []

    def _closed_detail(self) -> str:
        ms = (trio.current_time() - self._close_sent_at) * 1000
        return f"'closed' {ms:.1f} ms after 'close'; {self.discarded} late bytes discarded"

    async def _reconnect(self) -> tuple[str, list[str]]:
        import grpc

        from kvasir_rpc import expert_pb2, expert_pb2_grpc

        opens = self.opens
        channel = self._channel()
        try:
            stub = expert_pb2_grpc.ExpertServiceStub(channel)
            try:
                await self._call(lambda: stub.Describe(expert_pb2.DescribeRequest(), timeout=CALL_TIMEOUT_S))
            except grpc.RpcError as exc:
                raise _StepFailed(f"Describe on a second connection failed: {_status(exc)}") from None
            if self.opens != opens + 1:
                raise _StepFailed(f"internal: expected one new connection, saw {self.opens - opens}")
        finally:
            await self._call(channel.close)
        await self.closed.wait()
        return f"a second 'open' served Describe on a fresh HTTP/2 connection; {self._closed_detail()}", []

    async def _keepalive(self) -> tuple[str, list[str]]:
        from kvasir_rpc.protocol import KEEPALIVE_TIMEOUT_S, RemoteProtocolError

        assert self.ws is not None
        t0 = time.monotonic()
        try:
            with trio.fail_after(KEEPALIVE_TIMEOUT_S):
                await self.ws.ping()
        except trio.TooSlowError:
            raise _StepFailed(f"no pong within {KEEPALIVE_TIMEOUT_S:g} s of a ping (a hub closes 1001)") from None
        detail = f"pong after {(time.monotonic() - t0) * 1000:.1f} ms"
        if self.heartbeat is None:
            return detail, []
        try:
            await self.heartbeat.check(KEEPALIVE_TIMEOUT_S)
        except RemoteProtocolError as exc:
            raise _StepFailed(f"{exc.reason} (a hub closes {exc.close_code}; an encrypted session's liveness is "
                              "the sealed heartbeat, docs/PROTOCOL.md 4.5)") from None
        assert self.heartbeat.rtt_s is not None
        return f"{detail}; sealed heartbeat acknowledged after {self.heartbeat.rtt_s * 1000:.1f} ms", []

    # tasks

    async def _read(self) -> None:
        """Feed every message of the worker to the hub's tunnel state machine."""
        from trio_websocket import ConnectionClosed

        from kvasir_rpc import receive_message
        from kvasir_rpc.protocol import Closed, Data, Discarded, Eof, RemoteProtocolError

        assert self.ws is not None
        while True:
            try:
                msg = await receive_message(self.ws, self.cipher, self.heartbeat)
            except ConnectionClosed as exc:
                if not self.finishing:
                    why = exc.reason
                    await self.end("the worker closed the WebSocket" + ("" if why is None else
                                   f": {why.code} {why.reason or ''}".rstrip()))
                return
            except RemoteProtocolError as exc:  # a sealed message that does not open
                await self.end(f"end-to-end channel: {exc.reason}; a hub closes {exc.close_code}", exc.close_code)
                return
            state = self.tunnel.state
            try:
                event = self.tunnel.receive(msg)
            except RemoteProtocolError as exc:
                await self.end(f"protocol error: {exc.reason} ({_HINTS[state.name]}); a hub closes "
                               f"{exc.close_code}", exc.close_code)
                return
            if isinstance(event, Data):
                self.first_data.set()
                stream = self.stream
                if stream is not None:
                    try:
                        await stream.send_all(event.data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass  # the client left; "close" follows
            elif isinstance(event, Eof):
                self.eofs += 1
                self._worker_eof.set()
            elif isinstance(event, Discarded):
                self.discarded += event.nbytes
            elif isinstance(event, Closed):
                self.closed.set()

    async def _serve_target(self, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """The local gRPC target: each client connection in turn is spliced into the tunnel."""
        from trio_websocket import ConnectionClosed

        from kvasir_rpc.protocol import RemoteProtocolError

        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        async with listener:
            task_status.started(listener.socket.getsockname()[1])
            while True:
                stream = await listener.accept()
                if self.fatal is not None:
                    await stream.aclose()
                    continue
                try:
                    await self._splice(stream)
                except ConnectionClosed:
                    pass  # the reader reports it
                except RemoteProtocolError as exc:  # a tunnel message could not be sent in time
                    await self.end(exc.reason, exc.close_code)

    async def _splice(self, stream: trio.SocketStream) -> None:
        from kvasir_rpc import send_whole
        from kvasir_rpc.protocol import CLOSE_TIMEOUT_S, READ_BYTES, CloseCode, TunnelState

        ws = self.ws
        assert ws is not None
        self.opens += 1
        self.first_data, self.closed, self._worker_eof = trio.Event(), trio.Event(), trio.Event()
        self.discarded = 0
        self.stream = stream
        await send_whole(ws, self.tunnel.open(), cipher=self.cipher)
        self.opened.set()
        async with trio.open_nursery() as nursery:

            async def client_to_worker() -> None:
                while True:
                    try:
                        data = await stream.receive_some(READ_BYTES)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        data = b""
                    if not data or self.tunnel.state is not TunnelState.OPEN:
                        break
                    await send_whole(ws, self.tunnel.send_data(bytes(data)), cipher=self.cipher)
                nursery.cancel_scope.cancel()

            nursery.start_soon(client_to_worker)
            await self._worker_eof.wait()
            nursery.cancel_scope.cancel()
        self.stream = None
        await stream.aclose()
        if self.fatal is not None:
            return
        self._close_sent_at = trio.current_time()
        await send_whole(ws, self.tunnel.close(), cipher=self.cipher)
        with trio.move_on_after(CLOSE_TIMEOUT_S):
            await self.closed.wait()
        if not self.closed.is_set():
            await self.end(f"the worker did not answer 'close' with 'closed' within {CLOSE_TIMEOUT_S:g} s (a hub "
                           "closes 1008 'close not acknowledged')", CloseCode.POLICY_VIOLATION)


_HINTS = {
    "IDLE": "a worker sends nothing until the hub says 'open'",
    "OPEN": "while open a worker sends binary HTTP/2 bytes, or 'eof' when its gRPC server ends the connection",
    "EOF": "after 'eof' a worker waits for 'close'",
    "CLOSING": "after 'close' a worker may send late bytes or 'eof', then 'closed'",
}


def _status(exc: Any) -> str:
    return f"{exc.code().name}: {exc.details()}"


def _tail(path: pathlib.Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


async def _serve_and_check(check: _Check, say_url: Callable[[str], None]) -> None:
    from trio_websocket import serve_websocket

    from kvasir_rpc.protocol import MAX_MESSAGE_BYTES, READ_BYTES

    cfg = check.cfg
    async with trio.open_nursery() as nursery:
        server = await nursery.start(functools.partial(
            serve_websocket, check.handle, cfg.host, cfg.port, None, max_message_size=MAX_MESSAGE_BYTES,
            receive_buffer_size=READ_BYTES, message_queue_size=4, disconnect_timeout=5))
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        check.url = f"ws://{host}:{server.port}"
        say_url(check.url)
        if cfg.worker_cmd is not None:
            argv = [a.replace("{url}", check.url) for a in shlex.split(cfg.worker_cmd)]
            with open(cfg.worker_log, "wb") as log:
                check.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            await check.run(nursery)
        finally:
            check.done.set()
            nursery.cancel_scope.cancel()


def run_check(model: pathlib.Path, *, host: str = "127.0.0.1", port: int = 0, worker_cmd: str | None = None,
              worker_log: pathlib.Path | None = None, timeout_s: float = 120.0, seed: int = 0,
              say: Callable[[StepResult], None] = lambda r: None,
              say_url: Callable[[str], None] = lambda u: None) -> tuple[list[StepResult], dict[str, object]]:
    """Serve one worker session and run every step. Returns ``(results, worker)``: a result per
    step in ``STEPS`` order, and what the worker said of itself. ``say`` gets each result as it
    is known, ``say_url`` the URL to dial. With ``worker_cmd`` ({url} replaced), the worker is
    started after the server is up and stopped (SIGTERM, then SIGKILL after 10 s) at the end;
    its output goes to ``worker_log`` (a temporary file when None)."""
    with tempfile.TemporaryDirectory(prefix="kvasir-conformance-") as tmp:
        cfg = _Config(model, host, port, worker_cmd, worker_log or pathlib.Path(tmp) / "worker.log", timeout_s, seed)
        check = _Check(cfg, say)
        try:
            trio.run(_serve_and_check, check, say_url)
        finally:
            _stop(check.proc)
        done = {r.step for r in check.results}
        for name in STEPS:
            if name not in done:
                check.record(StepResult(name, SKIP, check.skipped()))
        order = {name: i for i, name in enumerate(STEPS)}
        results = sorted(check.results, key=lambda r: order[r.step])
    hello = check.hello
    worker: dict[str, object] = {} if hello is None else {
        "wallet": hello.wallet, "device": hello.device, "model_type": hello.model_type,
        "worker_version": hello.worker_version, "weights_digest": hello.weights_digest.hex(),
        "slices": {str(k): list(v) for k, v in hello.slices.items()}}
    return results, worker


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


# -- the command line --------------------------------------------------------------------


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``conformance`` to the ``kvasir`` command's subparsers."""
    from kvasir_rpc import HelpFormatter, hostport

    p: argparse.ArgumentParser = subparsers.add_parser(
        "conformance", help="act as a hub and check a worker implementation step by step", formatter_class=HelpFormatter,
        description="Act as a hub (a ws:// server) that one worker dials, and check it against the tunnel "
                    "protocol: upgrade, handshake, digest, control sequence, Describe, Dispatch (numbers "
                    "against the reference kernel), errors, close, reconnect, keepalive. Exit 0 only if every "
                    "step passes.")
    p.add_argument("--model", required=True, type=pathlib.Path, help="the checkpoint folder the worker serves")
    p.add_argument("--listen", type=hostport(), default="127.0.0.1:0", metavar="HOST:PORT",
                   help="where the worker dials (port 0: a free one; the URL is printed)")
    p.add_argument("--worker-cmd", metavar="CMD",
                   help="start the worker with this command line, {url} replaced by the URL to dial; it is "
                        "stopped at the end (e.g. 'python -m worker --hub {url} --model M --wallet w.key')")
    p.add_argument("--worker-log", type=pathlib.Path, help="file for the started worker's output")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds to wait for the worker to dial (its start-up included)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random Dispatch inputs")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=run)
    return p


def _line(r: StepResult) -> str:
    text = f"{r.status}  {r.step:<10} {r.detail}"
    return "\n".join([text, *(f"      note: {n}" for n in r.notes)])


def run(args: argparse.Namespace) -> int:
    """``kvasir conformance``: 0 if every step passed, 1 if any failed, 2 for unusable arguments."""
    from kvasir_rpc import CheckpointError

    if args.worker_cmd is not None and "{url}" not in args.worker_cmd:
        print("kvasir conformance: --worker-cmd must contain {url}, where the worker's hub URL goes", file=sys.stderr)
        return 2
    out = sys.stderr if args.json else sys.stdout

    def say(r: StepResult) -> None:
        print(_line(r), file=out, flush=True)

    def say_url(url: str) -> None:
        print(f"listening: a worker should dial {url}" + ("" if args.worker_cmd else " (e.g. python -m worker "
              f"--hub {url} --model {args.model} --wallet w.key)"), file=out, flush=True)

    host, port = args.listen
    try:
        results, worker = run_check(args.model, host=host, port=port, worker_cmd=args.worker_cmd,
                                    worker_log=args.worker_log, timeout_s=args.timeout, seed=args.seed,
                                    say=say, say_url=say_url)
    except CheckpointError as exc:
        print(f"kvasir conformance: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvasir conformance: {exc}", file=sys.stderr)
        return 2
    passed = all(r.status == PASS for r in results)
    failed = [r.step for r in results if r.status == FAIL]
    if args.json:
        print(json.dumps({"passed": passed, "steps": [r.to_json() for r in results], "worker": worker}))
    else:
        print(f"conformance: {'PASSED' if passed else 'FAILED'}: "
              f"{sum(r.status == PASS for r in results)} of {len(results)} steps passed"
              + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 0 if passed else 1
