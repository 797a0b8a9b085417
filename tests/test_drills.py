"""Fault drills during one live decode: stop the ledger for a while, restart the hub, restart
the gateway, SIGKILL a worker. The swarm is as in production: the workers and the hub dial a
gateway.

The decode lasts as long as its faults need, not a fixed number of tokens: it starts with a
limit it never reaches; each fault comes while both workers serve it, and the next one only
once remote work has resumed after it and gone on for a while (so the resumed path is really
exercised, on a fast machine and on a busy one alike); then Ctrl-C (SIGINT) ends the decode
and the backbone compares exactly the tokens it decoded with its local run. One decode for
the four faults keeps the drills cheap (each backbone start imports torch and transformers)
and is the harder test: the same decode must come through all of them.

The drills check what a fault must not break: tokens and logits bitwise equal to the local
run; every byte of work the hub counted credited by the ledger exactly once (nothing lost,
nothing twice); remote work resuming without a restart of anything else, on sessions made
after the fault where the fault ended the sessions. Each drill prints the time from the fault
to the next remote work the hub sees (run with -s)."""

from __future__ import annotations

import dataclasses
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable

import pytest
from helpers import trustme_certs, wait_until

from kvasir.swarm import LocalSwarm, free_port
from kvasir_rpc import Wallet

# Integration: a real ledger, gateway, hub, workers and backbone.
pytestmark = pytest.mark.integration

WORKERS = {"worker1": "*:0-3", "worker2": "*:4-7"}
# Every wait is bounded but generous: two busy cores can stall any process for seconds.
START_S = 120.0  # a process or the swarm to come up; the backbone to load and serve both workers
RESUME_S = 90.0  # a fault to remote work resumed and going on: past it the drill fails
SERVED_BYTES = 20_000  # accepted work on each session before a fault: the decode uses both workers
AFTER_BYTES = 100_000  # accepted work after the resumption (some 50 calls) before the next step
LEDGER_DOWN_S = 3.0  # several receipt intervals (0.5 s) signed while the ledger is away
# The decode's own limits, never reached in a passing run: the drills end it with Ctrl-C.
MAX_NEW_TOKENS = 1_000_000
MAX_SECONDS = 600


@dataclasses.dataclass(frozen=True)
class Sessions:
    """The hub's live sessions at one moment: raw bytes from each worker (fast, what shows
    calls flowing) and the accepted work the backbone reported (what receipts pay)."""

    raw: dict[str, int]
    work: dict[str, int]


def _sessions(sw: LocalSwarm) -> Sessions:
    """The hub's live sessions; none while the hub is away or restarting."""
    try:
        listed = sw.list_sessions(timeout=2)
    except Exception:  # noqa: BLE001 - no answer from a hub that restarts is no traffic
        return Sessions({}, {})
    return Sessions({s.session_id: int(s.bytes_from_worker) for s in listed},
                    {s.session_id: int(s.work_bytes) for s in listed})


def _swarm_state(sw: LocalSwarm) -> str:
    alive = {name: proc.poll() for name, proc in sw.procs.items()}
    return f"exit codes (None: running) {alive}; sessions {_sessions(sw)}; logs in {sw.logs}"


@pytest.fixture
def drill_swarm(tiny_models, tmp_path):
    """A ledger, a gateway, a hub (its gRPC port fixed, so that a restarted one is found where
    it was) and two workers through the gateway, each holding half the experts. The workers
    are started, not waited for: the backbone loads meanwhile and waits for them itself."""
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path) as sw:
        trustme_certs(sw.workdir)
        sw.start_ledger()
        sw.start_gateway()
        grpc_port = free_port()
        # End-to-end pings more often than the gateway's idle timeout, as in production.
        hub_extra = ["--grpc", f"127.0.0.1:{grpc_port}", "--keepalive", "0.5"]
        sw.start_hub(gateway=True, receipt_interval=0.5, extra=hub_extra)
        assert sw.hub_grpc_port == grpc_port
        for name, experts in WORKERS.items():
            sw.start_worker(name, model, experts, via="gateway")
        sw.model = model  # type: ignore[attr-defined]
        sw.hub_extra = hub_extra  # type: ignore[attr-defined]
        yield sw


