"""Grade students' notebooks: run each one and report every exercise as passed, unfinished or wrong.

    python course/grade.py [--fast] [--csv FILE] NOTEBOOK.ipynb [...]

Each notebook is executed top to bottom in a fresh kernel (errors do not stop it, as in ``pytest --nbval-lax``).
An exercise is judged by its check cell (the cell that calls ``checks.check_<name>``):
- **passed**: the cell printed "✓ Exercise N.k passed";
- **unfinished**: it raised the stub's ``NotImplementedError("Exercise N.k: …")``;
- **wrong**: it raised anything else — usually the checker's ``AssertionError``, whose first line is reported.
Check cells are found by their cell metadata (``minillm.course.checks``, written by the build) or, in a notebook whose
metadata was lost, by the checker names in their source.  ``--fast`` sets MINILLM_COURSE_FAST=1 (smaller
measurements; the checks are the same).  Exit status: 0 when every exercise of every notebook passed, else 1.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build  # noqa: E402  (course/build.py: execute(), checker_exercises())


def grade(path: Path, fast: bool = False) -> dict[str, tuple[str, str]]:
    """{exercise number: (status, detail)} for one notebook, executed afresh."""
    nb = nbformat.read(path, as_version=4)
    return judge(build.execute(nb, cwd=path.parent, fast=fast, allow_errors=True))


def judge(ran: nbformat.NotebookNode) -> dict[str, tuple[str, str]]:
    """{exercise number: (status, detail)} from an executed notebook's check cells."""
    results: dict[str, tuple[str, str]] = {}
    for cell in ran.cells:
        if cell.cell_type != "code":
            continue
        numbers = cell.metadata.get("minillm", {}).get("checks") or build.checker_exercises(cell.source)
        text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        errors = [o for o in cell.outputs if o.output_type == "error"]
        for number in numbers:
            if f"✓ Exercise {number} passed" in text:
                results[number] = ("passed", "")
            elif errors and errors[0].ename == "NotImplementedError" and \
                    errors[0].evalue.startswith(f"Exercise {number}:"):
                results[number] = ("unfinished", "")
            elif errors:
                results[number] = ("wrong", f"{errors[0].ename}: {errors[0].evalue.splitlines()[0][:300]}")
            else:
                results[number] = ("wrong", "the check printed no pass message")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--fast", action="store_true", help="run with MINILLM_COURSE_FAST=1")
    parser.add_argument("--csv", type=Path, help="also write notebook,exercise,status,detail rows here")
    args = parser.parse_args(argv)
    rows, all_passed = [], True
    for path in args.notebooks:
        results = grade(path, fast=args.fast)
        print(path)
        for number, (status, detail) in sorted(results.items()):
            mark = {"passed": "✓", "unfinished": "·", "wrong": "✗"}[status]
            print(f"  {mark} Exercise {number}: {status}{'  — ' + detail if detail else ''}")
            rows.append((str(path), number, status, detail))
            all_passed &= status == "passed"
        if not results:
            print("  no check cells found")
            all_passed = False
    if args.csv:
        with args.csv.open("w", newline="") as f:
            csv.writer(f).writerows([("notebook", "exercise", "status", "detail"), *rows])
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
