"""Dishonest workers against real processes: a hub, a ledger, an honest worker, a liar and a
backbone, on 127.0.0.1. Each attack of issue 9's table, then what must still hold: the
decode bitwise equal to local, the liar quarantined and refused, honest credit exact."""

from __future__ import annotations

import pathlib

import pytest
from helpers import swarm_with_dishonest, wait_until

from kvasir.swarm import LocalSwarm

# Integration: real swarms with lying workers.
pytestmark = pytest.mark.integration

LIAR = str(pathlib.Path(__file__).with_name("liar_worker.py"))
DECODE = ["--prompt", "who checks the workers", "--batch", "8", "--max-new-tokens", "40", "--compare-local",
          "--wait-sessions", "2"]


def _credited(sw: LocalSwarm, session) -> int:  # type: ignore[no-untyped-def]
    return sum(int(c.bytes) for c in sw.ledger_credits(session.wallet) if c.session_id == session.session_id)


def _swarm_with_liar(sw: LocalSwarm, model, lie: list[str]):  # type: ignore[no-untyped-def]
    """Ledger, hub, an honest worker on experts 4-7 and a liar on 0-3; their sessions."""
    return swarm_with_dishonest(sw, model, "liar", (LIAR, *lie, "--"))


@pytest.mark.parametrize("lie", [["offset"], ["zeros"], ["nan"], ["offset", "--after", "30"],
                                 ["offset", "--after", "30", "--unchecked"]],
                         ids=["offset", "zeros", "nan", "offset-after-30-calls", "unchecked-offset-after-30-calls"])
def test_liar_is_caught_quarantined_and_the_decode_stays_exact(lie, tiny_models, tmp_path):
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path) as sw:
        liar, honest = _swarm_with_liar(sw, model, lie)
        result = sw.run_backbone(["--model", str(model), *DECODE])
        # Exact after a liar: every logit equals the local run's, bit for bit.
        assert result["backbone_exit_code"] == 0, result
        assert result["tokens_identical"] is True and result["max_abs_logit_diff"] == 0.0
        assert result["sessions_quarantined"] == [liar.session_id]
        assert honest.session_id in result["sessions_used"]
        if "--unchecked" in lie:
            # Right for 30 calls, without row checks: only an audit caught it, after its answers
            # were used, so the decode was recomputed from the first pass that used it.
            assert result["replays"] >= 1
        else:
            # Every row of its answers is checked before use: the lying answer was refused and
            # computed here, and nothing it had answered before needed recomputing.
            assert result["replays"] == 0 and result["answers_refused"] == 1, result
            assert result["row_check_refusals"] == (0 if lie == ["nan"] else 1)  # NaN fails before its rows
            assert result["row_checked_rows"] > 0
        # The hub ended the session with QUARANTINED (4101, permanent): the liar stops, saying why,
        # and is refused should it dial again.
        wait_until(lambda: liar.session_id not in {s.session_id for s in sw.list_sessions()}, 30,
                   "the hub to end the liar's session")
        wait_until(lambda: sw.procs["liar"].poll() is not None, 60, "the liar to stop on its quarantine")
        said = (sw.logs / "liar.log").read_text()
        assert sw.procs["liar"].returncode == 2 and "quarantined" in said and "(close code 4101)" in said, said[-2000:]
        assert [s.session_id for s in sw.list_sessions()] == [honest.session_id]
        assert "session quarantined: wrong work" in (sw.logs / "hub.log").read_text()
        # Honest work is paid exactly; the liar gets nothing after it was caught.
        live = {s.session_id: s for s in sw.list_sessions()}
        sw.wait_credited([live[honest.session_id]])
        assert _credited(sw, honest) == live[honest.session_id].work_bytes > 0
        liar_credit = _credited(sw, liar)
        if lie[0] in ("zeros", "nan") or len(lie) == 1:
            assert liar_credit == 0  # caught on its first call: it never delivered accepted work
        if lie == ["offset"]:
            # A later decode (once: the quarantine is the same whatever the lie) is served by the
            # honest worker alone, and the liar's credit does not move.
            again = sw.run_backbone(["--model", str(model), "--prompt", "after", "--max-new-tokens", "4",
                                     "--wait-sessions", "1"])
            assert again["fallback_calls"] == 0 and again["sessions_quarantined"] == []
            sw.wait_credited([s for s in sw.list_sessions()])
            assert _credited(sw, liar) == liar_credit


