"""Repository contracts: generated code is fresh, layering is one-way, components use only the
library's public names, the library does not import its dev tooling, protos lint clean."""

from __future__ import annotations

import ast
import filecmp
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The components, and the kvasir command's package: each imports the library's public names
# only, and none of the others (the tooling meets the components as processes, over the wire).
COMPONENTS = ("backbone", "worker", "relay", "ledger", "kvasir")


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
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found |= names
    return found


@pytest.mark.parametrize("pkg", ["kvasir_rpc", *(c for c in COMPONENTS if (ROOT / c).exists())])
def test_layering_is_one_way(pkg):
    forbidden = set(COMPONENTS) - {pkg}
    assert not (_imports(pkg) & forbidden), f"{pkg} imports {_imports(pkg) & forbidden}"


PRODUCT = ("kvasir_rpc", *COMPONENTS)


def _module_of(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """module -> the product modules it imports when it runs: module-level and function-level
    imports, not those under ``if TYPE_CHECKING:`` (types only, never run)."""
    modules = {_module_of(p): p for pkg in PRODUCT for p in _py_files(pkg)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                       for n in ast.walk(node)}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def test_no_import_circles_in_product_code():
    """No module of the library or a component imports itself back through others (Tarjan's
    strongly connected components over the import graph)."""
    graph = _import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                circles.append(sorted(scc))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert len(graph) > 100 and not circles, f"import circles: {circles}"


def _library_imports(path: pathlib.Path) -> list[tuple[int, str, list[str]]]:
    """Every import of kvasir_rpc in ``path``, function-level ones included, as
    (line, absolute module, imported names); ``import kvasir_rpc.x`` has no names."""
    found: list[tuple[int, str, list[str]]] = []
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "kvasir_rpc"]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolve against the file's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            if module.split(".")[0] == "kvasir_rpc":
                found.append((node.lineno, module, [a.name for a in node.names]))
    return found


def _py_files(pkg: str) -> list[pathlib.Path]:
    return sorted(p for p in (ROOT / pkg).rglob("*.py") if "_gen" not in p.parts)


@pytest.mark.parametrize("pkg", [c for c in COMPONENTS if (ROOT / c).exists()])
def test_components_use_only_public_library_names(pkg):
    import kvasir_rpc

    public = set(kvasir_rpc.__all__)
    bad = []
    for path in _py_files(pkg):
        rel = path.relative_to(ROOT).as_posix()
        for line, module, names in _library_imports(path):
            parts = module.split(".")
            where = f"{rel}:{line}"
            if any(p.startswith("_") for p in parts):
                bad.append(f"{where}: private module {module}")
            elif module == "kvasir_rpc":
                bad += [f"{where}: kvasir_rpc.{n} is not in kvasir_rpc.__all__" for n in names if n not in public]
            else:
                bad += [f"{where}: private name {module}.{n}" for n in names if n.startswith("_")]
    assert not bad, "components import only public kvasir_rpc names (add to kvasir_rpc._LAZY):\n" + "\n".join(bad)


def test_the_library_imports_no_component_nor_the_tooling():
    """kvasir_rpc is only a library: not one import of a component or of the kvasir command's
    package, function-level ones included."""
    bad = []
    for path in _py_files("kvasir_rpc"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module]
            else:
                continue
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {m}" for m in modules if m.split(".")[0] in COMPONENTS]
    assert not bad, f"the library imports what is built on it: {bad}"


@pytest.mark.integration
def test_every_public_name_resolves_without_dev_tooling():
    code = (
        "import sys, kvasir_rpc\n"
        "bad = []\n"
        "for name in kvasir_rpc.__all__:\n"
        "    try:\n"
        "        getattr(kvasir_rpc, name)\n"
        "    except Exception as exc:\n"
        "        bad.append(f'{name}: {exc!r}')\n"
        "assert not bad, bad\n"
        "dev = sorted(m for m in sys.modules if m.split('.')[0] == 'kvasir')\n"
        "assert not dev, dev\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr


@pytest.mark.integration
def test_gateway_imports_no_protobuf_or_grpc():
    # The public gateway only splices WebSockets: it starts without protobuf and gRPC.
    code = (
        "import sys, relay.__main__, relay.gateway._gateway\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'grpc', 'google', 'torch'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


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
