"""The package's import graph: every module imports, and no two modules import each other, directly or through
others (a cycle means two modules are one concept, or one of them is in the wrong layer)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import minillm

PACKAGE_DIR = Path(minillm.__file__).parent
MODULES = sorted(m.name for m in pkgutil.walk_packages(minillm.__path__, "minillm.")
                 if not m.name.endswith("__main__"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The minillm modules an import statement loads (``from pkg import mod`` names the module mod)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("minillm")]
    base = node.module or ""
    if node.level:  # relative: resolve against the importer's package
        pkg = importer.split(".") if is_package else importer.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    if not base.startswith("minillm"):
        return []
    known = set(MODULES) | {"minillm"}
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """Module -> the minillm modules it imports anywhere in its file (lazy imports inside functions count too).
    Edges into the root package ``minillm`` are left out: its ``__init__`` only re-exports the public names."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        name = _module_name(path)
        if name.endswith("__main__"):
            continue
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(_resolve(name, path.name == "__init__.py", node))
        graph[name] = {e for e in edges if e != "minillm" and e != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("module", MODULES)
def test_every_module_imports(module):
    importlib.import_module(module)


def test_the_package_has_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_importing_minillm_loads_no_optional_heavy_dependency():
    import subprocess
    import sys

    code = ("import sys, minillm; "
            "print(','.join(m for m in ('triton', 'fastapi', 'uvicorn', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"`import minillm` imported {out}: import them lazily where they are used"


def test_the_import_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "minillm.engine.scheduler" in graph["minillm.engine.llm_engine"]
    assert "minillm.kernels.select" in graph["minillm.kernels"]
    assert "minillm.kernels.triton.flash" not in graph["minillm.kernels.validate"]
