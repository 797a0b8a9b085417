"""The decode attempt (backbone/experts/_attempt.py): what taints which pass, how replays are counted
and when the experts concerned go local; then, in process on the tiny checkpoints, that a
decode told to recompute from any pass (the current one, an earlier one, the prompt) returns
tokens and logits bitwise equal to a decode that never replayed, for plain, assisted and
served decoding, and that an engine lane survives what killed it before."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch

from backbone.experts._attempt import LOCAL_AFTER, DecodeAttempt, ReplayNeeded, Untrusted, current_attempt


class FakeDispatcher:
    def __init__(self) -> None:
        self.bad: dict[str, Untrusted] = {}
        self.replays = 0

    def untrusted(self):  # type: ignore[no-untyped-def]
        return self.bad

    def note_replay(self) -> None:
        self.replays += 1


def _done(value: bool) -> concurrent.futures.Future[bool]:
    fut: concurrent.futures.Future[bool] = concurrent.futures.Future()
    fut.set_result(value)
    return fut


def test_a_session_taints_the_passes_from_the_first_that_used_it():
    d = FakeDispatcher()
    a = DecodeAttempt(d)  # type: ignore[arg-type]
    a.used("good")
    a.settle()  # pass 0
    a.used("liar")
    a.used("good")
    a.settle()  # pass 1
    a.used("liar")  # pass 2, first use stays pass 1
    a.check()
    d.bad["liar"] = Untrusted({0: [1, 2]})
    with pytest.raises(ReplayNeeded) as caught:
        a.settle()
    assert caught.value.from_pass == 1
    assert a.passes == 2  # the pass did not settle
    a.replaying(caught.value)
    assert a.passes == 1 and d.replays == 1 and a.rewinds == 1
    a.check()  # the liar's uses from pass 1 on are forgotten
    # A session that is only untrusted later, and that this attempt never used, taints nothing.
    d.bad["other"] = Untrusted({0: [3]})
    a.settle()
    assert a.passes == 2


def test_a_session_caught_by_its_row_checks_taints_only_from_its_first_narrow_pass():
    d = FakeDispatcher()
    a = DecodeAttempt(d)  # type: ignore[arg-type]
    a.used("w")
    a.settle()  # pass 0: its rows passed by a wide margin
    a.used("w", narrow=True)
    a.settle()  # pass 1: narrowly
    a.used("w")
    d.bad["w"] = Untrusted({0: [1]}, narrow_only=True)
    with pytest.raises(ReplayNeeded) as caught:
        a.check()
    assert caught.value.from_pass == 1
    a.replaying(caught.value)
    a.check()  # pass 0 stands
    b = DecodeAttempt(d)  # type: ignore[arg-type]
    b.used("w")
    b.settle()
    b.check()  # never narrow: nothing to recompute


def test_settle_waits_for_the_pass_audits_and_an_audit_that_could_not_run_raises():
    d = FakeDispatcher()
    a = DecodeAttempt(d)  # type: ignore[arg-type]
    slow: concurrent.futures.Future[bool] = concurrent.futures.Future()
    a.used("s")
    a.audit_pending(slow)
    threading.Timer(0.05, lambda: slow.set_result(True)).start()
    a.settle()
    assert slow.done() and a.passes == 1
    broken: concurrent.futures.Future[bool] = concurrent.futures.Future()
    broken.set_exception(OSError("checkpoint unreadable"))
    a.audit_pending(broken)
    with pytest.raises(OSError):
        a.settle()


def test_replays_of_one_pass_go_local_after_the_limit_and_settling_resets_it():
    d = FakeDispatcher()
    a = DecodeAttempt(d)  # type: ignore[arg-type]
    a.settle()
    for i in range(LOCAL_AFTER):
        assert a.keeps_local(0) == set()
        a.replaying(ReplayNeeded("caught in this pass", from_pass=1))
        assert a.passes == 1 and a.retries == i + 1
    assert a.local_pass and a.keeps_local(0) is None  # the pass computes every expert here
    a.settle()
    assert not a.local_pass and a.keeps_local(0) == set()


def test_rewinds_past_the_limit_keep_the_tainting_sessions_experts_here():
    d = FakeDispatcher()
    a = DecodeAttempt(d)  # type: ignore[arg-type]
    for n in range(LOCAL_AFTER):
        liar = f"liar{n}"  # a fresh identity each time
        a.settle()
        a.used(liar)
        a.settle()
        d.bad[liar] = Untrusted({3: [n, 10]})
        with pytest.raises(ReplayNeeded) as caught:
            a.check()
        a.replaying(caught.value, from_pass=0)  # a decode that can only go back to the prompt
        assert a.passes == 0
    assert a.rewinds == LOCAL_AFTER
    assert a.keeps_local(3) == {LOCAL_AFTER - 1, 10}
    with pytest.raises(ValueError):
        a.replaying(ReplayNeeded("x", from_pass=0), from_pass=1)  # never forward of the taint
    a.restart()
    assert a.keeps_local(3) == set() and a.rewinds == 0


def test_the_attempt_in_force_is_per_thread():
    a = DecodeAttempt(FakeDispatcher())  # type: ignore[arg-type]
    seen: list[object] = []
    with a.active():
        t = threading.Thread(target=lambda: seen.append(current_attempt()))
        t.start()
        t.join()
        assert current_attempt() is a
    assert seen == [None] and current_attempt() is None


# -- in process: replays at chosen passes change nothing ------------------------------------

class _Inject:
    """Wraps DecodeAttempt.settle: at the n-th settle (counted over the test) raise
    ReplayNeeded(from_pass=...) instead of settling, once each."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, plan: dict[int, int | str]) -> None:
        self.plan = dict(plan)
        self.calls = 0
        self.raised = 0
        original = DecodeAttempt.settle
        inject = self

        def settle(attempt: DecodeAttempt) -> None:
            inject.calls += 1
            target = inject.plan.pop(inject.calls, None)
            if target is not None:
                inject.raised += 1
                raise ReplayNeeded("injected", from_pass=attempt.passes if target == "current" else int(target))
            original(attempt)

        monkeypatch.setattr(DecodeAttempt, "settle", settle)


