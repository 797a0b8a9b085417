"""The steps of ``kvasir conformance`` and their table (``_TABLE``: names, order, time limits,
what each needs). Each step is a function of the run (``_Run``: the hub side, the config, the
checkpoint that judges the worker, the gRPC channel to the spliced target) that returns its
detail and notes, or raises _StepFailed with what the worker got wrong; ``_Run.step`` times it
and records its result, and ``run_steps`` walks the table."""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import trio

from kvasir.conformance._calls import _Call, _make_call, plan_calls
from kvasir.conformance._hub import _closed_words, _Config, _HubSide
from kvasir.conformance._judge import judge_partials, judge_projections
from kvasir.conformance._results import FAIL, PASS, SKIP, StepResult, _StepFailed

if TYPE_CHECKING:
    import grpc

# How long the worker must stay silent after the handshake for the idle step.
IDLE_WATCH_S = 0.5
# A gRPC call through the tunnel (a tiny model answers in milliseconds; a large expert on a
# slow CPU in well under this).
CALL_TIMEOUT_S = 30.0
# From "open" to the first HTTP/2 bytes of the worker's gRPC server.
OPEN_TIMEOUT_S = 10.0


class _Run:
    """What every step is given: the hub side, the config, the checkpoint (its experts, and
    what it says each expert computes) and, from ``open`` to ``close``, the gRPC channel to the
    spliced target. It runs each step and records the results."""

    def __init__(self, cfg: _Config, say: Callable[[StepResult], None]) -> None:
        from kvasir_rpc import ExpertIndex

        self.cfg = cfg
        self.say = say
        self.experts = ExpertIndex(cfg.model)
        self.function = self.experts.function  # what the checkpoint says each expert computes
        self.hub = _HubSide(cfg)
        self.results: list[StepResult] = []
        self.channel: grpc.Channel | None = None

    def record(self, result: StepResult) -> None:
        self.results.append(result)
        self.say(result)

    async def step(self, step: _Step) -> bool:
        """Run one step under its limit; a step raising _StepFailed, timing out or (a
        ``session`` step) cut short by the end of the session fails. A session step is skipped
        once the session is over; the first after an end no step saw fails with its reason."""
        from kvasir_rpc import WsClosed

        hub, name, limit_s = self.hub, step.name, step.limit()
        if step.session and hub.fatal is not None:
            if hub.fatal_reported:
                self.record(StepResult(name, SKIP, hub.skipped()))
            else:
                hub.fatal_reported, hub.ended_at = True, name
                self.record(StepResult(name, FAIL, hub.fatal))
            return False
        t0 = time.monotonic()
        status, notes = FAIL, list[str]()
        with trio.CancelScope() as scope:
            if step.session:
                hub.scope = scope
            try:
                with trio.fail_after(limit_s):
                    detail, notes = await step.body(self)
                status = PASS
            except _StepFailed as exc:
                detail = str(exc)
            except trio.TooSlowError:
                detail = f"not done within {limit_s:g} s"
            except WsClosed as exc:
                await hub.end(_closed_words(exc))
                detail = hub.fatal or ""
        hub.scope = None
        if scope.cancelled_caught:
            detail = hub.fatal or "stopped"
        result = StepResult(name, status, detail, notes, round(time.monotonic() - t0, 3))
        if hub.fatal is not None and hub.fatal_reported and hub.ended_at is None:
            hub.ended_at = name
        self.record(result)
        return status == PASS

    def calls(self) -> list[_Call]:
        """The dispatch step's calls, planned from the hello."""
        hello = self.hub.hello
        assert hello is not None
        info = self.experts.info
        return plan_calls(hello.slices, info.hidden_size, info.dtype, self.cfg.seed, hello.projections)


async def _call(fn: Callable[[], Any]) -> Any:
    """A blocking gRPC call, in a thread."""
    return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)


def _status(exc: Any) -> str:
    return f"{exc.code().name}: {exc.details()}"


