"""Grading cannot be bypassed: over every registered exercise (those added later included), the checker passes
the library's solution, fails the build's stub, and fails an answer that only calls the library's solution; the
hiding that makes the last one fail is undone after every check; ``course/grade.py`` reports each exercise."""

from __future__ import annotations

import csv
import functools
import importlib.util
import inspect
import re
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

from minillm.course.checks import EXERCISES, registry
from minillm.course.checks.registry import Exercise, LibrarySolutionCalled

ROOT = Path(__file__).resolve().parents[2]
NUMBERS = sorted(EXERCISES, key=lambda n: tuple(int(x) for x in n.split(".")))

# Checkers that still compute their expected values with the library's own solution, so they fail the library's
# own (hidden) solution too.  Their owner is making them independent; strict: a fixed one XPASSes, so delete it.
# Exercises whose generic delegating answer (``Exercise.delegate``: a ``*args, **kwargs`` wrapper) cannot run at all.
NOT_WRAPPABLE = {"4.3": "a Triton program: triton.jit refuses a **kwargs wrapper, so the generic delegate cannot "
                        "be launched (a student program calling the library's is still caught: its code is swapped)"}
NOT_WRAPPABLE["5.5"] = NOT_WRAPPABLE["7.6"] = NOT_WRAPPABLE["4.3"]  # the paged decode and int4 GEMV programs


def _load(name: str):
    key = f"course_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "course" / f"{name}.py")
        sys.modules[key] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[key]


sys.path.insert(0, str(ROOT / "course"))  # grade.py imports build as a sibling
grade = _load("grade")


# ------------------------------------------------------------------------------------- every exercise
def test_exercises_are_registered():
    assert NUMBERS, "no exercises registered"


@pytest.mark.parametrize("number", NUMBERS)
def test_checker_passes_the_library_solution(number, capsys, solution_copy):
    EXERCISES[number].check(solution_copy(EXERCISES[number]))
    assert f"✓ Exercise {number} passed" in capsys.readouterr().out


@pytest.mark.parametrize("number", NUMBERS)
def test_checker_fails_the_stub_with_its_not_implemented_error(number):
    ex = EXERCISES[number]
    with pytest.raises(NotImplementedError, match=rf"^Exercise {re.escape(number)}: "):
        ex.check(ex.stub())


@pytest.mark.parametrize("number", NUMBERS)
def test_checker_fails_an_answer_that_delegates_to_the_library(number, capsys):
    if number in NOT_WRAPPABLE:
        pytest.skip(NOT_WRAPPABLE[number])
    ex = EXERCISES[number]
    with pytest.raises(LibrarySolutionCalled, match=rf"^Exercise {re.escape(number)}: your answer calls the "
                                                    r"library's solution \(.*\); write it yourself$"):
        ex.check(ex.delegate())


@pytest.mark.parametrize("number", NUMBERS)
def test_checker_fails_the_registrys_answer_passed_as_the_students_work(number):
    """``EXERCISES[n].answer()`` is one importable line away from a notebook: as the answer itself it is rejected."""
    ex = EXERCISES[number]
    with pytest.raises(LibrarySolutionCalled, match=rf"^Exercise {re.escape(number)}: .*answer\(\) is the library"):
        ex.check(ex.answer())


@pytest.mark.parametrize("number", NUMBERS)
def test_checker_fails_an_answer_that_fetches_the_registrys_answer_while_checked(number):
    """An answer that calls ``EXERCISES[n].answer()`` (or reads the solution's source) only when it runs."""
    if number in NOT_WRAPPABLE:
        pytest.skip(NOT_WRAPPABLE[number])
    ex = EXERCISES[number]
    delegating = ex.delegate()  # the right signature and, for a method, the right class to build on
    if isinstance(delegating, type):
        method = ex.qualname.split(".")[-1]

        def lazy(self, *args, **kwargs):
            return getattr(EXERCISES[number].answer(), method)(self, *args, **kwargs)

        answer = type(delegating.__name__, delegating.__bases__, {method: lazy})
    else:
        def answer(*args, **kwargs):
            return EXERCISES[number].answer()(*args, **kwargs)

    with pytest.raises(LibrarySolutionCalled, match=rf"^Exercise {re.escape(number)}: your answer calls"):
        ex.check(answer)
    assert ex.answer() is not None  # refused only while its own check runs


