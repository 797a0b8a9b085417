"""Every byte accounted: the hub's work counts survive a restart and reach the ledger once."""

from __future__ import annotations

import signal
import sqlite3

import pytest
from helpers import wait_until

from kvasir.swarm import LocalSwarm

# Integration: a real swarm and a hub restart.
pytestmark = pytest.mark.integration


def test_hub_restart_loses_no_counted_byte(tiny_models, tmp_path):
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path) as sw:
        sw.start_ledger()
        sw.start_hub(receipt_interval=30.0)  # long: the final receipts must come from the restart path
        sw.start_worker("worker1", model, "all")
        sw.wait_sessions(1, watch=["worker1"])
        sw.run_backbone(["--model", str(model), "--prompt", "count me", "--max-new-tokens", "6"])
        before = sw.list_sessions()[0]
        counted = before.work_bytes  # what the backbone accepted and reported, not tunnel bytes
        assert 0 < counted < before.bytes_to_worker + before.bytes_from_worker
        # A graceful stop saves the counters; the restart sends what the ledger lacks.
        assert sw.stop_process("hub", sig=signal.SIGTERM) == 0
        sw.procs.pop("hub")
        db = sqlite3.connect(tmp_path / "hub-contrib.sqlite")
        saved = db.execute("SELECT SUM(cumulative_bytes) FROM work WHERE session_id = ?",
                           (before.session_id,)).fetchone()[0]
        db.close()
        assert saved == counted
        sw.start_hub(receipt_interval=0.5, listen_port=sw.hub_ws_port)
        credited = lambda: sum(c.bytes for c in sw.ledger_credits(before.wallet) if c.session_id == before.session_id)  # noqa: E731
        wait_until(lambda: credited() == counted, 60, "the old session's bytes to be credited")
        # The worker came back as a new session; once the hub holds no unanswered receipt,
        # the old session stands credited exactly once.
        sw.wait_sessions(1, watch=["worker1"])

        def nothing_pending() -> bool:
            with sqlite3.connect(tmp_path / "hub-contrib.sqlite") as db:
                return db.execute("SELECT COUNT(*) FROM receipts WHERE state = 'pending'").fetchone()[0] == 0

        wait_until(nothing_pending, 30, "the hub's receipts to be answered")
        assert credited() == counted
        assert sw.ledger_balance(before.wallet).pending_nano_kvr >= counted * 7
