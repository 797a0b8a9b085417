"""``kvasir conformance`` against real worker processes: the Python worker passes every step;
workers broken on purpose (tests/bad_tunnel_worker.py, tests/liar_worker.py) fail the step
that names their fault, and nothing else the check could still judge."""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import subprocess
import sys

import pytest

from kvasir.conformance import FAIL, PASS, SKIP, STEPS, StepResult, run_check
from kvasir_rpc import protocol

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTS = pathlib.Path(__file__).resolve().parent
SPEC = "*:0-3"
# The wait for "closed" in the no-closed case (the protocol's CLOSE_TIMEOUT_S is 10 s).
SHORT_CLOSE_S = 2.0


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    # Workers started from a script in tests/ import the repository's packages too.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))


def _worker_cmd(model: pathlib.Path, wallet: pathlib.Path, launcher: list[str]) -> str:
    args = [sys.executable, *launcher, "--hub", "{url}", "--model", str(model), "--experts", SPEC,
            "--wallet", str(wallet), "--threads", "1"]
    return shlex.join(args)


def _check(model: pathlib.Path, tmp_path: pathlib.Path, launcher: list[str]) -> dict[str, StepResult]:
    log = tmp_path / "worker.log"
    results, _ = run_check(model, worker_cmd=_worker_cmd(model, tmp_path / "w.key", launcher), worker_log=log,
                           timeout_s=120)
    assert [r.step for r in results] == list(STEPS)
    return {r.step: r for r in results}