class LiveDecode:
    """One backbone decoding through the swarm until ``stop``; the session ids it met."""

    def __init__(self, sw: LocalSwarm) -> None:
        self.sw = sw
        self.seen: set[str] = set()
        self.recovery: dict[str, float] = {}
        self.marks = {"start": time.monotonic()}
        self.backbone = sw.start_backbone([
            "--model", str(sw.model), "--prompt", "fault drills",  # type: ignore[attr-defined]
            "--max-new-tokens", str(MAX_NEW_TOKENS), "--max-seconds", str(MAX_SECONDS),
            "--compare-local", "--wait-sessions", "2", "--wait-timeout", str(START_S)])

    def sessions(self, during: str) -> Sessions:
        assert self.backbone.poll() is None, f"the backbone ended during the {during}: {_swarm_state(self.sw)}"
        now = _sessions(self.sw)
        self.seen.update(now.raw)
        return now

    def poll(self, what: str, predicate: Callable[[Sessions], bool], *, since: float, bound: float) -> Sessions:
        """Poll the hub until ``predicate``; fail naming ``what`` ``bound`` s after ``since``."""
        while True:
            now = self.sessions(what)
            if predicate(now):
                return now
            assert time.monotonic() - since < bound, f"no {what} within {bound:.0f} s: {_swarm_state(self.sw)}"
            time.sleep(0.02)

    def drill(self, name: str, fault: Callable[[], None], *, serves: Callable[[str, Sessions], bool],
              also_until: Callable[[], bool] = lambda: True) -> Sessions:
        """Once both workers serve the decode, inject ``fault``; measure the time from it to the
        next remote work on a session for which ``serves(session_id, sessions_at_fault)``
        holds; return once such sessions' accepted work grew by AFTER_BYTES more and
        ``also_until()`` holds. Returns the sessions at the fault."""
        self.poll(f"two sessions serving the decode before the {name}", lambda now: len(now.work) >= 2 and all(
            n >= SERVED_BYTES for n in now.work.values()), since=time.monotonic(), bound=START_S)
        at_fault = self.sessions(name)
        t0 = time.monotonic()
        self.marks.setdefault("first fault", t0)
        fault()
        resumed = self.poll(f"remote work after the {name}", lambda now: any(
            serves(sid, at_fault) and n > at_fault.raw.get(sid, 0) for sid, n in now.raw.items()), since=t0, bound=RESUME_S)
        self.recovery[name] = time.monotonic() - t0

        def work(now: Sessions) -> int:
            return sum(n for sid, n in now.work.items() if serves(sid, at_fault))

        base = work(resumed)
        self.poll(f"{AFTER_BYTES} bytes of accepted work after the {name}",
                  lambda now: work(now) - base >= AFTER_BYTES and also_until(), since=t0, bound=RESUME_S)
        print(f"\ndrill {name}: remote work {self.recovery[name]:.3f} s after the fault, "
              f"{AFTER_BYTES} bytes more {time.monotonic() - t0:.3f} s after it")
        return at_fault

    def stop(self) -> dict[str, object]:
        """Ctrl-C: the decode ends after its step and compares what it decoded; its result."""
        self.marks["Ctrl-C"] = time.monotonic()
        self.backbone.send_signal(signal.SIGINT)
        result = self.sw.backbone_result(self.backbone, timeout=300)
        self.marks["result"] = time.monotonic()
        self.seen.update(_sessions(self.sw).raw)
        return result

    def kill(self) -> None:
        """A failed drill: no comparison to wait for (its local steps would take long to compare)."""
        if self.backbone.poll() is None:
            self.backbone.kill()
            try:
                self.backbone.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                pass


