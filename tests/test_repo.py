"""Repository contracts: generated code is fresh, layering is one-way, protos lint clean."""

from __future__ import annotations

import ast
import filecmp
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMPONENTS = ("backbone", "worker", "relay", "ledger")


@pytest.mark.integration
def test_generated_code_is_fresh(tmp_path):
    out = tmp_path / "_gen"
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen_proto.py"), str(out)], check=True, timeout=120)
    committed = ROOT / "kvasir_rpc" / "_gen"
    fresh = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    have = sorted(p.relative_to(committed) for p in committed.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert fresh == have, "generated files differ: run `make proto`"
    stale = [str(p) for p in fresh if not filecmp.cmp(out / p, committed / p, shallow=False)]
    assert not stale, f"stale generated code {stale}: run `make proto`"


def _imports(pkg: str) -> set[str]:
    found: set[str] = set()
    for path in (ROOT / pkg).rglob("*.py"):
        if "_gen" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("pkg", ["kvasir_rpc", *(c for c in COMPONENTS if (ROOT / c).exists())])
def test_layering_is_one_way(pkg):
    forbidden = set(COMPONENTS) - {pkg}
    assert not (_imports(pkg) & forbidden), f"{pkg} imports {_imports(pkg) & forbidden}"


@pytest.mark.integration
def test_relay_does_not_import_torch():
    # The relay runs on small machines; it must start without torch.
    code = "import sys, relay, relay.__main__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.integration
def test_buf_lint_clean():
    buf = shutil.which("buf", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("buf")
    if buf is None:
        pytest.fail("buf is not installed; `make test` installs buf-bin into .venv")
    out = subprocess.run([buf, "lint"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