@pytest.mark.parametrize("number", NUMBERS)
def test_library_solution_works_again_after_a_failed_check(number):
    ex = EXERCISES[number]
    solved = ex.reference()
    code = solved.__code__
    with pytest.raises(NotImplementedError):
        ex.check(ex.stub())
    assert ex.reference() is solved and solved.__code__ is code


@pytest.mark.parametrize("number", NUMBERS)
def test_solution_and_stub_copies_are_not_the_library_function(number):
    ex = EXERCISES[number]
    solved = ex.reference()
    for copy in (ex.answer(), ex.stub()):
        own = getattr(copy, ex.qualname.split(".")[-1]) if isinstance(copy, type) else copy
        # decorated functions (torch.no_grad) share the decorator's wrapper code: compare what they wrap
        assert own is not solved and inspect.unwrap(own).__code__ is not inspect.unwrap(solved).__code__


# ------------------------------------------------------------------------------------- the mechanism
FIXTURE = '''
import functools


def area(w, h=1, *, scale=1):
    """w × h × scale."""
    if w < 0:
        raise ValueError("w must be >= 0")
    ### BEGIN SOLUTION
    return w * h * scale
    ### END SOLUTION


class Box:
    """Holds a size."""

    def __init__(self, n):
        self.n = n

    def grow(self, k):
        """n + k."""
        ### BEGIN SOLUTION
        return self.n + k
        ### END SOLUTION

    @staticmethod
    def unit(k):
        """k boxes of one."""
        ### BEGIN SOLUTION
        return [1] * k
        ### END SOLUTION


@functools.lru_cache
def cached_area(w):
    """A wrapper the code swap cannot reach alone: its cache answers without calling."""
    ### BEGIN SOLUTION
    return area(w)
    ### END SOLUTION
'''


