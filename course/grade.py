"""Grade students' notebooks: run each one and report every exercise as passed, unfinished, wrong or delegating.

    python course/grade.py [--fast] [--csv FILE] [--timeout S] PATH [PATH ...]

A PATH is a notebook or a directory of them (searched recursively; ``.ipynb_checkpoints`` skipped), so an
instructor grades forty submissions with ``python course/grade.py submissions/ --csv grades.csv``.  Each notebook
is executed top to bottom in a fresh kernel (errors do not stop it, as in ``pytest --nbval-lax``).  An exercise is
judged by its check cell (the cell that calls ``checks.check_<name>``):
- **passed**: the cell printed "✓ Exercise N.k passed" and raised nothing;
- **unfinished**: it raised the stub's ``NotImplementedError("Exercise N.k: …")``;
- **delegates-to-library**: it raised ``LibrarySolutionCalled`` — the answer called the library's own solution,
  which every checker hides while it runs (``minillm/course/checks/registry.py``);
- **wrong**: it raised anything else — usually the checker's ``AssertionError``, whose first line is reported;
- **missing**: the notebook has the exercise's cell but no cell calling its checker (deleted or renamed).
Check cells are found by their cell metadata (``minillm.checks``, written by the build) or, in a notebook whose
metadata was lost, by the checker names in their source.  ``--fast`` sets MINILLM_COURSE_FAST=1 (smaller
measurements; the checks are the same).

Output: one line per notebook and exercise, then a table (one row per notebook, one column per exercise:
✓ passed, · unfinished, ✗ wrong, ⇢ delegates, ? missing), the totals per student (a student is the first folder
under a directory given, e.g. ``submissions/alice/…``, or the notebook's name when it lies directly in it) and,
for every exercise not passed, which one and the checker's message; ``--csv`` also writes
``student,notebook,exercise,status,detail,prediction`` rows.  ``prediction`` is filled for the prediction exercises
(N.0, and 4.4): what the notebook's ``judge_prediction`` said of the student's number once it was measured —
"held" (within 15 % of the measurement), "too optimistic ×k" / "too pessimistic ×k", or "impossible: beats the
bound" (faster than the roofline bound allows, whatever the measurement); empty when no verdict was printed (the
prediction unwritten, or its measuring cell failed).  Exit status: 0 when every exercise of every notebook passed,
1 otherwise, 2 when no notebook was found.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build  # noqa: E402  (course/build.py: execute(), checker_exercises())

STATUSES = ("passed", "unfinished", "wrong", "delegates-to-library", "missing")
MARKS = {"passed": "✓", "unfinished": "·", "wrong": "✗", "delegates-to-library": "⇢", "missing": "?"}
DELEGATION_ERROR = "LibrarySolutionCalled"  # minillm.course.checks.registry.LibrarySolutionCalled
# What ``minillm.course.checks.judge_prediction`` prints of a prediction (its wording, read back here).
_OFF_BY = re.compile(r"your prediction was (?P<k>[\d.,]+)× too (?P<way>optimistic|pessimistic)")
_HELD, _BEYOND = "your prediction held", "your prediction is beyond"


def find_notebooks(paths: list[Path]) -> list[Path]:
    """The notebooks named by ``paths`` (files as given, directories searched recursively), in order."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found += sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
        elif path.suffix == ".ipynb" and path.exists():
            found.append(path)
        else:
            raise FileNotFoundError(f"{path}: not a notebook or a directory")
    return found


def student_of(path: Path, roots: list[Path]) -> str:
    """Whose notebook ``path`` is: its first folder under the directory in ``roots`` that holds it (its name when
    it lies directly there); for a notebook given by itself, its folder's name (or its own when that is ".")."""
    for root in roots:
        if root.is_dir() and path.is_relative_to(root):
            rel = path.relative_to(root)
            return rel.parts[0] if len(rel.parts) > 1 else rel.stem
    return path.parent.name or path.stem


def totals(graded: dict[str, dict[str, tuple[str, str]]], students: dict[str, str]) -> str:
    """One line per student: exercises passed of all graded, then the count of each other status."""
    lines = [f"{'student':16} {'passed':>9}  other verdicts"]
    for student in dict.fromkeys(students[n] for n in graded):
        statuses = [status for n, results in graded.items() if students[n] == student
                    for status, _ in results.values()]
        done = statuses.count("passed")
        rest = ", ".join(f"{statuses.count(s)} {s}" for s in STATUSES[1:] if statuses.count(s))
        lines.append(f"{student:16} {done:>4}/{len(statuses):<4}  {rest or '—'}")
    return "\n".join(lines)


def problems(graded: dict[str, dict[str, tuple[str, str]]], students: dict[str, str]) -> str:
    """One line per exercise not passed: student, notebook, exercise, verdict and what the checker said."""
    lines = [f"{students[name]}  {Path(name).name}  Exercise {number}: {status}" + (f" — {detail}" if detail else "")
             for name, results in graded.items() for number, (status, detail) in results.items()
             if status != "passed"]
    return "\n".join(lines) if lines else "every exercise passed"


def run(path: Path, fast: bool = False, timeout: int = 900) -> nbformat.NotebookNode:
    """One notebook executed afresh in its own folder (errors kept as outputs)."""
    nb = nbformat.read(path, as_version=4)
    return build.execute(nb, cwd=path.parent, fast=fast, allow_errors=True, timeout=timeout)


def grade(path: Path, fast: bool = False, timeout: int = 900) -> dict[str, tuple[str, str]]:
    """{exercise number: (status, detail)} for one notebook, executed afresh."""
    return judge(run(path, fast, timeout))


