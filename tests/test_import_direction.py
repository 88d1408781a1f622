"""The engine core never imports the layers built on it: ``minillm.perf`` (cost models, benchmarks), ``minillm.course``
(checks, predictions) and ``minillm.entrypoints`` (CLI, server) import the core, never the other way round — not even
lazily inside a function.  So the engine can be read, imported and tested without them.

``minillm.compress`` is not core: pruning, distillation and early exit are studies scored by perplexity
(``minillm.perf.perplexity``), and nothing in the core uses them.  The import graph (every import of every file,
module level or inside functions, relative ones resolved) is ``test_imports.import_graph``'s.
"""

from __future__ import annotations

from test_imports import PACKAGE_DIR, import_graph  # the graph the cycle test walks (tests/ is on sys.path)

CORE = ("config", "dtypes", "outputs", "llm", "models", "layers", "kernels", "kv", "engine", "sampling", "spec",
        "quant", "distributed")  # and the root package's __init__
FORBIDDEN = ("minillm.perf", "minillm.course", "minillm.entrypoints")


def is_core(module: str) -> bool:
    """"minillm" (the root __init__) and every module of a ``CORE`` package or module."""
    parts = module.split(".")
    return parts[0] == "minillm" and (len(parts) == 1 or parts[1] in CORE)


def is_forbidden(target: str) -> bool:
    return any(target == f or target.startswith(f + ".") for f in FORBIDDEN)


def violations(graph: dict[str, set[str]]) -> list[str]:
    """"<core module> imports <forbidden module>" for every such edge of ``graph``, sorted."""
    return [f"{m} imports {t}" for m in sorted(graph) if is_core(m) for t in sorted(graph[m]) if is_forbidden(t)]


def test_every_core_name_is_a_module_or_package_of_minillm():
    missing = [n for n in CORE if not (PACKAGE_DIR / f"{n}.py").exists()
               and not (PACKAGE_DIR / n / "__init__.py").exists()]
    assert not missing, f"CORE names what minillm does not have: {missing}"
    assert sum(map(is_core, import_graph())) > 40  # the walk reaches the core's files


def test_the_graph_sees_the_imports_of_the_core():
    graph = import_graph()
    assert "minillm.engine.llm_engine" in graph["minillm.llm"]
    assert "minillm.kv.quant" in graph["minillm.kv.paged_cache"]


def test_a_core_module_importing_perf_course_or_entrypoints_is_named():
    graph = {"minillm.kv.quant": {"minillm.perf.roofline", "minillm.config"},
             "minillm": {"minillm.course.checks"},
             "minillm.llm": {"minillm.entrypoints"},
             "minillm.perf.roofline": {"minillm.kv.quant"},  # perf importing the core is the right direction
             "minillm.compress.early_exit": {"minillm.perf.perplexity"},  # compress is not core
             "minillm.kernels.probe": {"minillm.performance_notes"}}  # a prefix, not the package
    assert violations(graph) == ["minillm imports minillm.course.checks",
                                 "minillm.kv.quant imports minillm.perf.roofline",
                                 "minillm.llm imports minillm.entrypoints"]


def test_the_core_never_imports_perf_course_or_entrypoints():
    found = violations(import_graph())
    assert not found, "the core imports a layer above it:\n" + "\n".join(found)
