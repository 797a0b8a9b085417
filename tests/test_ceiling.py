"""The fabric-free ceiling (backbone/experts/_ceiling.py, ``generate --ceiling-worker``): workers
emulated in this process answer with the worker's kernel, after the round trip emulated half
each way, and a decode whose experts go to them through the Dispatcher's remote path (row
checks, audits and micro-batch groups included) is bitwise the local decode.

In process, on the tiny checkpoint; the round trip is checked on a fake clock."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from backbone.experts._ceiling import EmulatedLink, EmulatedRoundTrip, EmulatedSwarm, EmulatedWorker
from backbone.experts._deadlines import StragglerPolicy
from backbone.experts._links import ComputedPartials, DispatchCall
from kvasir_rpc import ExpertIndex, expert_forward_projections


class _FakeClock:
    """A clock that stands still at ``now``; ``wait_until`` records what it was asked to wait for."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.waits: list[float] = []
        self._lock = threading.Lock()

    def clock(self) -> float:
        return self.now

    def wait_until(self, t: float) -> None:
        with self._lock:
            self.waits.append(t)


def _call(index: ExpertIndex, layer: int, experts: list[int], rows: int, *, dedupe: bool) -> DispatchCall:
    g = torch.Generator().manual_seed(layer * 100 + rows)
    hidden = torch.randn(rows, index.info.hidden_size, generator=g, dtype=index.info.dtype)
    segments = [(e, rows) for e in experts]
    assignments = rows * len(experts)
    weights = torch.rand(assignments, generator=g, dtype=index.info.dtype)
    if dedupe:  # every expert gets the same rows: each travels once
        return DispatchCall(layer, hidden, weights, segments, list(range(rows)) * len(experts), True)
    return DispatchCall(layer, hidden.repeat(len(experts), 1), weights, segments, (), False)


@pytest.mark.parametrize("dedupe", [True, False])
def test_an_emulated_worker_answers_with_the_workers_kernel_after_half_the_round_trip_each_way(
        tiny_models, dedupe: bool) -> None:  # type: ignore[no-untyped-def]
    index = ExpertIndex(tiny_models("qwen3_moe"))
    fake = _FakeClock(100.0)
    trip = EmulatedRoundTrip(0.05, clock=fake.clock, wait_until=fake.wait_until)
    linux = hasattr(os, "sched_getaffinity")
    mine = os.sched_getaffinity(0) if linux else set()
    cpus = frozenset({max(mine)}) if linux else None
    worker = EmulatedWorker("w", index, "*:1-2", trip, cpus=cpus)
    try:
        link = EmulatedLink(worker)
        call = _call(index, 1, [1, 2], 3, dedupe=dedupe)
        rec = link.submit(6, call, StragglerPolicy())
        answer = rec.future.result(timeout=30)
        if linux:  # both threads run on the cores asked for, the calling thread where it was
            assert all(os.sched_getaffinity(t.native_id or 0) == cpus for t in worker._threads)
            assert os.sched_getaffinity(0) == mine
    finally:
        worker.close()
    # The call reached the worker rtt/2 after it left, the answer came back rtt/2 after it
    # was computed: kvasir.latency's delay, once each way.
    assert fake.waits == [100.0 + 0.025, 100.0 + 0.025]
    assert rec.request_bytes == 0  # nothing serialized
    assert isinstance(answer, ComputedPartials)
    rows = call.rows if not dedupe else call.rows[torch.tensor(call.row_index)]
    want, want_proj = [], []
    for i, e in enumerate((1, 2)):
        gate_up, down = index.load(1, e)
        out, proj = expert_forward_projections(rows[3 * i : 3 * i + 3], gate_up, down, index.function,
                                               call.weights[3 * i : 3 * i + 3])
        want.append(out)
        want_proj.append(proj)
    assert torch.equal(answer.partials, torch.cat(want))
    if dedupe:
        assert answer.projections is not None and torch.equal(answer.projections, torch.cat(want_proj))
    else:
        assert answer.projections is None  # not asked for
    assert worker.session.projections
    assert [tuple(s.experts) for s in worker.session.slices] == [(1, 2)] * index.info.num_layers


def test_a_decode_on_emulated_workers_is_bitwise_the_local_decode(tiny_models) -> None:  # type: ignore[no-untyped-def]
    from backbone.engine._decode import decode_grouped, load_model, prompts_for_batch
    from backbone.experts._dispatch import Dispatcher

    path = tiny_models("qwen3_moe")
    model, tokenizer = load_model(path)
    half = ExpertIndex(path).info.num_experts // 2
    swarm = EmulatedSwarm.load(path, [f"*:0-{half - 1}", f"*:{half}-{2 * half - 1}"], EmulatedRoundTrip(0.002))
    d = Dispatcher(model, swarm)
    try:
        prompts = prompts_for_batch("the ceiling", 6)
        run = decode_grouped(model, tokenizer, prompts, 5, 2)  # two groups in flight at once
        stats = d.statistics()
        d.remote = False
        local = decode_grouped(model, tokenizer, prompts, 5, 2)
    finally:
        d.close()
        swarm.close()
    assert torch.equal(run.new_tokens, local.new_tokens) and torch.equal(run.logits, local.logits)
    # Every routed row went to the emulated workers and was accepted after its row checks.
    assert stats.remote_calls > 0 and stats.local_rows == 0 and stats.fallback_calls == 0
    assert stats.sessions_used == ("ceiling-1", "ceiling-2") and stats.sessions_rejected == ()
    assert stats.row_checked_rows == stats.remote_rows and stats.answers_refused == 0
    assert stats.sent_bytes == 0 and stats.received_bytes == 0  # no wire


def test_the_ceiling_options_are_checked_before_anything_loads(tiny_models, capsys) -> None:  # type: ignore[no-untyped-def]
    from backbone.cli import main

    model = str(tiny_models("qwen3_moe"))
    base = ["generate", "--model", model, "--prompt", "x"]
    for extra, says in ((["--ceiling-rtt", "13"], "are for --ceiling-worker"),
                        (["--ceiling-worker", "*:0-1", "--hub", "127.0.0.1:1"], "without --hub"),
                        (["--ceiling-worker", "*:0-99"], "--ceiling-worker *:0-99"),
                        (["--ceiling-worker", "*:0-1", "--ceiling-cpus", "one"], "CPU numbers")):
        with pytest.raises(SystemExit) as exited:
            main([*base, *extra])
        assert exited.value.code == 2
        assert says in capsys.readouterr().err
