"""The worker without torch (issue 33), as real processes: ``python -m worker`` installed from
``packaging/worker`` into ``.venv-numpy`` (``make venv-numpy``; ``make test`` makes it), where
torch cannot be imported, passes ``kvasir conformance`` on the tiny model of every family the
swarm serves and on block-FP8 and MXFP4 releases, refuses compressed-tensors in one line, and
serves a live decode beside a torch worker: the tokens are the local run's and the ledger
credits its wallet. The same checks with ``--compute numpy`` in this venv are the fast ones."""

from __future__ import annotations

import filecmp
import json
import os
import pathlib
import shlex
import subprocess
import sys

import pytest

from kvasir.conformance import PASS, STEPS, run_check

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parent.parent
NUMPY_VENV = ROOT / ".venv-numpy"
NUMPY_PY = NUMPY_VENV / "bin" / "python"
TORCHLESS = str(pathlib.Path(__file__).with_name("torchless_worker.py"))
SPEC = "*:0-3"
# A verdict the dispatch step gives an honest worker: bit-exact, or within the audit bound.
HONEST = ("every row within the audit bound of the reference kernel", "every row bitwise equal to the reference")


@pytest.fixture(scope="module")
def numpy_python() -> pathlib.Path:
    """.venv-numpy's interpreter, checked to hold this checkout's worker and no torch."""
    assert NUMPY_PY.exists(), f"{NUMPY_VENV} is missing: run `make venv-numpy` (make test makes it)"
    site = subprocess.run([str(NUMPY_PY), "-I", "-c", "import kvasir_rpc, worker, sys; print(kvasir_rpc.__file__)"],
                          capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    installed = pathlib.Path(site).parent.parent
    stale = []
    for pkg in ("kvasir_rpc", "worker"):
        names = [p.name for p in (ROOT / pkg).glob("*.py")]
        _, differ, missing = filecmp.cmpfiles(ROOT / pkg, installed / pkg, names, shallow=False)
        stale += [f"{pkg}/{name}" for name in differ + missing]
    assert not stale, f"{NUMPY_VENV} holds another version of {stale[:4]}: run `make venv-numpy`"
    return NUMPY_PY


def test_the_venv_has_no_torch_and_runs_the_installed_worker(numpy_python):
    for module in ("torch", "transformers", "accelerate", "compressed_tensors"):
        out = subprocess.run([str(numpy_python), "-I", "-c", f"import {module}"], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode != 0 and "ModuleNotFoundError" in out.stderr, (module, out.stderr)
    out = subprocess.run([str(numpy_python), "-I", "-m", "worker", "--help"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "--compute" in out.stdout, out.stderr
    site = subprocess.run([str(numpy_python), "-I", "-c", "import worker; print(worker.__file__)"],
                          capture_output=True, text=True, timeout=60, check=True, cwd=ROOT).stdout
    assert str(NUMPY_VENV) in site and "site-packages" in site  # the installed copy, not the checkout's


def _conformance(model: pathlib.Path, argv: list[str], tmp_path: pathlib.Path) -> dict[str, object]:
    """``kvasir conformance`` on a worker started as ``argv`` (then its flags): the steps by name."""
    cmd = shlex.join([*argv, "--hub", "{url}", "--model", str(model), "--experts", SPEC,
                      "--wallet", str(tmp_path / "w.key"), "--threads", "1"])
    log = tmp_path / "worker.log"
    results, worker = run_check(model, worker_cmd=cmd, worker_log=log, timeout_s=120)
    steps = {r.step: r for r in results}
    assert [r.step for r in results] == list(STEPS)
    failed = {s: (r.status, r.detail) for s, r in steps.items() if r.status != PASS}
    assert not failed, (failed, log.read_text(errors="replace")[-2000:])
    assert any(v in steps["dispatch"].detail for v in HONEST), steps["dispatch"]
    assert "its projections pass the row checks" in steps["dispatch"].detail
    assert worker["device"] == "cpu (numpy)", worker
    return steps


def _family_model(tmp_path_factory: pytest.TempPathFactory, model_type: str, quant: str | None = None,
                  dtype: str = "bfloat16") -> pathlib.Path:
    from kvasir.families import make_family_checkpoint

    folder = tmp_path_factory.mktemp(f"{model_type}-{quant or dtype}")
    return make_family_checkpoint(folder / "model", model_type, dtype=dtype, shard="100KB", quant=quant)


def _served_families() -> list[str]:
    from test_families import NOW_SERVED, SERVED_BEFORE, WALK_SERVED

    return SERVED_BEFORE + NOW_SERVED + WALK_SERVED


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe", "mixtral"])
def test_the_numpy_worker_passes_conformance_on_each_tiny_model(numpy_python, tiny_models, tmp_path, arch):
    _conformance(tiny_models(arch), [str(numpy_python), "-I", "-m", "worker"], tmp_path)


@pytest.mark.parametrize("model_type", _served_families())
def test_the_numpy_worker_passes_conformance_on_each_served_family(numpy_python, tmp_path_factory, tmp_path,
                                                                    model_type):
    # bfloat16, as releases ship: each value rounded once from float32 (the torch worker rounds
    # after every operation), within the audit bound.
    model = _family_model(tmp_path_factory, model_type)
    _conformance(model, [str(numpy_python), "-I", "-m", "worker"], tmp_path)


@pytest.mark.parametrize(("model_type", "quant"), [("qwen3_moe", "fp8"), ("deepseek_v3", "fp8"),
                                                   ("gpt_oss", "mxfp4")])
def test_the_numpy_worker_serves_fp8_and_mxfp4_releases(numpy_python, tmp_path_factory, tmp_path, model_type, quant):
    # The digest step passing says the numpy worker dequantized every weight to the bits the
    # torch worker holds (the checkpoint's digest is of torch's dequantized weights).
    model = _family_model(tmp_path_factory, model_type, quant)
    steps = _conformance(model, [str(numpy_python), "-I", "-m", "worker"], tmp_path)
    assert "equals the checkpoint's digest" in steps["digest"].detail


@pytest.mark.parametrize("where", ["numpy-venv", "--compute numpy"])
def test_a_compressed_tensors_release_is_refused_in_one_line(numpy_python, tmp_path_factory, tmp_path, where):
    model = _family_model(tmp_path_factory, "qwen3_moe", "ct-fp8")
    argv = ([str(numpy_python), "-I", "-m", "worker"] if where == "numpy-venv"
            else [sys.executable, "-m", "worker", "--compute", "numpy"])
    out = subprocess.run([*argv, "--hub", "ws://127.0.0.1:9", "--model", str(model), "--wallet",
                          str(tmp_path / "w.key")], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "compressed-tensors" in lines[0] and "use the torch worker" in lines[0], out.stderr


# The fast checks: this venv, torch installed, the worker told to compute with numpy; and once
# where every import of torch fails (tests/torchless_worker.py), as without it.
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe", "mixtral"])
def test_compute_numpy_passes_conformance_in_this_venv(tiny_models, tmp_path, arch):
    _conformance(tiny_models(arch), [sys.executable, "-m", "worker", "--compute", "numpy"], tmp_path)


def test_a_worker_that_cannot_import_torch_computes_with_numpy_unasked(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    steps = _conformance(tiny_models("qwen3_moe"), [sys.executable, TORCHLESS], tmp_path)
    assert "device 'cpu (numpy)'" in steps["handshake"].detail


def test_compute_numpy_refuses_a_gpu_and_torch_refuses_without_torch(tiny_models, tmp_path):
    base = ["--hub", "ws://127.0.0.1:9", "--model", str(tiny_models("qwen3_moe")), "--wallet", str(tmp_path / "k")]
    out = subprocess.run([sys.executable, "-m", "worker", "--compute", "numpy", "--device", "cuda", *base],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "--device cuda needs torch" in out.stderr, out.stderr
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, TORCHLESS, "--compute", "torch", *base], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path, env=env)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "worker: --compute torch: torch is not installed here (pip install kvasir-rpc installs it); without it the "
        "worker computes with numpy (--compute numpy)"], out.stderr


def test_a_live_decode_with_a_numpy_worker_beside_a_torch_worker(numpy_python, tiny_models, tmp_path):
    """The numpy worker from .venv-numpy holds half the experts, a torch worker the other half:
    the backbone's tokens are the local run's (within the audit bound), nothing is computed
    locally or refused, and the ledger credits the numpy worker's wallet every byte."""
    from kvasir.swarm import LocalSwarm

    model = tiny_models("qwen3_moe")
    # LocalSwarm starts workers with its own python; this one becomes .venv-numpy's, isolated.
    into_numpy_venv = ("-c", f"import os, sys; os.execv({str(numpy_python)!r}, [{str(numpy_python)!r}, '-I', '-m', "
                             "'worker', *sys.argv[1:]])")
    with LocalSwarm(tmp_path / "swarm") as sw:
        sw.start_ledger()
        sw.start_hub(receipt_interval=0.5)
        sw.start_worker("numpy", model, "*:0-3", launcher=into_numpy_venv)
        sw.start_worker("torch", model, "*:4-7")
        sessions = sw.wait_sessions(2, watch=["numpy", "torch"])
        numpy_session = next(s for s in sessions if s.device == "cpu (numpy)")
        result = sw.run_backbone(["--model", str(model), "--prompt", "a worker without torch", "--batch", "2",
                                  "--max-new-tokens", "12", "--compare-local", "--wait-sessions", "2", "--json"])
        assert result["backbone_exit_code"] == 0, result
        assert result["tokens_identical"] is True, result
        assert result["verdict"] in ("within the audit bound, tokens identical", "bitwise equal"), result
        assert result["local_rows"] == 0 and result["fallback_calls"] == 0 and result["remote_rows"] > 0, result
        assert result["sessions_quarantined"] == [] and result["row_check_refusals"] == 0, result
        assert result["row_checked_rows"] == result["remote_rows"], result
        work = result["work"]
        assert isinstance(work, dict) and work[numpy_session.session_id]["rows"] > 0, work
        sessions = sw.list_sessions()
        credited = sw.wait_credited(sessions)
        for s in sessions:
            assert credited[s.session_id] == s.work_bytes > 0, (s.session_id, credited)
        credits = sw.ledger_credits(numpy_session.wallet)
        assert sum(c.bytes for c in credits) == credited[numpy_session.session_id] > 0, credits
    log = (tmp_path / "swarm" / "logs" / "numpy.log").read_text(errors="replace")
    assert "cpu (numpy)" in log and json.loads(log.splitlines()[0])  # it logged as the numpy worker
