"""Stragglers against real processes: a hub, a ledger, an honest worker and a slow one on
127.0.0.1. A late call is computed here and its answer dropped unpaid; the decode stays
bitwise equal to local and does not wait the call timeout."""

from __future__ import annotations

import json
import pathlib
import signal
import urllib.request

import pytest
from helpers import swarm_with_dishonest

from kvasir.swarm import LocalSwarm

# Integration: real swarms with a straggling worker.
pytestmark = pytest.mark.integration

STALLER = str(pathlib.Path(__file__).with_name("stall_worker.py"))
DECODE = ["--prompt", "who waits for the slow", "--batch", "2", "--max-new-tokens", "12", "--compare-local",
          "--wait-sessions", "2"]
# The call timeout a stalled call waited before deadlines followed round trips: the decode
# must take far less than one of them.
CALL_TIMEOUT_S = 30.0


def _swarm_with_staller(sw: LocalSwarm, model, stall: list[str]):  # type: ignore[no-untyped-def]
    """Ledger, hub, an honest worker on experts 4-7 and a staller on 0-3; their sessions."""
    return swarm_with_dishonest(sw, model, "staller", (STALLER, *stall, "--"), http=True)


@pytest.mark.parametrize("stall", [[], ["--after", "12", "--seconds", "4"]],
                         ids=["never-answers", "answers-4s-late-after-12-calls"])
def test_a_straggler_is_hedged_and_its_late_answers_are_not_paid(stall, tiny_models, tmp_path):
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path) as sw:
        staller, honest = _swarm_with_staller(sw, model, stall)
        try:
            result = sw.run_backbone(["--model", str(model), *DECODE], timeout=300)
            # Exact: every logit equals the local run's, bit for bit.
            assert result["backbone_exit_code"] == 0, result
            assert result["tokens_identical"] is True and result["max_abs_logit_diff"] == 0.0
            # Late calls were computed here at their deadlines, not after the call timeout;
            # after a few misses in a row the straggler is no longer waited on at all.
            assert result["hedged_calls"] >= 1 and result["fallback_calls"] == 0, result
            assert result["seconds"] < CALL_TIMEOUT_S * 2 / 3, result
            assert honest.session_id in result["sessions_used"]
            assert result["sessions_quarantined"] == []  # slow is not dishonest
            work = result["work"]
            if stall:
                # Its first 12 calls were answered in time and paid; the 13th (honest,
                # 4 s late) came back and was dropped.
                assert staller.session_id in result["sessions_used"]
                assert 0 < work[staller.session_id]["calls"] <= 12  # type: ignore[index]
                assert result["late_answers_dropped"] >= 1
            else:
                assert staller.session_id not in result["sessions_used"]
                # Nothing of it accepted; only the rows computed here instead are on its tally.
                assert work[staller.session_id]["bytes"] == work[staller.session_id]["calls"] == 0  # type: ignore[index]
            live = {s.session_id: s for s in sw.list_sessions()}
            # The hub's page shows whose rows the backbone computed itself: the staller's late
            # ones, as its fallback share; none of the honest worker's.
            with urllib.request.urlopen(sw.status_url + "api/status", timeout=10) as r:
                page = {s["session_id"]: s for s in json.load(r)["sessions"]}
            assert page[staller.session_id]["fallback_rows"] == result["hedged_rows"] > 0, (page, result)
            assert page[honest.session_id]["fallback_rows"] == 0
            rows = work.get(staller.session_id, {}).get("rows", 0)  # type: ignore[attr-defined]
            assert page[staller.session_id]["fallback_share"] == round(
                result["hedged_rows"] / (rows + result["hedged_rows"]), 4)
            credited = sw.wait_credited(list(live.values()))
            # Paid what the backbone accepted, nothing for the late answers.
            for sid in (staller.session_id, honest.session_id):
                accepted = work.get(sid, {}).get("bytes", 0)  # type: ignore[attr-defined]
                assert credited[sid] == live[sid].work_bytes == accepted
        finally:
            # It may be asleep in a call: a drain would wait on it.
            sw.stop_process("staller", sig=signal.SIGKILL)


def test_honest_workers_are_never_hedged(two_worker_swarm):
    sw = two_worker_swarm  # honest workers on experts 0-3 and 4-7, shared with test_swarm.py
    result = sw.run_backbone(["--model", str(sw.model), *DECODE, "--groups", "2"])
    assert result["backbone_exit_code"] == 0 and result["max_abs_logit_diff"] == 0.0
    assert result["hedged_calls"] == 0 and result["late_answers_dropped"] == 0
    assert result["fallback_calls"] == 0 and len(result["sessions_used"]) == 2