@pytest.mark.integration
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_a_decode_replayed_from_any_pass_equals_one_never_replayed(arch, tiny_models, monkeypatch):
    from backbone.engine._decode import decode, load_model
    from backbone.experts._dispatch import Dispatcher

    model, tokenizer = load_model(tiny_models(arch))
    dispatcher = Dispatcher(model, None)
    prompts = ["the swarm", "a longer prompt for the swarm"]
    straight = decode(model, tokenizer, prompts, 10)
    # Pass 4 is caught in itself; later pass 7 taints from pass 2; then one from the prompt.
    inject = _Inject(monkeypatch, {5: "current", 9: 2, 16: 0})
    replayed = decode(model, tokenizer, prompts, 10)
    assert inject.raised == 3 and dispatcher.statistics().replays == 3
    assert torch.equal(replayed.new_tokens, straight.new_tokens)
    assert torch.equal(replayed.logits, straight.logits)  # bit for bit


@pytest.mark.integration
def test_an_assisted_decode_replayed_from_any_pass_equals_one_never_replayed(tiny_models, monkeypatch):
    from backbone.engine._assist import PromptLookup, decode_assisted
    from backbone.engine._decode import load_model
    from backbone.experts._dispatch import Dispatcher

    model, tokenizer = load_model(tiny_models("qwen3_moe"))
    Dispatcher(model, None)
    prompt = "one two three four one two three four one two"
    straight, _ = decode_assisted(model, tokenizer, prompt, 12, PromptLookup(), k=3)
    inject = _Inject(monkeypatch, {3: "current", 6: 1, 9: 0})
    replayed, _ = decode_assisted(model, tokenizer, prompt, 12, PromptLookup(), k=3)
    assert inject.raised == 3
    assert torch.equal(replayed.new_tokens, straight.new_tokens)
    assert torch.equal(replayed.logits, straight.logits)


def _run_all(engine, requests):  # type: ignore[no-untyped-def]
    streams = [engine.submit(r) for r in requests]
    out = []
    for stream in streams:
        events = []
        while not events or not events[-1].last:
            event = stream.get(timeout=120)
            assert event is not None, "no event within 120 s"
            events.append(event)
        out.append(events)
    return out