def _new(session_id: str, at_fault: Sessions) -> bool:
    """A session made after the fault (a fault that ends every session)."""
    return session_id not in at_fault.raw


def _counted(sw: LocalSwarm) -> dict[str, tuple[str, int]]:
    """(wallet, bytes of work) the hub counted per session, from its contribution store."""
    with sqlite3.connect(sw.workdir / "hub-contrib.sqlite", timeout=10) as db:
        rows = db.execute("SELECT s.session_id, s.wallet, COALESCE(SUM(w.cumulative_bytes), 0) FROM sessions s"
                          " LEFT JOIN work w ON w.session_id = s.session_id GROUP BY s.session_id").fetchall()
    return {sid: (wallet, int(n)) for sid, wallet, n in rows}


def _assert_credited_once(sw: LocalSwarm, seen: set[str], timeout: float = 60.0) -> float:
    """Wait until the ledger credited, for every session in ``seen``, exactly the work the
    hub counted: one credit per receipt seq, deltas that sum to the count. Returns the wait."""
    t0 = time.monotonic()
    state: dict[str, object] = {}

    def settled() -> bool:
        counted = _counted(sw)
        ok = True
        for sid in seen:
            wallet, n = counted.get(sid, ("", -1))
            credits = [c for c in sw.ledger_credits(wallet) if c.session_id == sid] if wallet else []
            seqs = [c.seq for c in credits]
            state[sid] = (n, sum(int(c.bytes) for c in credits), seqs)
            assert len(seqs) == len(set(seqs)), f"a receipt credited twice: {sid} {seqs}"
            ok = ok and n > 0 and sum(int(c.bytes) for c in credits) == n
            ok = ok and (not credits or max(int(c.cumulative_bytes) for c in credits) == n)
        return ok

    try:
        wait_until(settled, timeout, "the ledger to credit every counted byte once")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: (counted, credited, seqs) by session {state}") from None
    return time.monotonic() - t0