@pytest.fixture
def lib(tmp_path, monkeypatch):
    """A package ``minillm_fixture_lib`` with fenced functions and a module importing one by name."""
    pkg = tmp_path / "minillm_fixture_lib"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "solved.py").write_text(textwrap.dedent(FIXTURE))
    (pkg / "user.py").write_text("from minillm_fixture_lib.solved import area, cached_area\n\n\n"
                                 "def engine_path(w):\n    return area(w)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import minillm_fixture_lib.solved as solved
    import minillm_fixture_lib.user as user
    yield solved, user
    for name in [n for n in sys.modules if n.startswith("minillm_fixture_lib")]:
        del sys.modules[name]


def _exercise(target: str, check=lambda answer: None) -> Exercise:
    return Exercise("99.1", target, "a fixture", "multiply", check)


def test_hiding_catches_every_route_to_the_solved_function_and_undoes_itself(lib):
    solved, user = lib
    bound_before = solved.area
    ex = _exercise("minillm_fixture_lib.solved.area")
    with ex.hidden() as tripwire:
        for route in (lambda: solved.area(2), lambda: bound_before(2, 3), lambda: user.area(2),
                      lambda: user.engine_path(2), lambda: solved.area(w=2, h=3, scale=4)):
            with pytest.raises(LibrarySolutionCalled, match=r"^Exercise 99\.1: your answer calls the library's "
                                                            r"solution \(minillm_fixture_lib\.solved\.area\)"):
                route()
        assert tripwire.calls == 5
    assert solved.area(2, 3) == 6 and user.engine_path(4) == 4 and solved.area is bound_before


def test_hiding_is_undone_when_the_check_raises(lib):
    solved, _ = lib
    ex = _exercise("minillm_fixture_lib.solved.area")
    with pytest.raises(KeyError), ex.hidden():
        raise KeyError("the checker blew up")
    assert solved.area(5) == 5


def test_a_subclass_calling_super_is_caught_and_an_override_is_not(lib):
    solved, _ = lib
    ex = _exercise("minillm_fixture_lib.solved.Box.grow")
    delegating, answer = ex.delegate(), ex.answer()
    assert issubclass(delegating, solved.Box) and issubclass(answer, solved.Box)
    with ex.hidden():
        with pytest.raises(LibrarySolutionCalled):
            delegating(1).grow(2)
        with pytest.raises(LibrarySolutionCalled):
            solved.Box(1).grow(2)
        assert answer(1).grow(2) == 3  # the solution's copy is the student's own code: it runs
    assert solved.Box(1).grow(2) == 3


def test_a_static_method_and_extra_hidden_paths_are_disarmed_too(lib):
    solved, _ = lib
    ex = Exercise("99.1", "minillm_fixture_lib.solved.Box.grow", "t", "h", lambda a: None,
                  hide=("minillm_fixture_lib.solved.Box.unit", "minillm_fixture_lib.solved.area"))
    with ex.hidden():
        for route in (lambda: solved.Box.unit(2), lambda: solved.Box(1).unit(2), lambda: solved.area(1)):
            with pytest.raises(LibrarySolutionCalled, match=r"\(minillm_fixture_lib\.solved\.Box\.grow\)"):
                route()
    assert solved.Box.unit(2) == [1, 1] and isinstance(vars(solved.Box)["unit"], staticmethod)


def test_a_wrapped_solution_is_replaced_where_modules_hold_it(lib):
    solved, user = lib
    solved.cached_area(3)  # cached: the wrapper would answer without calling the disarmed function
    ex = _exercise("minillm_fixture_lib.solved.cached_area")
    with ex.hidden():
        for route in (solved.cached_area, user.cached_area):  # the module's attribute and an import of it
            with pytest.raises(LibrarySolutionCalled):
                route(3)
    assert solved.cached_area(3) == 3 and user.cached_area is solved.cached_area


def test_stub_solution_and_delegation_are_rendered_from_the_fence(lib):
    ex = _exercise("minillm_fixture_lib.solved.area")
    assert ex.answer()(2, 3, scale=2) == 12
    with pytest.raises(NotImplementedError, match=r"^Exercise 99\.1: a fixture — multiply$"):
        ex.stub()(2)
    with pytest.raises(ValueError, match="w must be >= 0"):
        ex.stub()(-1)  # code before the fence stays in the stub
    assert "### BEGIN SOLUTION" not in ex.code(student=True) + ex.code(student=False)


def test_a_checker_that_swallows_the_refusal_still_fails(lib, monkeypatch, capsys, solution_copy):
    monkeypatch.setattr(registry, "EXERCISES", {})

    @registry.exercise("99.2", "minillm_fixture_lib.solved.area", "area", "w × h")
    def check_area(area):
        try:
            area(2, 3)
        except Exception:  # a careless checker: "any error means the edge case was handled"
            pass
        print("✓ Exercise 99.2 passed: area")

    assert check_area.__name__ == "check_area" and check_area.exercise == "99.2"
    assert registry.EXERCISES["99.2"].check is check_area
    with pytest.raises(LibrarySolutionCalled):
        check_area(registry.EXERCISES["99.2"].delegate())
    check_area(solution_copy(registry.EXERCISES["99.2"]))  # the student's own code passes


def test_a_checker_that_rewraps_the_refusal_reports_delegation(lib, monkeypatch):
    monkeypatch.setattr(registry, "EXERCISES", {})

    @registry.exercise("99.3", "minillm_fixture_lib.solved.area", "area", "w × h")
    def check_area(area):
        try:
            area(2, 3)
        except Exception as e:
            raise AssertionError("area(2, 3) raised") from e

    with pytest.raises(LibrarySolutionCalled):
        check_area(functools.partial(lib[0].area))


# ------------------------------------------------------------------------------------- course/grade.py
def _cell(source: str, outputs: list, **minillm) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source, metadata={"minillm": minillm} if minillm else {})
    cell.outputs = outputs
    return cell


def _error(ename: str, evalue: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=[])


