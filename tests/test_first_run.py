"""What a newcomer meets first: `make` says what it installs before each slow step, and the
state the commands write by default (keys, tokens, databases, certificates, the wallet)
lands under `.kvasir/`, which git ignores."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest
from helpers import ROOT


def test_make_says_what_it_installs_before_each_slow_step(tmp_path: pathlib.Path) -> None:
    """`make -n` of a fresh venv: a line for the person comes before every pip install."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("needs make")
    # Run from `make test` too: the outer make's flags must not reach this one.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    plan = subprocess.run([make, "-n", "--no-print-directory", "venv", f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    installs = [i for i, line in enumerate(plan) if "pip install" in line]
    assert installs, plan
    assert plan[0].startswith("echo") and "first run" in plan[0], plan[:3]
    for i in installs:
        assert plan[i - 1].startswith("echo "), f"no line for the person before {plan[i]!r}"
    assert any("torch" in line and "progress-bar on" in line for line in plan), "torch's download is silent"


@pytest.mark.parametrize("path", [".kvasir/hub.key", ".kvasir/hub-backbone.token", ".kvasir/hub-contrib.sqlite",
                                  ".kvasir/ledger.db", ".kvasir/wallet.key", ".kvasir/certs/ca.key"])
def test_state_files_are_git_ignored(path: str) -> None:
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a checkout")
    done = subprocess.run([git, "-C", str(ROOT), "check-ignore", "-q", path], timeout=30, check=False)
    assert done.returncode == 0, f"{path} is not git-ignored"


def test_the_defaults_point_under_dot_kvasir() -> None:
    from kvasir.cli import DEFAULT_CERTS_DIR
    from kvasir_rpc import BACKBONE_TOKEN_FILE, STATE_DIR
    from worker.__main__ import DEFAULT_WALLET

    assert STATE_DIR == pathlib.Path(".kvasir")
    for path in (BACKBONE_TOKEN_FILE, DEFAULT_CERTS_DIR, DEFAULT_WALLET):
        assert path.parts[0] == ".kvasir", path


def test_kvasir_certs_writes_under_dot_kvasir_by_default(tmp_path: pathlib.Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from kvasir.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["certs"]) == 0
    certs = tmp_path / ".kvasir" / "certs"
    assert (certs / "ca.key").exists() and (certs / "gateway.pem").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".kvasir"]