@pytest.mark.integration
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_an_engine_lane_replayed_at_any_pass_serves_the_same_tokens(arch, tiny_models, monkeypatch):
    """Replays of a step (the cache cut back, or from the prompts where it cannot be) and a
    replay inside a replay (what killed a lane before) leave every request's tokens and logits
    as they were, and fail none."""
    from backbone.engine._batch import Engine, Request
    from backbone.engine._decode import load_model
    from backbone.experts._dispatch import Dispatcher

    model, tokenizer = load_model(tiny_models(arch))
    requests = [Request(prompt_ids=tuple(tokenizer(f"request {i} to the swarm")["input_ids"]), max_tokens=6,
                        ignore_eos=True, digest_logits=True) for i in range(3)]

    def serve():  # type: ignore[no-untyped-def]
        engine = Engine(model, tokenizer, Dispatcher(model, None), max_batch=3)
        try:
            events = _run_all(engine, requests)
            assert engine.serving()
            return [([t for e in ev for t in e.token_ids], ev[-1].error, ev[-1].summary) for ev in events]
        finally:
            engine.close()

    straight = serve()
    assert all(error is None for _, error, _ in straight)
    # Steps caught in themselves (the 4th and 5th settles) are recomputed as they were: the
    # same logits, bit for bit (where the cache cannot be cut back, from the prompts).
    inject = _Inject(monkeypatch, {4: "current", 5: "current"})
    again = serve()
    assert inject.raised == 2
    for (tokens, error, summary), (want, _, want_summary) in zip(again, straight):
        assert error is None and tokens == want
        if arch == "qwen3_moe":
            assert summary.logits_digest == want_summary.logits_digest
    # The 6th settle taints from the first pass, and so does the 8th, while that replay runs:
    # every row is recomputed alone from its prompt (its logits are the alone decode's).
    inject = _Inject(monkeypatch, {6: 0, 8: 0})
    replayed = serve()
    assert inject.raised == 2
    for (tokens, error, _), (want, _, _) in zip(replayed, straight):
        assert error is None, error
        assert tokens == want


@pytest.mark.integration
def test_a_lane_whose_loop_fails_ends_its_requests_reports_unhealthy_and_restarts(tiny_models, monkeypatch):
    from backbone.engine import _batch as _engine
    from backbone.engine._batch import Engine, Request
    from backbone.engine._decode import load_model
    from backbone.experts._dispatch import Dispatcher

    model, tokenizer = load_model(tiny_models("qwen3_moe"))
    monkeypatch.setattr(_engine, "RESTART_BACKOFF_S", 0.05)
    original = _engine._Lane._advance
    broken = {"n": 1}

    def advance(lane):  # type: ignore[no-untyped-def]
        original(lane)
        if broken["n"]:
            broken["n"] -= 1
            raise KeyboardInterrupt  # not an Exception: escapes the step handler, as a bug in the loop would

    monkeypatch.setattr(_engine._Lane, "_advance", advance)
    monkeypatch.setattr(_engine._Lane, "_loop", _loop_catching_only_exceptions(_engine._Lane._loop))
    engine = Engine(model, tokenizer, Dispatcher(model, None), max_batch=2)
    health: list[bool] = []
    engine.on_health = health.append
    try:
        request = Request(prompt_ids=tuple(tokenizer("hello")["input_ids"]), max_tokens=4, ignore_eos=True)
        [first] = _run_all(engine, [request])
        assert first[-1].error is not None and first[-1].error_kind == "internal"
        # The lane restarted: the next request is served, and health came back.
        [second] = _run_all(engine, [request])
        assert second[-1].error is None and second[-1].summary.completion_tokens == 4
        assert health == [False, True] and engine.serving() and engine.lane_restarts == 1
    finally:
        engine.close()


def _loop_catching_only_exceptions(loop):  # type: ignore[no-untyped-def]
    """The lane's loop, with a KeyboardInterrupt turned into a RuntimeError once it leaves the
    loop (a thread cannot be interrupted from outside; this stands for a bug in the loop)."""
    def wrapped(lane):  # type: ignore[no-untyped-def]
        try:
            return loop(lane)
        except KeyboardInterrupt as exc:
            raise RuntimeError("the lane's loop failed") from exc
    return wrapped