def _stream(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_output("stream", name="stdout", text=text)


def test_judge_tells_the_five_verdicts_apart():
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        _cell("", [], exercise="9.1"), _cell("", [], exercise="9.2"), _cell("", [], exercise="5.3"),
        _cell("", [], exercise="1.2"), _cell("", [], exercise="2.1"),
        _cell("checks.check_arrival_times(arrival_times)", [_stream("✓ Exercise 9.1 passed: the schedule\n")],
              checks=["9.1"]),
        _cell("checks.check_parse_stream(parse_stream)",
              [_error("NotImplementedError", "Exercise 9.2: TTFT, TPOT and ITL — ...")], checks=["9.2"]),
        _cell("checks.check_slot_mapping(slot_mapping)",  # printed a pass, then the hiding's verdict came
              [_stream("✓ Exercise 5.3 passed: slot mapping\n"),
               _error("LibrarySolutionCalled", "Exercise 5.3: your answer calls the library's solution (x)")],
              checks=["5.3"]),
        _cell("checks.check_percentile(percentile)",  # no metadata: found by the checker's name
              [_error("AssertionError", "percentile([1, 2], 50) returned 1, expected 1.5\nmore")]),
    ]
    got = grade.judge(nb)
    assert got == {
        "1.2": ("wrong", "AssertionError: percentile([1, 2], 50) returned 1, expected 1.5"),
        "2.1": ("missing", "no cell calls this exercise's checker"),
        "5.3": ("delegates-to-library", "Exercise 5.3: your answer calls the library's solution (x)"),
        "9.1": ("passed", ""),
        "9.2": ("unfinished", ""),
    }
    assert list(got) == ["1.2", "2.1", "5.3", "9.1", "9.2"]
    text = grade.table({"alice.ipynb": got})
    assert "alice.ipynb" in text and "1/5" in text


def test_another_exercises_not_implemented_error_is_wrong_not_unfinished():
    nb = nbformat.v4.new_notebook()
    nb.cells = [_cell("checks.check_slot_mapping(slot_mapping)",
                      [_error("NotImplementedError", "Exercise 5.2: grow a sequence")], checks=["5.3"])]
    assert grade.judge(nb)["5.3"][0] == "wrong"


