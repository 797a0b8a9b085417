"""``python -m worker --sessions N``: N sessions from one process, the slices split among them,
each session routed its own share; the hub's per-wallet cap applies to them."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import wait_until

from kvasir.swarm import LocalSwarm
from kvasir_rpc import ExpertFunction, expert_digest, slices_digest
from worker._load import load_experts
from worker._service import LoadedExperts


def _loaded(pairs: list[tuple[int, int]]) -> LoadedExperts:
    weights, digests = {}, {}
    for i, key in enumerate(pairs):
        gate_up, down = torch.full((4, 2), float(i)), torch.full((2, 2), float(i))
        weights[key], digests[key] = (gate_up, down), expert_digest(gate_up, down)
    return LoadedExperts(weights, function=ExpertFunction(), hidden_size=2, dtype=torch.float32,
                         device=torch.device("cpu"), model_type="qwen3_moe", weights_digest=slices_digest(digests),
                         expert_digests=digests)


def test_shares_split_the_slices_in_order_each_with_its_own_digest():
    pairs = [(0, e) for e in range(5)] + [(1, e) for e in range(3)]
    experts = _loaded(pairs)
    assert experts.shares(1) == [(experts.slices, experts.weights_digest)]
    shares = experts.shares(3)
    assert [s for s, _ in shares] == [{0: (0, 1)}, {0: (2, 3, 4)}, {1: (0, 1, 2)}]
    for slices, digest in shares:
        keys = [(layer, e) for layer, es in slices.items() for e in es]
        assert digest == slices_digest({k: experts.expert_digests[k] for k in keys})
    # One session per held expert at most; a share spans layers when it must.
    assert [s for s, _ in experts.shares(8)] == [{layer: (e,)} for layer, e in pairs]
    assert experts.shares(2)[1][0] == {0: (4,), 1: (0, 1, 2)}
    for n in (0, 9):
        with pytest.raises(ValueError, match="each session needs at least one"):
            experts.shares(n)


def test_loaded_experts_carry_their_digests(tiny_models):
    experts = load_experts(tiny_models("qwen3_moe"), "1:2-5", "cpu")
    assert sorted(experts.expert_digests) == [(1, e) for e in range(2, 6)]
    assert slices_digest(experts.expert_digests) == experts.weights_digest


@pytest.mark.integration
def test_one_process_holds_several_sessions_under_the_wallet_cap(tiny_models, tmp_path):
    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path) as sw:
        sw.start_hub()  # the default cap: 4 sessions a wallet
        sw.start_worker("multi", model, "0-1:0-7", extra=["--sessions", "5"])
        sessions = sw.wait_sessions(4, watch=["multi"])
        expected = [share for share, _ in load_experts(model, "0-1:0-7", "cpu").shares(5)]
        # The fifth session is refused (4202, a retry code: the wallet's cap) while four are
        # live; the worker dials it again with backoff, and serves the four meanwhile.
        wait_until(lambda: "too many sessions for this wallet" in (sw.logs / "hub.log").read_text(), 30,
                   "the hub refusing the fifth session")
        wait_until(lambda: len(re.findall(r"\(close code 4202\); retrying in", (sw.logs / "multi.log").read_text()))
                   >= 2, 60, "the worker dialling the fifth session again")
        assert sw.procs["multi"].poll() is None
        sessions = sw.list_sessions()
        assert len(sessions) == 4 and len({s.wallet for s in sessions}) == 1, (sw.logs / "multi.log").read_text()[-2000:]
        held = [{sl.layer: tuple(sl.experts) for sl in s.slices} for s in sessions]
        assert all(h in expected for h in held) and len({str(h) for h in held}) == 4, held
        result = sw.run_backbone(["--model", str(model), "--prompt", "Hello", "--max-new-tokens", "4", "--batch", "8",
                                  "--compare-local", "--wait-sessions", "4"], timeout=300)
    assert result["tokens_identical"] is True and result["max_abs_logit_diff"] == 0.0
    assert result["fallback_calls"] == 0 and result["sessions_rejected"] == []
    # Each session announced its own share with that share's digest, and each served work.
    assert sorted(result["sessions_used"]) == sorted(s.session_id for s in sessions)  # type: ignore[arg-type]