def _status(number: str, text: str, errors: list) -> tuple[str, str]:
    """One exercise's verdict from its check cell's printed text and error outputs."""
    if errors:  # an error wins over a pass message (a checker may print it before the hiding's verdict)
        e = errors[0]
        first = (e.evalue.splitlines() or [""])[0][:300]
        if e.ename == "NotImplementedError" and e.evalue.startswith(f"Exercise {number}:"):
            return "unfinished", ""
        if e.ename == DELEGATION_ERROR:
            return "delegates-to-library", first
        return "wrong", f"{e.ename}: {first}"
    if f"✓ Exercise {number} passed" in text:
        return "passed", ""
    return "wrong", "the check printed no pass message"


def judge(ran: nbformat.NotebookNode) -> dict[str, tuple[str, str]]:
    """{exercise number: (status, detail)} from an executed notebook's exercise and check cells."""
    results: dict[str, tuple[str, str]] = {}
    for cell in ran.cells:
        if cell.cell_type != "code":
            continue
        meta = cell.metadata.get("minillm", {})
        if "exercise" in meta:
            results.setdefault(meta["exercise"], ("missing", "no cell calls this exercise's checker"))
        numbers = meta.get("checks") or build.checker_exercises(cell.source)
        text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        errors = [o for o in cell.outputs if o.output_type == "error"]
        for number in numbers:
            results[number] = _status(number, text, errors)
    return dict(sorted(results.items(), key=lambda kv: tuple(int(x) for x in kv[0].split("."))))


def is_prediction(number: str) -> bool:
    """Whether exercise ``number`` is a prediction (its checker was made by ``prediction_checker``)."""
    ex = build.EXERCISES.get(number)
    return ex is not None and hasattr(ex.check, "bound")


def prediction_verdict(text: str) -> str:
    """The verdict ``judge_prediction`` printed in ``text``: "impossible: beats the bound", "held",
    "too optimistic ×k", "too pessimistic ×k", or "" when it printed none."""
    if _BEYOND in text:  # a prediction past the bound is impossible, however close the measurement came
        return "impossible: beats the bound"
    if _HELD in text:
        return "held"
    m = _OFF_BY.search(text)
    return f"too {m['way']} ×{m['k']}" if m else ""


def prediction_verdicts(ran: nbformat.NotebookNode) -> dict[str, str]:
    """{prediction exercise number: verdict} from an executed notebook: each verdict printed by a cell goes to the
    latest prediction checked before it (or in it) that has none yet — the notebook's order: record the number,
    measure, judge."""
    pending: list[str] = []
    verdicts: dict[str, str] = {}
    for cell in ran.cells:
        if cell.cell_type != "code":
            continue
        numbers = cell.metadata.get("minillm", {}).get("checks") or build.checker_exercises(cell.source)
        pending += [n for n in numbers if is_prediction(n)]
        text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        verdict = prediction_verdict(text)
        if verdict and pending:
            verdicts[pending.pop()] = verdict
    return verdicts


def table(graded: dict[str, dict[str, tuple[str, str]]]) -> str:
    """One row per notebook, one column per exercise (marks as in the module docstring), then totals."""
    numbers = sorted({n for r in graded.values() for n in r}, key=lambda n: tuple(int(x) for x in n.split(".")))
    width = max([len("notebook"), *(len(k) for k in graded)])
    lines = [f"{'notebook':{width}}  " + " ".join(f"{n:>5}" for n in numbers) + "  passed"]
    for name, results in graded.items():
        marks = [MARKS[results[n][0]] if n in results else "" for n in numbers]
        done = sum(s == "passed" for s, _ in results.values())
        lines.append(f"{name:{width}}  " + " ".join(f"{m:>5}" for m in marks) + f"  {done}/{len(results)}")
    legend = ", ".join(f"{m} {s}" for s, m in MARKS.items())
    return "\n".join(lines + [legend])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="notebooks, or directories of notebooks")
    parser.add_argument("--fast", action="store_true", help="run with MINILLM_COURSE_FAST=1")
    parser.add_argument("--csv", type=Path, help="also write student,notebook,exercise,status,detail,prediction "
                                                 "rows here")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell before it is stopped")
    args = parser.parse_args(argv)
    try:
        notebooks = find_notebooks(args.paths)
    except FileNotFoundError as e:
        print(f"grade: {e}", file=sys.stderr)
        return 2
    if not notebooks:
        print("grade: no notebooks found", file=sys.stderr)
        return 2
    graded: dict[str, dict[str, tuple[str, str]]] = {}
    students = {str(path): student_of(path, args.paths) for path in notebooks}
    rows, all_passed = [], True
    for path in notebooks:
        ran = run(path, fast=args.fast, timeout=args.timeout)
        results, verdicts = judge(ran), prediction_verdicts(ran)
        graded[str(path)] = results
        print(path)
        for number, (status, detail) in results.items():
            verdict = verdicts.get(number, "")
            print(f"  {MARKS[status]} Exercise {number}: {status}{'  — ' + detail if detail else ''}"
                  + (f"  (prediction: {verdict})" if verdict else ""))
            rows.append((students[str(path)], str(path), number, status, detail, verdict))
            all_passed &= status == "passed"
        if not results:
            print("  no exercises found")
            all_passed = False
    print("\n" + table(graded))
    print("\nper student\n" + totals(graded, students))
    print("\nwhat was wrong\n" + problems(graded, students))
    if args.csv:
        with args.csv.open("w", newline="") as f:
            csv.writer(f).writerows([("student", "notebook", "exercise", "status", "detail", "prediction"), *rows])
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