def test_the_python_worker_passes_every_step(tiny_models, tmp_path):
    model = tiny_models("qwen3_moe")
    cmd = _worker_cmd(model, tmp_path / "w.key", ["-m", "worker"])
    out = subprocess.run([sys.executable, "-m", "kvasir", "conformance", "--model", str(model), "--json",
                          "--worker-cmd", cmd, "--worker-log", str(tmp_path / "worker.log")],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    report = json.loads(out.stdout.splitlines()[-1])
    assert out.returncode == 0, out.stdout + out.stderr
    assert report["passed"] is True
    assert [(s["step"], s["status"]) for s in report["steps"]] == [(name, PASS) for name in STEPS]
    steps = {s["step"]: s for s in report["steps"]}
    # One machine, one kernel: every row bit for bit, the packed call included; the calls asked
    # for the projections the hello announced, and every row passed the row checks.
    assert "bit-exact" in steps["dispatch"]["detail"] and steps["dispatch"]["notes"] == []
    assert "its projections pass the row checks" in steps["dispatch"]["detail"]
    assert "packed" not in " ".join(steps["dispatch"]["notes"])
    assert "INVALID_ARGUMENT" in steps["errors"]["detail"] and "FAILED_PRECONDITION" in steps["errors"]["detail"]
    assert report["worker"]["slices"] == {str(layer): [0, 1, 2, 3] for layer in range(4)}
    # The human report went to stderr, a line per step.
    assert "PASS  keepalive" in out.stderr and "a worker should dial ws://127.0.0.1:" in out.stderr


def test_an_encrypted_worker_passes_and_answers_the_sealed_heartbeat(tiny_models, tmp_path):
    """A worker that requires encryption gets a sealed session (as from a hub under --e2e
    auto): every step runs over the sealed channel, and keepalive asks for the sealed
    heartbeat, the session's liveness check, besides the ping."""
    steps = _check(tiny_models("qwen3_moe"), tmp_path, ["-m", "worker", "--e2e", "require"])
    assert all(steps[s].status == PASS for s in STEPS), steps
    assert "sealed heartbeat acknowledged after" in steps["keepalive"].detail, steps["keepalive"]


@pytest.mark.parametrize(
    ("fault", "step", "says"),
    [
        ("no-subprotocol", "upgrade", "it must offer kvasir.tunnel.v1"),
        ("digest", "digest", "the checkpoint's digest of the announced slices is"),
        ("idle-eof", "idle", "the worker sent 'eof' while the tunnel is IDLE"),
        ("no-closed", "close", f"did not answer 'close' with 'closed' within {SHORT_CLOSE_S:g} s"),
    ],
)
def test_a_broken_tunnel_fails_the_step_that_names_it(fault, step, says, tiny_models, tmp_path, monkeypatch):
    if fault == "no-closed":
        # The check waits CLOSE_TIMEOUT_S for "closed" before failing the step: a shorter wait
        # judges the same silence (the check reads the constant when it waits).
        monkeypatch.setattr(protocol, "CLOSE_TIMEOUT_S", SHORT_CLOSE_S)
    steps = _check(tiny_models("qwen3_moe"), tmp_path, [str(TESTS / "bad_tunnel_worker.py"), fault, "--"])
    assert steps[step].status == FAIL and says in steps[step].detail, steps[step]
    assert [s for s in STEPS if steps[s].status == FAIL] == [step], steps
    after = STEPS[STEPS.index(step) + 1 :]
    if fault == "digest":
        # A wrong digest leaves the session usable: everything else is still judged, and passes.
        assert all(steps[s].status == PASS for s in STEPS if s != step), steps
    else:
        # The session is over: what follows cannot be judged (the digest is the checkpoint's).
        assert all(steps[s].status == SKIP for s in after if s != "digest"), steps


def test_wrong_numbers_fail_dispatch_naming_the_element(tiny_models, tmp_path):
    steps = _check(tiny_models("qwen3_moe"), tmp_path, [str(TESTS / "liar_worker.py"), "offset", "--"])
    assert [s for s in STEPS if steps[s].status == FAIL] == ["dispatch"], steps
    detail = steps["dispatch"].detail
    assert "the reference kernel gives" in detail and "column" in detail and "audit allows" in detail, detail


def test_other_summation_order_passes_with_a_note(tiny_models, tmp_path):
    steps = _check(tiny_models("qwen3_moe"), tmp_path, [str(TESTS / "liar_worker.py"), "reorder", "--"])
    assert all(steps[s].status == PASS for s in STEPS), steps
    assert any("not bit-exact: a backbone's --compare-local gives the verdict 'within the audit bound, tokens "
               "identical'" in n for n in steps["dispatch"].notes), steps["dispatch"]
    assert "within the audit bound of the reference kernel, not bitwise" in steps["dispatch"].detail


def test_projections_that_do_not_fit_fail_dispatch_by_the_row_checks(tiny_models, tmp_path):
    steps = _check(tiny_models("qwen3_moe"), tmp_path, [str(TESTS / "liar_worker.py"), "proj", "--"])
    assert [s for s in STEPS if steps[s].status == FAIL] == ["dispatch"], steps
    # The row checks draw secret directions per run: the gate projections off may show as the
    # projection check failing or as the partials not fitting them; either names the row.
    detail = steps["dispatch"].detail
    assert "the row checks fail" in detail and ("gate projection" in detail or "secret direction" in detail), detail


def test_a_worker_without_projections_passes_with_a_note(tiny_models, tmp_path):
    steps = _check(tiny_models("qwen3_moe"), tmp_path, [str(TESTS / "liar_worker.py"), "reorder", "--unchecked", "--"])
    assert all(steps[s].status == PASS for s in STEPS), steps
    assert any("does not announce projections" in n for n in steps["dispatch"].notes), steps["dispatch"]


def test_the_python_worker_passes_every_step_on_gpt_oss(tmp_path):
    # gpt-oss's expert function (docs/PROTOCOL.md 11.2): clamped SwiGLU, biases, interleaved and
    # transposed weights; bfloat16 and sharded as released.
    from kvasir.families import make_family_checkpoint

    model = make_family_checkpoint(tmp_path / "gpt_oss", "gpt_oss", dtype="bfloat16", shard="100KB")
    steps = _check(model, tmp_path, ["-m", "worker"])
    assert {name: s.status for name, s in steps.items()} == {name: PASS for name in STEPS}, steps
    assert "bit-exact" in steps["dispatch"].detail and "its projections pass the row checks" in steps["dispatch"].detail


def test_a_worker_announcing_another_function_fails_the_digest_step(tmp_path):
    from kvasir.families import make_family_checkpoint

    model = make_family_checkpoint(tmp_path / "gpt_oss", "gpt_oss", dtype="bfloat16")
    steps = _check(model, tmp_path, [str(TESTS / "liar_worker.py"), "honest", "--announce-plain", "--"])
    assert steps["digest"].status == FAIL
    assert "GLU with silu" in steps["digest"].detail and "clamped SwiGLU (alpha 1.702, limit 7)" in steps["digest"].detail


def test_a_worker_command_without_url_is_refused(tiny_models):
    out = subprocess.run([sys.executable, "-m", "kvasir", "conformance", "--model", str(tiny_models("qwen3_moe")),
                          "--worker-cmd", "python -m worker"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "--worker-cmd must contain {url}" in out.stderr


def test_a_worker_that_exits_before_dialling_is_reported_with_its_output(tiny_models, tmp_path):
    results, worker = run_check(tiny_models("qwen3_moe"), worker_cmd=f"{shlex.quote(sys.executable)} -c "
                                "\"print('no such hub: {url}'); raise SystemExit(3)\"", timeout_s=60)
    assert worker == {}
    first = results[0]
    assert first.step == "upgrade" and first.status == FAIL
    assert "exited with code 3 before dialling" in first.detail and "no such hub: ws://127.0.0.1:" in first.detail
    assert all(r.status == SKIP for r in results[1:])
