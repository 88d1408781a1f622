"""The engine core never imports the layers built on it: ``minillm.perf`` (cost models, benchmarks), ``minillm.course``
(checks, predictions) and ``minillm.entrypoints`` (CLI, server) import the core, never the other way round — not even
lazily inside a function.  So the engine can be read, imported and tested without them.

``minillm.compress`` is not core either: pruning, distillation and early exit are studies that measure perplexity
(``minillm.perf.perplexity``), and nothing in the core uses them.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "minillm"
CORE = ("__init__", "config", "dtypes", "outputs", "llm", "models", "layers", "kernels", "kv", "engine", "sampling",
        "spec", "quant", "distributed")
FORBIDDEN = ("minillm.perf", "minillm.course", "minillm.entrypoints")


def module_name(path: Path) -> str:
    """minillm/kv/quant.py -> "minillm.kv.quant"; a package's __init__.py -> the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file at ``path``."""
    return imports_in(path.read_text(encoding="utf-8"), module_name(path), is_package=path.name == "__init__.py")


def imports_in(source: str, module: str, *, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, the text of ``module``: module level, inside
    functions and classes, and relative ones resolved against the module's package.  ``from a import b`` yields
    "a.b" as well as "a", since b may be a submodule."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
    return found


def core_files() -> list[Path]:
    """Every .py file of the core packages and modules."""
    files = []
    for name in CORE:
        single = PACKAGE / f"{name}.py"
        files += [single] if single.exists() else sorted((PACKAGE / name).rglob("*.py"))
    return files


def forbidden(target: str) -> bool:
    return any(target == f or target.startswith(f + ".") for f in FORBIDDEN)


def test_every_core_name_is_a_module_or_package_that_exists():
    missing = [n for n in CORE if not (PACKAGE / f"{n}.py").exists() and not (PACKAGE / n / "__init__.py").exists()]
    assert not missing, f"CORE names modules that do not exist: {missing}"
    assert len(core_files()) > 40  # the walk really reads the tree


def test_the_walker_sees_module_level_lazy_and_relative_imports():
    assert "minillm.engine.llm_engine" in {t for _, t in imports_of(PACKAGE / "llm.py")}
    source = "import os\nfrom . import quant\ndef f():\n    from ..perf import roofline\n    import minillm.course\n"
    targets = [t for _, t in imports_in(source, "minillm.kv.probe")]
    assert targets == ["os", "minillm.kv", "minillm.kv.quant", "minillm.perf", "minillm.perf.roofline",
                       "minillm.course"]
    assert [t for _, t in imports_in("from .. import config", "minillm.kv", is_package=True)] == [
        "minillm", "minillm.config"]
    assert forbidden("minillm.perf.roofline") and forbidden("minillm.course") and not forbidden("minillm.performance")


def test_the_core_never_imports_perf_course_or_entrypoints():
    violations = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
                  for path in core_files() for line, target in imports_of(path) if forbidden(target)]
    assert not violations, "the core imports a layer above it:\n" + "\n".join(violations)
