"""Workers go where they are needed (``--experts auto``, issue 30): the hub's planner
(relay/hub/_plan.py) from the backbones' demand and what the swarm holds; then real processes:
two workers on an empty swarm, told nothing but a memory budget, cover every expert."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from helpers import ROOT

from kvasir.swarm import LocalSwarm
from kvasir_rpc import ExpertIndex, ExpertSet, HelloInfo, Wallet
from relay.hub._plan import Demand, Reservations, pick_mover, plan_slice
from relay.hub._registry import SessionRegistry

ALL = {layer: tuple(range(8)) for layer in range(3)}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_empty_swarm_gets_what_no_one_holds_and_two_plans_do_not_overlap():
    first = plan_slice(ALL, 12, held=[], demand={}, salt="wallet-a")
    assert sum(len(v) for v in first.values()) == 12
    second = plan_slice(ALL, 12, held=[first], demand={}, salt="wallet-b")
    covered = {(l, e) for plan in (first, second) for l, es in plan.items() for e in es}
    assert len(covered) == 24  # between them, every expert once


def test_uncovered_comes_before_demand_then_demand_per_holder():
    held = [{0: tuple(range(8)), 1: tuple(range(8))}]  # layer 2 uncovered
    demand = {(0, 3): 1000.0, (2, 5): 1.0}
    plan = plan_slice(ALL, 9, held=held, demand=demand, salt="w")
    assert plan[2] == tuple(range(8))  # every uncovered expert first, the demanded one among them
    assert plan[0] == (3,)  # then the most demanded per holder
    # With two holders of (0, 3) already, a less demanded single-held expert can come first.
    plan = plan_slice({0: (3, 4)}, 1, held=held * 2 + [{0: (3,)}], demand={(0, 3): 30.0, (0, 4): 25.0}, salt="w")
    assert plan == {0: (4,)}  # 30 / 4 holders < 25 / 3


def test_the_plan_stays_inside_the_workers_checkpoint_and_capacity():
    plan = plan_slice({1: (2, 3)}, 10, held=[], demand={(0, 0): 5.0}, salt="w")
    assert plan == {1: (2, 3)}
    assert plan_slice(ALL, 0, held=[], demand={}, salt="w") == {}


def test_demand_counts_what_grew_per_run_and_forgets_by_half_lives():
    clock = Clock()
    d = Demand(half_life_s=10.0, clock=clock)
    d.report("run-a", [(0, [4, 0, 2])])
    d.report("run-a", [(0, [4, 0, 2])])  # sent twice: nothing more
    d.report("run-b", [(0, [1, 0, 0])])
    assert d.snapshot() == {(0, 0): 5.0, (0, 2): 2.0}
    clock.now = 10.0
    assert d.snapshot() == pytest.approx({(0, 0): 2.5, (0, 2): 1.0})
    d.report("run-a", [(0, [6, 0, 2])])  # grew by 2
    assert d.snapshot()[(0, 0)] == pytest.approx(4.5)


def test_a_reservation_lasts_until_its_worker_joins_or_its_time_passes():
    clock = Clock()
    r = Reservations(ttl_s=60.0, clock=clock)
    r.add("a", {0: (1, 2)})
    r.add("b", {1: (0,)})
    assert r.live() == [{0: [1, 2]}, {1: [0]}]
    r.release("a")
    assert r.live() == [{1: [0]}]
    clock.now = 61.0
    assert r.live() == []


def test_a_plan_turns_from_reservation_to_held_in_one_step_so_a_worker_planned_meanwhile_counts_it():
    # Seen in CI: the plan was released at the handshake and the session counted only after the
    # accept was sent and its splice started; a second worker planned in that gap got experts the
    # first was about to hold. Now the registry does both under one lock, in one call.
    registry = SessionRegistry()
    first = Wallet.generate().address
    mine = plan_slice(ALL, 12, held=[], demand={}, salt=first)
    registry.reservations.add(first, mine)

    def counted() -> list[dict[int, list[int]]]:
        held = [{layer: list(es) for layer, es in dict(s.slices).items()} for s in registry.statistics()]
        return held + registry.reservations.live()

    assert counted() == [{k: list(v) for k, v in mine.items()}]
    joined = registry.add("s1", HelloInfo(wallet=first, slices={k: ExpertSet.of(v) for k, v in mine.items()},
                                          weights_digest=b"d" * 32, device="cpu", model_type="qwen3_moe",
                                          worker_version="test"),
                          target="127.0.0.1:1", remote="127.0.0.1:2")
    assert joined and registry.reservations.live() == []
    assert counted() == [{k: list(v) for k, v in mine.items()}]
    second = plan_slice(ALL, 12, held=[dict(s.slices) for s in registry.statistics()], demand={},
                        salt=Wallet.generate().address, reserved=registry.reservations.live())
    assert not {(k, e) for k, v in mine.items() for e in v} & {(k, e) for k, v in second.items() for e in v}
    # A wallet that joins without a plan (fixed experts) is no planned session.
    assert not registry.add("s2", HelloInfo(wallet=Wallet.generate().address, slices={0: ExpertSet.of([0])},
                                            weights_digest=b"d" * 32, device="cpu", model_type="qwen3_moe",
                                            worker_version="test"),
                            target="127.0.0.1:1", remote="127.0.0.1:3")


def test_plans_are_bounded_and_a_stranger_reserving_experts_cannot_make_them_look_covered():
    clock = Clock()
    r = Reservations(ttl_s=600.0, clock=clock, max_plans=8)
    half = {layer: tuple(range(4)) for layer in range(3)}  # what the stranger's hellos offer
    for i in range(100):  # fresh wallets, each planning the same half
        r.add(f"stranger-{i}", plan_slice(half, 12, held=[], demand={}, salt=f"stranger-{i}", reserved=r.live()))
    assert len(r.live()) == 8  # bounded: the oldest plans went
    # An honest worker loading experts 4-7 (its plan), then a second one planned: the second
    # takes what no live session holds, the stranger's reserved half, not a copy of the first's.
    first = plan_slice(ALL, 12, held=[], demand={}, salt="honest-a", reserved=r.live())
    assert first == {layer: tuple(range(4, 8)) for layer in range(3)}  # the least reserved
    r.add("honest-a", first)
    r.release("honest-a")  # it joined: a live session now
    second = plan_slice(ALL, 12, held=[first], demand={}, salt="honest-b", reserved=r.live())
    assert second == half


@pytest.mark.integration
def test_two_auto_workers_on_an_empty_swarm_cover_every_expert(tiny_models, tmp_path):
    model = tiny_models("qwen3_moe")
    index = ExpertIndex(model)
    everything = {(l, e) for l, es in index.slices.items() for e in es}
    per_expert = 3 * index.info.intermediate_size * index.info.hidden_size * index.info.dtype.itemsize
    half = -(-len(everything) // 2)
    with LocalSwarm(tmp_path / "swarm") as sw:
        sw.start_ledger()
        sw.start_hub(extra=["--model", str(model)])
        for name in ("w1", "w2"):  # at once: the hub plans the second with the first's plan held
            sw.start_worker(name, model, "auto", extra=["--max-expert-memory", str(per_expert * half)])
        sessions = sw.wait_sessions(2, watch=["w1", "w2"])
        held = [{(sl.layer, e) for sl in s.slices for e in sl.experts} for s in sessions]
        assert all(len(h) == half for h in held)
        assert held[0] | held[1] == everything and not held[0] & held[1]
        result = sw.run_backbone(["--model", str(model), "--prompt", "planned by the hub", "--max-new-tokens", "6",
                                  "--compare-local", "--require-bitwise", "--wait-sessions", "2"])
        assert result["verdict"] == "bitwise equal" and result["local_rows"] == 0 and result["remote_rows"] > 0
        assert "slice suggested" in (sw.logs / "hub.log").read_text()


@pytest.mark.integration
def test_strangers_planning_hellos_do_not_steer_honest_workers_off_the_uncovered_experts(tiny_models, tmp_path):
    """The attack: before any honest worker comes, a stranger sends 20 planning hellos from
    fresh wallets, each offering experts 0-3 of every layer, and never joins: 20 plans reserve
    that half. Then two honest --experts auto workers, each with room for half the model, one
    after the other. What must hold: between them they cover every expert (a plan is no
    coverage), and the decode uses no local expert."""
    model = tiny_models("qwen3_moe")
    index = ExpertIndex(model)
    everything = {(l, e) for l, es in index.slices.items() for e in es}
    per_expert = 3 * index.info.intermediate_size * index.info.hidden_size * index.info.dtype.itemsize
    half = -(-len(everything) // 2)
    with LocalSwarm(tmp_path / "swarm") as sw:
        sw.start_ledger()
        sw.start_hub(extra=["--model", str(model)])
        hoarder = subprocess.run([sys.executable, str(pathlib.Path(__file__).with_name("plan_hoarder.py")),
                                  sw.hub_ws_url, str(len(index.slices)), "0-3", "20"],
                                 capture_output=True, text=True, timeout=120, env=sw.env, cwd=ROOT)
        assert hoarder.returncode == 0, hoarder.stderr[-2000:]
        assert json.loads(hoarder.stdout.splitlines()[-1])["plans"] == 20
        held: dict[str, set[tuple[int, int]]] = {}
        for name in ("w1", "w2"):  # one after the other: the second sees the first live
            sw.start_worker(name, model, "auto", extra=["--max-expert-memory", str(per_expert * half)])
            (mine,) = [s for s in sw.wait_sessions(len(held) + 1, watch=[name]) if s.session_id not in held]
            held[mine.session_id] = {(sl.layer, e) for sl in mine.slices for e in sl.experts}
        first, second = held.values()
        assert first | second == everything and not first & second, (sorted(first), sorted(second))
        result = sw.run_backbone(["--model", str(model), "--prompt", "not steered", "--max-new-tokens", "4",
                                  "--compare-local", "--require-bitwise", "--wait-sessions", "2"])
        assert result["verdict"] == "bitwise equal" and result["local_rows"] == 0 and result["remote_rows"] > 0


def test_a_planned_worker_held_elsewhere_is_picked_to_move_when_experts_are_uncovered():
    held = {"a": {0: (0, 1)}, "b": {0: (0, 1)}, "c": {0: (2,)}}
    uncovered = {(0, 3): 5.0, (0, 0): 1.0}
    assert pick_mover(held, ["a", "b"], uncovered) in ("a", "b")
    assert pick_mover(held, ["c"], uncovered) is None  # moving it would uncover expert 2
    assert pick_mover(held, ["a"], {(0, 0): 9.0}) is None  # nothing in use is uncovered
    # Of two movable, the one whose experts carry less demand.
    held = {"a": {0: (0,)}, "b": {0: (1,)}, "x": {0: (0, 1)}}
    assert pick_mover(held, ["a", "b"], {(0, 0): 9.0, (0, 1): 1.0, (0, 5): 1.0}) == "b"


@pytest.mark.integration
def test_a_planned_worker_moves_to_the_experts_a_leaving_worker_left(tiny_models, tmp_path):
    model = tiny_models("qwen3_moe")
    index = ExpertIndex(model)
    everything = {(l, e) for l, es in index.slices.items() for e in es}
    per_expert = 3 * index.info.intermediate_size * index.info.hidden_size * index.info.dtype.itemsize
    half = len(everything) // 2
    with LocalSwarm(tmp_path / "swarm") as sw:
        sw.start_ledger()
        sw.start_hub(extra=["--model", str(model), "--move-check", "0.5", "--move-min-age", "0"])
        sw.start_worker("all", model, "*:0-7")
        sw.wait_sessions(1, watch=["all"])
        sw.start_worker("auto", model, "auto", extra=["--max-expert-memory", str(per_expert * half)])
        (planned,) = [s for s in sw.wait_sessions(2, watch=["auto"]) if len(s.slices[0].experts) < 8]
        first = {(sl.layer, e) for sl in planned.slices for e in sl.experts}
        # Another worker holding the same experts joins, the one holding everything leaves: the
        # rest is uncovered, and the planned worker's experts are held twice.
        spec = ",".join(f"{l}:{e}" for l, e in sorted(first))
        sw.start_worker("twin", model, spec)
        sw.wait_sessions(3, watch=["twin"])
        sw.stop_process("all")
        # A decode reports what its router uses (the uncovered experts among it).
        sw.run_backbone(["--model", str(model), "--prompt", "who holds the rest", "--max-new-tokens", "4",
                         "--wait-sessions", "2"])

        def moved() -> bool:
            live = sw.list_sessions()
            holders = [{(sl.layer, e) for sl in s.slices for e in sl.experts} for s in live]
            return len(live) == 2 and set().union(*holders) == everything

        from helpers import wait_until

        wait_until(moved, 120, "the planned worker to move to the uncovered experts")
        assert "asking a worker to move" in (sw.logs / "hub.log").read_text()
        result = sw.run_backbone(["--model", str(model), "--prompt", "all remote again", "--max-new-tokens", "4",
                                  "--compare-local", "--require-bitwise", "--wait-sessions", "2"])
        assert result["verdict"] == "bitwise equal" and result["local_rows"] == 0, result