def test_padding_and_a_fake_worker_earn_only_accepted_work(tiny_models, tmp_path):
    """The padder answers right but pads every response with 1 MiB: it is paid the expected
    size of what it returned, like an honest worker, not its tunnel bytes."""
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path) as sw:
        padder, honest = _swarm_with_liar(sw, model, ["pad"])
        result = sw.run_backbone(["--model", str(model), "--prompt", "padded", "--batch", "2",
                                  "--max-new-tokens", "8", "--compare-local", "--wait-sessions", "2"])
        assert result["backbone_exit_code"] == 0 and result["max_abs_logit_diff"] == 0.0
        assert result["sessions_quarantined"] == []
        live = {s.session_id: s for s in sw.list_sessions()}
        credited = sw.wait_credited(list(live.values()))
        p, h = live[padder.session_id], live[honest.session_id]
        assert p.bytes_from_worker > 50 * h.bytes_from_worker  # it did send the padding
        assert credited[p.session_id] == p.work_bytes == result["work"][p.session_id]["bytes"]
        assert p.work_bytes < 3 * h.work_bytes  # paid like the honest half, not 500x


def test_a_fake_worker_with_a_copied_digest_earns_nothing(tiny_models, tmp_path):
    """No weights, no gRPC server: it copies an honest session's public slices and digest and
    answers the backbone's connection with SETTINGS and frames of an unknown type."""
    import signal

    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path) as sw:
        sw.start_ledger()
        sw.start_hub(receipt_interval=0.5)
        sw.start_worker("donor", model, "all")
        donor = sw.wait_sessions(1, watch=["donor"])[0]
        sw._spawn("fake", [str(pathlib.Path(__file__).with_name("fake_worker.py")), "--hub", sw.hub_ws_url,
                           "--hub-grpc", sw.hub_grpc_address, "--wallet", str(tmp_path / "fake.wallet"),
                           "--copy", donor.session_id])
        sw.wait_sessions(2, watch=["fake"])
        sw.stop_process("donor", sig=signal.SIGTERM)
        wait_until(lambda: len(sw.list_sessions()) == 1, 30, "the donor to leave")
        fake = sw.list_sessions()[0]
        assert fake.weights_digest == donor.weights_digest and fake.wallet != donor.wallet
        sw.start_worker("honest", model, "all")  # joins after the fake: the fake is routed first
        sw.wait_sessions(2, watch=["honest", "fake"])
        result = sw.run_backbone(["--model", str(model), "--prompt", "fake", "--max-new-tokens", "6",
                                  "--compare-local", "--wait-sessions", "2", "--call-timeout", "3"])
        assert result["backbone_exit_code"] == 0 and result["max_abs_logit_diff"] == 0.0, result
        assert result["fallback_calls"] >= 1 and fake.session_id not in result["sessions_used"]
        live = {s.session_id: s for s in sw.list_sessions()}
        assert live[fake.session_id].bytes_from_worker > 0  # it did push its frames
        assert live[fake.session_id].work_bytes == 0
        credited = sw.wait_credited(list(live.values()))
        assert credited[fake.session_id] == 0
        honest = next(s for s in live.values() if s.session_id != fake.session_id)
        assert credited[honest.session_id] == honest.work_bytes > 0


def test_an_honest_worker_that_sums_in_another_order_is_never_caught(tiny_models, tmp_path):
    """A float32 worker in another language computes the same function in another order: its
    partials differ from ours around 1e-7 relative. Audited on every row, it passes all; and
    --compare-local reports the logit difference with the verdict 'within the audit bound,
    tokens identical' and exits 0 (1 with --require-bitwise)."""
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path) as sw:
        other, honest = _swarm_with_liar(sw, model, ["reorder"])
        result = sw.run_backbone(["--model", str(model), "--prompt", "another order", "--batch", "4",
                                  "--max-new-tokens", "12", "--compare-local", "--wait-sessions", "2",
                                  "--audit-rate", "1"])
        assert result["sessions_quarantined"] == [] and result["replays"] == 0
        assert other.session_id in result["sessions_used"] and result["fallback_calls"] == 0
        assert result["audited_rows"] == result["remote_rows"] > result["audit_exact_rows"]
        assert 0.0 < result["max_abs_logit_diff"] < 1e-4 and result["min_logit_cosine"] > 0.999999
        assert result["tokens_identical"] is True and result["verdict"] == "within the audit bound, tokens identical"
        assert result["bit_exact_wire"] is True and result["backbone_exit_code"] == 0
        strict = sw.run_backbone(["--model", str(model), "--prompt", "another order", "--batch", "4",
                                  "--max-new-tokens", "4", "--compare-local", "--wait-sessions", "2",
                                  "--require-bitwise"])
        assert strict["verdict"] == "within the audit bound, tokens identical" and strict["backbone_exit_code"] == 1