def _tail(path: pathlib.Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


# -- the steps, in the table's order --------------------------------------------------------


async def _upgrade(run: _Run) -> bool:
    """The worker dials and upgrades (judged as it dials, by ``_HubSide.handle``): wait for it,
    or for the worker command to exit, or for the time to dial to run out."""
    hub, cfg = run.hub, run.cfg
    deadline = trio.current_time() + cfg.timeout_s
    t0 = time.monotonic()
    while not hub.dialled.is_set():
        code = hub.proc.poll() if hub.proc is not None else None
        if code is not None:
            hub.fatal = f"the worker command exited with code {code} before dialling {hub.url}"
            hub.ended_at = "upgrade"
            run.record(StepResult("upgrade", FAIL, f"{hub.fatal}; its output ends:\n{_tail(cfg.worker_log)}"))
            return False
        if trio.current_time() > deadline:
            hub.fatal = f"no worker dialled {hub.url} within {cfg.timeout_s:g} s"
            hub.ended_at = "upgrade"
            run.record(StepResult("upgrade", FAIL, hub.fatal))
            return False
        with trio.move_on_after(0.1):
            await hub.dialled.wait()
    assert hub.upgrade is not None
    hub.upgrade.seconds = round(time.monotonic() - t0, 3)
    run.record(hub.upgrade)
    if hub.upgrade.status != PASS:
        hub.fatal, hub.ended_at = "the WebSocket upgrade failed", "upgrade"
        return False
    return True


async def _handshake(run: _Run) -> tuple[str, list[str]]:
    from kvasir_rpc import format_slices

    info = await run.hub.handshake()
    notes = []
    model_type = run.experts.info.model_type
    if info.model_type != model_type:
        notes.append(f"the hello says model_type {info.model_type!r}, the checkpoint {model_type!r}")
    n = sum(len(e) for e in info.slices.values())
    return (f"wallet {info.wallet[:16]}…, device {info.device!r}, version {info.worker_version!r}; "
            f"{n} experts in {len(info.slices)} layers ({format_slices(info.slices)})"), notes


async def _idle(run: _Run) -> tuple[str, list[str]]:
    # A message now is a violation: the reader ends the session and this step with it.
    await trio.sleep(IDLE_WATCH_S)
    return f"nothing sent while no connection was open ({IDLE_WATCH_S:g} s watched)", []


async def _digest(run: _Run) -> tuple[str, list[str]]:
    hello = run.hub.hello
    assert hello is not None
    want, missing = await trio.to_thread.run_sync(_checkpoint_digest, run, hello.slices, abandon_on_cancel=True)
    if missing:
        raise _StepFailed(f"the hello announces {len(missing)} experts the checkpoint does not have, "
                          f"e.g. (layer, expert) {missing[:4]}")
    got = hello.weights_digest
    why = _other_function(run)
    if why:
        raise _StepFailed(why)
    if got != want:
        raise _StepFailed(
            f"announced digest {got.hex()}, the checkpoint's digest of the announced slices is {want.hex()}: "
            "the backbone will not route to these experts and computes them itself. Per expert, sha256 over "
            "(dtype, shape, raw bytes) of gate_up [2I, H] then down [H, I]; then sha256 of "
            "'kvasir.v1.weights\\0' and, by ascending (layer, expert), u32le layer, u32le expert, digest")
    return f"{got.hex()[:16]}… equals the checkpoint's digest of the announced slices", []


def _other_function(run: _Run) -> str:
    """Why the hello's expert function is not the checkpoint's ("" when it is)."""
    from kvasir_rpc import announced_mismatch, function_pb2

    hello = run.hub.hello
    assert hello is not None
    raw = hello.expert_function
    why = announced_mismatch(function_pb2.ExpertFunction.FromString(raw) if raw else None, run.function)
    return (f"{why} (HelloBody.expert_function, PROTOCOL.md 11.2): a backbone will not route to this worker"
            if why else "")


def _checkpoint_digest(run: _Run, slices: Mapping[int, Sequence[int]]) -> tuple[bytes, list[tuple[int, int]]]:
    from kvasir_rpc import slices_digest

    keys = [(layer, e) for layer, experts in sorted(slices.items()) for e in experts]
    missing = [k for k in keys if not run.experts.has(*k)]
    if missing:
        return b"", missing
    return slices_digest({k: run.experts.expert_digest(*k) for k in keys}), []


async def _open(run: _Run) -> tuple[str, list[str]]:
    import grpc

    hub, channel = run.hub, run.channel
    assert channel is not None
    ready = grpc.channel_ready_future(channel)  # starts connecting
    try:
        with trio.fail_after(OPEN_TIMEOUT_S):
            await hub.opened.wait()
    except trio.TooSlowError:
        raise _StepFailed("internal: the gRPC client did not reach the local listener") from None
    t0 = time.monotonic()
    try:
        with trio.fail_after(OPEN_TIMEOUT_S):
            await hub.first_data.wait()
    except trio.TooSlowError:
        # Nothing after this can be judged: every other step needs the connection.
        await hub.end(f"no HTTP/2 bytes within {OPEN_TIMEOUT_S:g} s of 'open': on 'open' a worker dials "
                      "its gRPC server and copies its bytes into binary messages")
        raise _StepFailed(hub.fatal) from None
    first_ms = (time.monotonic() - t0) * 1000
    try:
        await trio.to_thread.run_sync(ready.result, OPEN_TIMEOUT_S, abandon_on_cancel=True)
    except grpc.FutureTimeoutError:
        raise _StepFailed(f"bytes came back after 'open' but no HTTP/2 connection was up within "
                          f"{OPEN_TIMEOUT_S:g} s: are they the bytes of a gRPC server?") from None
    return f"first HTTP/2 bytes {first_ms:.1f} ms after 'open'; the gRPC channel is READY", []


async def _describe(run: _Run) -> tuple[str, list[str]]:
    import grpc

    from kvasir_rpc import DTYPE_TO_WIRE, expert_pb2, expert_pb2_grpc, slices_from_proto

    stub = expert_pb2_grpc.ExpertServiceStub(run.channel)
    try:
        resp = await _call(lambda: stub.Describe(expert_pb2.DescribeRequest(), timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as exc:
        raise _StepFailed(f"Describe failed: {_status(exc)}") from None
    hello = run.hub.hello
    assert hello is not None
    info, wrong = run.experts.info, []
    try:
        slices = slices_from_proto(resp.slices)
    except ValueError as exc:
        slices = {}
        wrong.append(f"slices: {exc}")
    if slices and slices != hello.slices:
        wrong.append("slices differ from the hello's")
    if resp.weights_digest != hello.weights_digest:
        wrong.append(f"weights_digest {resp.weights_digest.hex()[:16]}… is not the hello's "
                     f"{hello.weights_digest.hex()[:16]}…")
    if resp.wallet != hello.wallet:
        wrong.append(f"wallet {resp.wallet[:16]!r} is not the hello's {hello.wallet[:16]}…")
    if resp.hidden_size != info.hidden_size:
        wrong.append(f"hidden_size {resp.hidden_size}, the checkpoint's is {info.hidden_size}")
    if resp.dtype != DTYPE_TO_WIRE.get(info.dtype):
        wrong.append(f"dtype {resp.dtype}, the checkpoint's is {info.dtype}")
    if wrong:
        raise _StepFailed("Describe disagrees: " + "; ".join(wrong))
    return f"agrees with the hello (device {resp.device!r}, hidden_size {resp.hidden_size}, {info.dtype})", []


async def _dispatch(run: _Run) -> tuple[str, list[str]]:
    import grpc

    from kvasir_rpc import TensorCodecError, decode_tensor, expert_pb2_grpc

    stub = expert_pb2_grpc.ExpertServiceStub(run.channel)
    calls = run.calls()
    plain = [c for c in calls if c.row_index is None]
    packed = [c for c in calls if c.row_index is not None]
    notes: list[str] = []
    answers: dict[int, Any] = {}
    try:  # the plain calls on one stream, as the backbone streams many calls
        for resp in await _call(lambda: list(stub.Dispatch(iter([c.request for c in plain]),
                                                           timeout=CALL_TIMEOUT_S))):
            cid = resp.partials.call_id
            if cid in answers or cid not in {c.request.call_id for c in plain}:
                raise _StepFailed(f"an answer with call_id {cid}, which was {'answered already' if cid in answers else 'never sent'}")
            answers[cid] = resp.partials
    except grpc.RpcError as exc:
        raise _StepFailed(f"Dispatch of {len(plain)} well-formed calls failed: {_status(exc)}") from None
    for c in packed:
        try:
            got = await _call(lambda: list(stub.Dispatch(iter([c.request]), timeout=CALL_TIMEOUT_S)))
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
        ok, note = await trio.to_thread.run_sync(judge_partials, c, out, run.experts, run.function,
                                                 abandon_on_cancel=True)
        if not ok:
            raise _StepFailed(note)
        if note:
            notes.append(note)
        if c.request.projections:
            ok, note = await trio.to_thread.run_sync(judge_projections, c, out, answers[c.request.call_id],
                                                     run.experts, run.function, abandon_on_cancel=True)
            if not ok:
                raise _StepFailed(note)
    hello = run.hub.hello
    assert hello is not None
    if not hello.projections:
        notes.append("the hello does not announce projections: a backbone checks this worker by sampled audits "
                     "alone, at a higher rate (PROTOCOL.md 11.1, 13); announce them and return them when asked")
    rows = sum(int(c.request.weights.shape[0]) for c in judged)
    verdict = ("within the audit bound of the reference kernel, not bitwise" if any(
        "not bit-exact" in n for n in notes) else "bitwise equal to the reference kernel (bit-exact)")
    if hello.projections:
        verdict += ", and its projections pass the row checks"
    return (f"{len(judged)} calls, {rows} assignment rows of layer {judged[0].layer}, experts "
            f"{sorted({e for c in judged for e, _ in c.segments})}: every row {verdict}"), notes


async def _errors(run: _Run) -> tuple[str, list[str]]:
    import grpc
    import torch

    from kvasir_rpc import expert_pb2, expert_pb2_grpc

    hub = run.hub
    stub = expert_pb2_grpc.ExpertServiceStub(run.channel)
    good = run.calls()[1]  # one row through one expert
    layer = good.layer
    short = expert_pb2.DispatchRequest()
    short.CopyFrom(good.request)
    short.call_id = 11
    short.hidden.data = short.hidden.data[:-1]
    nan = _make_call("NaN rows", 12, layer, torch.full_like(good.hidden, float("nan")), good.weights,
                     good.segments).request
    held = set(hub.hello.slices.get(layer, ())) if hub.hello else set()
    absent = next(e for e in range(run.experts.info.num_experts + 1) if e not in held)
    unknown = _make_call("unknown expert", 13, layer, good.hidden, good.weights, [(absent, 1)]).request
    cases = [
        ("hidden one byte short of its shape", short, grpc.StatusCode.INVALID_ARGUMENT),
        ("hidden rows of NaN", nan, grpc.StatusCode.INVALID_ARGUMENT),
        (f"layer {layer} expert {absent}, which it did not announce", unknown, grpc.StatusCode.FAILED_PRECONDITION),
    ]
    opens, eofs = hub.opens, hub.eofs
    seen = []
    for what, req, code in cases:
        try:
            got = await _call(lambda: list(stub.Dispatch(iter([req]), timeout=CALL_TIMEOUT_S)))
        except grpc.RpcError as exc:
            if exc.code() != code:
                raise _StepFailed(f"a call with {what}: expected status {code.name}, got {_status(exc)}") from None
            seen.append(code.name)
            continue
        raise _StepFailed(f"a call with {what} was answered ({len(got)} responses); expected status {code.name}")
    try:
        await _call(lambda: stub.Describe(expert_pb2.DescribeRequest(), timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as exc:
        raise _StepFailed(f"after the refused calls, Describe failed: {_status(exc)}") from None
    if hub.eofs != eofs or hub.opens != opens:
        raise _StepFailed("the worker ended the HTTP/2 connection ('eof') after a refused call: a bad call "
                          "ends its own stream only")
    return (f"{len(cases)} malformed calls refused ({', '.join(seen)}); the same connection then answered "
            "Describe"), []


async def _close(run: _Run) -> tuple[str, list[str]]:
    # Ending the client's connection makes the splice send "close" (as the hub does when the
    # backbone's connection ends); the splice ends the session if "closed" is late.
    channel = run.channel
    assert channel is not None
    await _call(channel.close)
    await run.hub.closed.wait()
    return _closed_detail(run.hub), []


def _closed_detail(hub: _HubSide) -> str:
    ms = (trio.current_time() - hub.close_sent_at) * 1000
    return f"'closed' {ms:.1f} ms after 'close'; {hub.discarded} late bytes discarded"


async def _reconnect(run: _Run) -> tuple[str, list[str]]:
    import grpc

    from kvasir_rpc import expert_pb2, expert_pb2_grpc

    hub = run.hub
    opens = hub.opens
    channel = hub.channel()
    try:
        stub = expert_pb2_grpc.ExpertServiceStub(channel)
        try:
            await _call(lambda: stub.Describe(expert_pb2.DescribeRequest(), timeout=CALL_TIMEOUT_S))
        except grpc.RpcError as exc:
            raise _StepFailed(f"Describe on a second connection failed: {_status(exc)}") from None
        if hub.opens != opens + 1:
            raise _StepFailed(f"internal: expected one new connection, saw {hub.opens - opens}")
    finally:
        await _call(channel.close)
    await hub.closed.wait()
    return f"a second 'open' served Describe on a fresh HTTP/2 connection; {_closed_detail(hub)}", []


async def _keepalive(run: _Run) -> tuple[str, list[str]]:
    from kvasir_rpc.protocol import KEEPALIVE_TIMEOUT_S, RemoteProtocolError

    hub = run.hub
    assert hub.ws is not None
    try:
        with trio.fail_after(KEEPALIVE_TIMEOUT_S):
            rtt_s = await hub.ws.ping_and_wait()
    except trio.TooSlowError:
        raise _StepFailed(f"no pong within {KEEPALIVE_TIMEOUT_S:g} s of a ping (a hub closes 1001)") from None
    detail = f"pong after {rtt_s * 1000:.1f} ms"
    if hub.heartbeat is None:
        return detail, []
    try:
        await hub.heartbeat.check(KEEPALIVE_TIMEOUT_S)
    except RemoteProtocolError as exc:
        raise _StepFailed(f"{exc.reason} (a hub closes {exc.close_code}; an encrypted session's liveness is "
                          "the sealed heartbeat, docs/PROTOCOL.md 4.5)") from None
    assert hub.heartbeat.rtt_s is not None
    return f"{detail}; sealed heartbeat acknowledged after {hub.heartbeat.rtt_s * 1000:.1f} ms", []


# -- the table -------------------------------------------------------------------------------


def _close_limit() -> float:
    from kvasir_rpc.protocol import CLOSE_TIMEOUT_S  # read when the step runs (tests shorten it)

    return CLOSE_TIMEOUT_S + 5.0


@dataclasses.dataclass(frozen=True)
class _Step:
    """A row of the table. ``limit_s``: seconds the step may take (a function is asked when the
    step runs). ``session``: the end of the session cuts the step short, and skips it once over
    (the digest is the checkpoint's business, judged whatever happens). ``required``: the run
    stops when it does not pass. ``reads``: from this step on, the tunnel reader runs.
    ``channel``: the step uses the gRPC channel to the spliced target, opened (the target served)
    before the first such step and closed after the last."""

    name: str
    body: Callable[[_Run], Awaitable[tuple[str, list[str]]]]
    limit_s: float | Callable[[], float]
    session: bool = True
    required: bool = False
    reads: bool = False
    channel: bool = False

    def limit(self) -> float:
        return self.limit_s() if callable(self.limit_s) else self.limit_s


# Every step after the upgrade (``_upgrade``: the worker dials), in the order they run and are
# reported.
_TABLE = (
    _Step("handshake", _handshake, 30.0, required=True),
    _Step("idle", _idle, 10.0, reads=True),
    _Step("digest", _digest, 3600.0, session=False),
    _Step("open", _open, OPEN_TIMEOUT_S + 10, channel=True),
    _Step("describe", _describe, CALL_TIMEOUT_S + 5, channel=True),
    _Step("dispatch", _dispatch, 4 * CALL_TIMEOUT_S, channel=True),
    _Step("errors", _errors, 5 * CALL_TIMEOUT_S, channel=True),
    _Step("close", _close, _close_limit, channel=True),
    _Step("reconnect", _reconnect, lambda: CALL_TIMEOUT_S + _close_limit()),
    _Step("keepalive", _keepalive, 15.0),
)
STEPS = ("upgrade", *(s.name for s in _TABLE))


async def run_steps(run: _Run, nursery: trio.Nursery) -> None:
    """Every step in the table's order, then the end of the session (as a hub ends one) if the
    steps did not end it; the hub side's tasks (the tunnel reader, the target) in ``nursery``."""
    hub = run.hub
    if not await _upgrade(run):
        return
    channel_done = False
    try:
        for step in _TABLE:
            if step.reads:
                nursery.start_soon(hub.read)
            if step.channel and run.channel is None and not channel_done:
                target_port = await nursery.start(hub.serve_target)
                hub.target = f"127.0.0.1:{target_port}"
                run.channel = hub.channel()
            elif not step.channel and run.channel is not None:
                run.channel.close()
                run.channel, channel_done = None, True
            if not await run.step(step) and step.required:
                return
    finally:
        if run.channel is not None:
            run.channel.close()
    if hub.fatal is None:
        hub.finishing = True
        await hub.end("conformance check done", 1000)