# Four drills in one test: the default per-test bound (300 s) fits them on a quiet machine
# with room to spare, not on two cores shared with other suites; the drill's own bounds
# (START_S, RESUME_S) are what fail it with a message.
@pytest.mark.timeout(900)
def test_one_decode_through_ledger_outage_hub_restart_gateway_restart_and_worker_sigkill(drill_swarm):
    sw = drill_swarm
    t_start = time.monotonic()
    decode = LiveDecode(sw)
    timer: threading.Timer | None = None
    try:
        # 1. The ledger killed and, LEDGER_DOWN_S later, started again on its address and
        # database. It is not on the data path: remote work never stops, and the receipts signed
        # meanwhile are credited once it is back (the next drill starts only then).
        ledger_port = sw.ledger_port
        outage: dict[str, float] = {}
        ledger_error: list[BaseException] = []

        def ledger_back() -> None:
            try:
                sw.start_ledger(port=ledger_port, timeout=START_S)
            except BaseException as exc:  # the drill's poll reports it
                ledger_error.append(exc)
                raise
            outage["back"] = time.monotonic() - outage["t"]

        def ledger_is_back() -> bool:
            assert not ledger_error, f"the ledger did not start again on its port: {ledger_error[0]}"
            return "back" in outage

        timer = threading.Timer(LEDGER_DOWN_S, ledger_back)

        def kill_ledger() -> None:
            assert sw.stop_process("ledger", sig=signal.SIGKILL) == -signal.SIGKILL
            outage["t"] = time.monotonic()
            timer.start()

        decode.drill("ledger outage", kill_ledger, serves=lambda sid, at_fault: True, also_until=ledger_is_back)
        print(f"drill ledger outage: down {outage['back']:.2f} s")

        # 2. The hub stopped (SIGTERM: it saves its counters) and started again: it dials the
        # gateway again, the workers come back as new sessions on their own, and the decode
        # watches the new hub and sends them its calls.
        restart: dict[str, float] = {}

        def restart_hub() -> None:
            t = time.monotonic()
            assert sw.stop_process("hub", sig=signal.SIGTERM, timeout=START_S) == 0
            sw.start_hub(gateway=True, receipt_interval=0.5, extra=sw.hub_extra, timeout=START_S)  # type: ignore[attr-defined]
            restart["s"] = time.monotonic() - t

        before_hub = decode.drill("hub restart", restart_hub, serves=_new)
        print(f"drill hub restart: the hub was away {restart['s']:.2f} s")

        # 3. The gateway killed and started again on its port: the hub and the workers dial it
        # again on their own, and the decode sends its calls to the new sessions.
        gateway_port = sw.gateway_port

        def restart_gateway() -> None:
            assert sw.stop_process("gateway", sig=signal.SIGKILL) == -signal.SIGKILL
            sw.start_gateway(port=gateway_port, timeout=START_S)

        before_gateway = decode.drill("gateway restart", restart_gateway,
                                      serves=_new)

        # 4. One worker SIGKILLed: its calls in flight are computed here and the decode goes on
        # with the other worker.
        victim: list[str] = []
        wallet2 = Wallet.load_or_create(sw.workdir / "worker2.wallet").address

        def kill_worker2() -> None:
            victim.extend(s.session_id for s in sw.list_sessions() if s.wallet == wallet2)
            sw.procs["worker2"].kill()

        decode.drill("worker SIGKILL", kill_worker2, serves=lambda sid, at_fault: sid not in victim)
        assert sw.procs["worker2"].wait(timeout=30) == -signal.SIGKILL
        assert len(victim) == 1, victim
        wait_until(lambda: victim[0] not in _sessions(sw).raw, 30, "the hub to drop the killed worker's session")
        result = decode.stop()
    except BaseException:
        decode.kill()
        raise
    finally:
        if timer is not None:
            timer.cancel()
            timer.join(timeout=START_S)

    print(f"drills: one decode of {result['steps']} steps in {result['seconds']} s, {result['remote_calls']} "
          f"remote calls, {result['fallback_calls']} fallback calls; recovery (fault to the next remote work) "
          + ", ".join(f"{k} {v:.3f} s" for k, v in decode.recovery.items())
          + "; backbone " + ", ".join(f"{k} +{v - decode.marks['start']:.1f} s" for k, v in decode.marks.items()))
    assert result["backbone_exit_code"] == 0, result
    assert result["stopped_early"] is True and result["n_tokens"] == result["steps"], result
    assert result["tokens_identical"] is True and result["max_abs_logit_diff"] == 0.0, result
    used = set(result["sessions_used"])  # type: ignore[call-overload]
    assert used - set(before_hub.raw), f"no session made after the hub restart served the decode: {used}"
    assert used - set(before_gateway.raw) - set(before_hub.raw), \
        f"no session made after the gateway restart served the decode: {used}"
    assert victim[0] in used
    # Nothing lost on the way to the ledger: the hub counted exactly the work the backbone
    # accepted from each session (this swarm serves no other run), late reports included (a
    # session's last work can reach a hub restarted meanwhile), and refused none of it.
    # (A session whose calls were all lost is on the tally with its fallback rows and no bytes.)
    accepted = {sid: int(t["bytes"]) for sid, t in result["work"].items() if t["bytes"]}  # type: ignore[attr-defined]
    assert result["work_reported"] is True, result
    assert used <= set(accepted), f"no accepted work for sessions the decode used: {used - set(accepted)}"
    counted = {sid: n for sid, (_, n) in _counted(sw).items()}
    assert {sid: counted.get(sid) for sid in accepted} == accepted, (counted, accepted)
    decode.seen.update(accepted)
    waited = _assert_credited_once(sw, decode.seen)
    print(f"drills: every byte the hub counted, on {len(decode.seen)} sessions, credited once "
          f"{waited:.2f} s after the decode ended; {time.monotonic() - t_start:.1f} s in all")
