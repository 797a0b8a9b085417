"""Replicas share the load (backbone/experts/_placement.py ``spread``).

In process: every route goes to one of its expert's live holders, a single holder takes all as
before, and replicas of every expert end a call with loads at most one route apart (the
largest). Real processes: two workers holding the same experts both serve the decode, which
stays bitwise the local run, and each is paid for what it served.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backbone.experts._placement import spread

ROUTES = st.lists(st.tuples(st.integers(0, 7), st.integers(1, 64)), max_size=16)


@given(routes=ROUTES, held=st.dictionaries(st.integers(0, 7), st.lists(st.sampled_from("abc"), min_size=1,
                                                                          max_size=3, unique=True)))
def test_every_route_goes_to_a_holder_of_its_expert_or_stays(routes: list[tuple[int, int]],
                                                            held: dict[int, list[str]]) -> None:
    chosen = spread(routes, held)
    assert len(chosen) == len(routes)
    for (expert, _), where in zip(routes, chosen):
        assert where in held[expert] if expert in held else where is None


@given(routes=ROUTES)
def test_one_holder_per_expert_takes_all_its_routes(routes: list[tuple[int, int]]) -> None:
    held = {e: [f"w{e % 2}"] for e in range(8)}
    assert spread(routes, held) == [f"w{e % 2}" for e, _ in routes]


@given(routes=ROUTES, k=st.integers(1, 4))
def test_replicas_of_every_expert_end_at_most_one_route_apart(routes: list[tuple[int, int]], k: int) -> None:
    holders = [f"w{i}" for i in range(k)]
    chosen = spread(routes, {e: holders for e in range(8)})
    load = {h: 0 for h in holders}
    for (_, rows), where in zip(routes, chosen):
        assert where is not None
        load[where] += rows
    assert max(load.values()) - min(load.values()) <= max((r for _, r in routes), default=0)


def test_ties_go_to_the_holder_that_joined_first() -> None:
    assert spread([(3, 5)], {3: ["first", "second"]}) == ["first"]
    # Equal routes alternate; the larger goes first and the next to the other holder.
    assert spread([(0, 4), (1, 9), (2, 4)], {e: ["a", "b"] for e in range(3)}) == ["b", "a", "b"]


@pytest.mark.integration
def test_two_workers_holding_the_same_experts_share_the_decode(tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvasir.swarm import LocalSwarm

    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path) as sw:
        sw.start_ledger()
        sw.start_hub(receipt_interval=0.5)  # delivers to the ledger it finds
        sw.start_worker("worker1", model, "*:0-7")
        sw.start_worker("worker2", model, "*:0-7")
        sessions = sw.wait_sessions(2, watch=["worker1", "worker2"])
        result = sw.run_backbone(["--model", str(model), "--prompt", "two hold every expert", "--batch", "4",
                                  "--max-new-tokens", "8", "--compare-local", "--wait-sessions", "2"], timeout=300)
        assert result["backbone_exit_code"] == 0, result
        assert result["tokens_identical"] is True and result["max_abs_logit_diff"] == 0.0
        work = result["work"]
        rows = {s.session_id: work.get(s.session_id, {}).get("rows", 0) for s in sessions}  # type: ignore[attr-defined]
        assert all(n > 0 for n in rows.values()), rows  # both served; before, the first took every row
        assert result["local_rows"] == 0, result
        credited = sw.wait_credited(sw.list_sessions())
        for s in sessions:
            assert credited[s.session_id] == work[s.session_id]["bytes"] > 0  # type: ignore[index]


@pytest.mark.integration
def test_a_liar_that_replicates_every_expert_gets_a_share_and_is_caught_under_each_new_wallet(tiny_models,
                                                                                              tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Spreading gives a replica calls the first holder used to take: a liar holding every
    expert an honest worker holds now gets half the rows. It is caught on them, the decode stays
    bitwise local, and when it comes back under a fresh wallet it is caught again; the honest
    replica is paid exactly what it served."""
    import pathlib

    from helpers import wait_until

    from kvasir.swarm import LocalSwarm

    liar_script = str(pathlib.Path(__file__).with_name("liar_worker.py"))
    model = tiny_models("qwen3_moe")
    decode = ["--model", str(model), "--prompt", "a replica lies", "--batch", "4", "--max-new-tokens", "8",
              "--compare-local", "--wait-sessions", "2"]
    with LocalSwarm(tmp_path) as sw:
        sw.start_ledger()
        sw.start_hub(receipt_interval=0.5)
        sw.start_worker("honest", model, "*:0-7")
        sw.wait_sessions(1, watch=["honest"])
        (honest,) = sw.list_sessions()
        liars = []
        for name in ("liar", "liar_new_wallet"):  # each start: a wallet of its own
            sw.start_worker(name, model, "*:0-7", launcher=(liar_script, "offset", "--"))
            sessions = sw.wait_sessions(2, watch=["honest", name])
            (liar,) = [s for s in sessions if s.session_id != honest.session_id]
            liars.append(liar)
            result = sw.run_backbone(decode, timeout=300)
            assert result["backbone_exit_code"] == 0, result
            assert result["tokens_identical"] is True and result["max_abs_logit_diff"] == 0.0
            assert result["sessions_quarantined"] == [liar.session_id], result
            assert result["answers_refused"] >= 1 and result["replays"] == 0, result
            wait_until(lambda: sw.procs[name].poll() is not None, 60, f"{name} to stop on its quarantine")
        live = {s.session_id: s for s in sw.list_sessions()}
        assert list(live) == [honest.session_id]
        credited = sw.wait_credited([live[honest.session_id]])
        assert credited[honest.session_id] == live[honest.session_id].work_bytes > 0
        for liar in liars:  # caught on its first call: it never delivered accepted work
            assert sum(int(c.bytes) for c in sw.ledger_credits(liar.wallet)) == 0