def test_find_notebooks_searches_directories_and_skips_checkpoints(tmp_path):
    for rel in ("a/one.ipynb", "b/two.ipynb", "b/.ipynb_checkpoints/two-checkpoint.ipynb", "b/notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("{}")
    assert grade.find_notebooks([tmp_path]) == [tmp_path / "a/one.ipynb", tmp_path / "b/two.ipynb"]
    with pytest.raises(FileNotFoundError):
        grade.find_notebooks([tmp_path / "nope.ipynb"])
    assert grade.main([str(tmp_path / "b" / "notes.txt")]) == 2


def _student_notebook(answer: str) -> nbformat.NotebookNode:
    """A one-exercise notebook (exercise 9.1) as the build lays it out, with ``answer`` as the exercise cell."""
    nb = nbformat.v4.new_notebook()
    setup = ("import importlib\n\nfrom minillm.course import checks\n\n"
             "serve = importlib.import_module('minillm.perf.bench.serve')\n"
             "globals().update({k: v for k, v in vars(serve).items() if not k.startswith('__')})  # its imports")
    nb.cells = [nbformat.v4.new_code_cell(setup),
                nbformat.v4.new_code_cell(answer, metadata={"minillm": {"exercise": "9.1"}}),
                nbformat.v4.new_code_cell("checks.check_arrival_times(arrival_times)",
                                          metadata={"minillm": {"checks": ["9.1"]}})]
    return nb


@pytest.mark.slow  # three kernels: ~30 s on 2 cores
def test_grade_runs_a_directory_of_notebooks_into_a_csv_and_an_exit_status(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the kernels import this checkout's minillm
    ex = EXERCISES["9.1"]
    submissions = tmp_path / "submissions"
    submissions.mkdir()
    delegating = ("from minillm.perf.bench.serve import arrival_times as library\n\n\n"
                  "def arrival_times(n, rate, burstiness=1.0, seed=0):\n"
                  "    return library(n, rate, burstiness, seed)\n")
    nbformat.write(_student_notebook(ex.code(student=False)), submissions / "alice.ipynb")
    nbformat.write(_student_notebook(delegating), submissions / "bob.ipynb")
    assert grade.main([str(submissions), "--csv", str(tmp_path / "grades.csv"), "--timeout", "300"]) == 1
    rows = list(csv.DictReader((tmp_path / "grades.csv").open()))
    assert [(Path(r["notebook"]).name, r["exercise"], r["status"]) for r in rows] == [
        ("alice.ipynb", "9.1", "passed"), ("bob.ipynb", "9.1", "delegates-to-library")]
    assert "write it yourself" in rows[1]["detail"]
    out = capsys.readouterr().out
    assert "⇢ Exercise 9.1: delegates-to-library" in out and "1/1" in out and "0/1" in out
    assert [r["student"] for r in rows] == ["alice", "bob"]
    assert "bob  bob.ipynb  Exercise 9.1: delegates-to-library — Exercise 9.1: your answer calls" in out
    assert grade.main([str(submissions / "alice.ipynb")]) == 0


def test_students_are_the_first_folder_under_a_directory_given(tmp_path):
    root = tmp_path / "submissions"
    root.mkdir()
    assert grade.student_of(root / "alice" / "02_kv_cache.ipynb", [root]) == "alice"
    assert grade.student_of(root / "alice" / "week2" / "02_kv_cache.ipynb", [root]) == "alice"
    assert grade.student_of(root / "bob.ipynb", [root]) == "bob"
    assert grade.student_of(Path("carol") / "07_quantization.ipynb", [Path("carol") / "07_quantization.ipynb"]) \
        == "carol"


def test_totals_count_each_students_exercises_and_problems_say_which_and_why():
    graded = {"s/alice/02.ipynb": {"2.1": ("passed", ""), "2.2": ("wrong", "AssertionError: returned K differs")},
              "s/alice/03.ipynb": {"3.1": ("passed", "")},
              "s/bob/02.ipynb": {"2.1": ("delegates-to-library", "Exercise 2.1: your answer calls …"),
                                 "2.2": ("unfinished", "")}}
    students = {name: name.split("/")[1] for name in graded}
    lines = grade.totals(graded, students).splitlines()
    alice = next(ln for ln in lines if ln.startswith("alice"))
    bob = next(ln for ln in lines if ln.startswith("bob"))
    assert "2/3" in alice and "1 wrong" in alice
    assert "0/2" in bob and "1 unfinished" in bob and "1 delegates-to-library" in bob
    report = grade.problems(graded, students).splitlines()
    assert report == ["alice  02.ipynb  Exercise 2.2: wrong — AssertionError: returned K differs",
                      "bob  02.ipynb  Exercise 2.1: delegates-to-library — Exercise 2.1: your answer calls …",
                      "bob  02.ipynb  Exercise 2.2: unfinished"]
    assert grade.problems({"s/a/02.ipynb": {"2.1": ("passed", "")}}, {"s/a/02.ipynb": "a"}) == "every exercise passed"


def test_prediction_verdicts_read_judge_predictions_words_and_go_to_the_prediction_before_them():
    from minillm.course.checks import judge_prediction

    def judged(mine: float, measured: float, bound: float) -> str:
        return judge_prediction(mine, measured, bound=bound, what="x", unit="GB/s").text + "\n"

    assert grade.prediction_verdict(judged(10.0, 10.5, 20.0)) == "held"
    assert grade.prediction_verdict(judged(10.0, 5.0, 20.0)) == "too optimistic ×2.0"
    assert grade.prediction_verdict(judged(10.0, 20.0, 40.0)) == "too pessimistic ×2.0"
    assert grade.prediction_verdict(judged(30.0, 29.0, 20.0)) == "impossible: beats the bound"  # held, yet > bound
    assert grade.prediction_verdict("measured 5 GB/s; you have not written a prediction yet") == ""
    assert grade.is_prediction("4.0") and grade.is_prediction("4.4") and not grade.is_prediction("4.1")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        _cell("checks.check_prediction_attention(predict_attention_gb_s, 1.0)", [_stream("✓ Exercise 4.0 passed\n")],
              checks=["4.0"]),
        _cell("verdict = checks.judge_prediction(...)", [_stream(judged(10.0, 5.0, 20.0))]),
        _cell("checks.check_merge_attention_partials(f)", [_stream(judged(1.0, 1.0, 2.0))], checks=["4.1"]),
        _cell("checks.check_prediction_launch(predict_eager_step_ms, 1.0, 30)", [], checks=["4.4"]),
        _cell("launch_verdict = checks.judge_prediction(...)", [_stream(judged(30.0, 29.0, 20.0))]),
    ]
    assert grade.prediction_verdicts(nb) == {"4.0": "too optimistic ×2.0", "4.4": "impossible: beats the bound"}
