"""Exercise checkers, shared by the course notebooks and the test suite.

Each exercise is a fenced function (or method) inside ``minillm`` (``### BEGIN SOLUTION`` … ``### END SOLUTION``).
``EXERCISES`` is the registry: number → where the function lives, its title, a one-line hint and its checker.
The course build (``course/build.py``) reads it to render the student stub, whose body is
``raise NotImplementedError("Exercise N.k: <title> — <hint>")``.

A checker ``check_<name>(student, ...)``:
- calls the student's code on several inputs, edge cases included, and compares with an *independent* reference
  (numbers worked out by hand, a plain re-derivation, statistics the answer must have) — never with the library's
  own solution, which is hidden while the checker runs (below);
- raises ``AssertionError`` naming the input, the expected and the received value when they differ;
- lets any exception from the student's code through unchanged — a stub's ``NotImplementedError`` included, so a
  grader's report says which exercise is unfinished;
- prints ``✓ Exercise N.k passed: <title>`` on success.

**Hiding.** ``@exercise`` wraps every checker so that, while it runs, the library's solved function (or method)
raises ``LibrarySolutionCalled`` ("Exercise N.k: your answer calls the library's solution …").  The function
object itself is disarmed (its ``__code__`` is swapped for a raising one and restored afterwards, even when the
checker raises), so every route to it fails: the module attribute, ``from x import f`` aliases in other modules,
a reference bound before the check, and ``super().method(...)`` from a subclass of the solved class.  Should a
checker swallow that error, the wrapper raises it anyway: an answer that reached the library's solution never
passes.  ``Exercise.answer()`` is a fresh copy of the solution (the fenced source, executed again, as the solution
notebook runs it); it is importable from a notebook, so it cannot count as the student's work: a checker rejects a
copy it made (marked), and ``answer()`` / ``source()`` refuse to run while their own exercise is being checked (an
answer that fetches the solution lazily).  What stays undetectable: a student who copies the library's source into
the cell (or wraps an ``answer()`` copy in a function of their own); INSTRUCTORS.md says so.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from minillm.config import ModelConfig
from minillm.models.configs import llama2_7b_config, smollm2_135m_config

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


class LibrarySolutionCalled(AssertionError):
    """An answer under check called the library's own solution of the exercise being checked."""


ANSWER_MARK = "__minillm_answer_of__"  # set on every ``Exercise.answer()`` copy: the exercise number it solves
_ACTIVE: dict[str, _Tripwire] = {}  # exercise number -> its tripwire, while its checker runs


class _Tripwire:
    """Stands in a disarmed function's constants: counts the calls and builds the error they raise."""

    def __init__(self, message: str):
        self.message, self.calls = message, 0

    def called(self) -> LibrarySolutionCalled:
        self.calls += 1
        return LibrarySolutionCalled(self.message)


def _disarmed(*args, **kwargs):
    # Its code replaces a solved function's while a checker runs; the string constant is replaced by a _Tripwire
    # (a code object runs in the solved function's module, so it can name nothing of ours but a constant).
    raise "__minillm_tripwire__".called()


def _raiser(tripwire: _Tripwire) -> Callable:
    """A plain function that trips ``tripwire`` (stands in for a callable that is not a Python function)."""

    def hidden(*args, **kwargs):
        raise tripwire.called()

    return hidden


def split_fence(lines: list[str], where: str) -> tuple[int, int]:
    """Indices of the single BEGIN and END fence lines in ``lines``; ``ValueError`` unless exactly one of each."""
    begins = [i for i, ln in enumerate(lines) if ln.strip() == BEGIN]
    ends = [i for i, ln in enumerate(lines) if ln.strip() == END]
    if len(begins) != 1 or len(ends) != 1 or begins[0] > ends[0]:
        raise ValueError(f"{where}: need exactly one '{BEGIN}' followed by one '{END}', "
                         f"found {len(begins)} and {len(ends)}")
    return begins[0], ends[0]


@dataclass(frozen=True)
class Exercise:
    """One exercise: ``target`` is the dotted path of the fenced function ("minillm.kv.contiguous.kv_bytes_per_token")
    or method ("minillm.kv.contiguous.KVCache.update"); ``check`` its checker, guarded by the hiding (module
    docstring); ``hide`` more dotted paths to hide while checking (e.g. a second copy of the same solution)."""

    number: str
    target: str
    title: str
    hint: str
    check: Callable
    hide: tuple[str, ...] = ()

    @property
    def stub_message(self) -> str:
        """What the student's stub raises (and so what a grader sees for an unfinished exercise)."""
        return f"Exercise {self.number}: {self.title} — {self.hint}"

    @property
    def delegation_message(self) -> str:
        """What an answer that calls the library's solution raises while checked."""
        return (f"Exercise {self.number}: your answer calls the library's solution ({self.target}); "
                "write it yourself")

    @property
    def module(self) -> str:
        """The module holding the target, e.g. "minillm.kv.contiguous"."""
        return _module_of(self.target)

    @property
    def qualname(self) -> str:
        """The target's name inside its module: "kv_bytes_per_token" or "KVCache.update"."""
        return self.target[len(self.module) + 1 :]

    def reference(self):
        """The library's own function or method (disarmed while this exercise's checker runs)."""
        obj = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj

    def source(self) -> str:
        """The fenced function's source, dedented (a method keeps its own body indentation).  Refused (the
        tripwire's ``LibrarySolutionCalled``) while this exercise's checker runs."""
        if self.number in _ACTIVE:
            raise _ACTIVE[self.number].called()
        return textwrap.dedent(inspect.getsource(self.reference()))

    def code(self, student: bool) -> str:
        """The exercise as a notebook runs it: the solution without its fence lines, or (``student``) the stub
        whose fenced region is ``raise NotImplementedError(stub_message)``; a method inside
        ``class My<Class>(<Class>)``, a subclass of the library's class with only this method replaced."""
        lines = self.source().rstrip("\n").split("\n")
        begin, end = split_fence(lines, self.target)
        if student:
            indent = lines[begin][: len(lines[begin]) - len(lines[begin].lstrip())]
            message = self.stub_message.replace("\\", "\\\\").replace('"', '\\"')
            lines = lines[:begin] + [f'{indent}raise NotImplementedError("{message}")'] + lines[end + 1 :]
        else:
            lines = lines[:begin] + lines[begin + 1 : end] + lines[end + 1 :]
        parts = self.qualname.split(".")
        if len(parts) == 2:
            cls, method = parts
            lines = [f"class My{cls}({cls}):", f'    """{cls} with your own `{method}` (exercise {self.number})."""',
                     ""] + ["    " + ln if ln else "" for ln in lines]
        elif len(parts) != 1:
            raise ValueError(f"{self.target}: exercises are module functions or methods of a module-level class")
        return "\n".join(lines)

    def _run(self, code: str, tag: str):
        """Execute ``code`` among the target module's names (as a notebook has them imported); what it defines."""
        namespace = dict(vars(importlib.import_module(self.module)))
        flags = __import__("__future__").annotations.compiler_flag  # annotations stay strings, as in the module
        exec(compile(code, f"<exercise {self.number} {tag}>", "exec", flags=flags, dont_inherit=True), namespace)
        parts = self.qualname.split(".")
        return namespace[f"My{parts[0]}"] if len(parts) == 2 else namespace[parts[0]]

    def answer(self):
        """A fresh copy of the library's solution, as the checker takes it (the function, or the ``My<Class>``
        subclass for a method): what the solution notebook runs, untouched by the hiding — but marked
        (``ANSWER_MARK``), so that this exercise's checker rejects it as delegation, and refused while that
        checker runs.  (Tests that need an unmarked copy execute ``code(student=False)`` themselves.)"""
        copy = self._run(self.code(student=False), "solution")
        setattr(copy, ANSWER_MARK, self.number)
        return copy

    def stub(self):
        """The student's stub as the build renders it: raises ``NotImplementedError(stub_message)``."""
        return self._run(self.code(student=True), "stub")

    def delegate(self):
        """An answer that only calls the library's solution (through ``super()`` for a method): must fail."""
        parts = self.qualname.split(".")
        if len(parts) == 1:
            solved = self.reference()
            return functools.wraps(solved)(lambda *args, **kwargs: solved(*args, **kwargs))
        cls, method = parts
        namespace = {cls: getattr(importlib.import_module(self.module), cls)}
        exec(f"class My{cls}({cls}):\n    def {method}(self, *args, **kwargs):\n"
             f"        return super().{method}(*args, **kwargs)\n", namespace)
        return namespace[f"My{cls}"]

    @contextmanager
    def hidden(self) -> Iterator[_Tripwire]:
        """Disarm the library's solution (``target`` and ``hide``) for the duration; yields the tripwire, whose
        ``calls`` counts the attempts to call it.  Restored on exit, exceptions included."""
        tripwire = _Tripwire(self.delegation_message)
        undo: list[Callable[[], None]] = []
        outer = _ACTIVE.get(self.number)
        _ACTIVE[self.number] = tripwire
        try:
            for path in (self.target, *self.hide):
                undo += _disarm(path, tripwire)
            yield tripwire
        finally:
            for restore in reversed(undo):
                restore()
            if outer is None:
                _ACTIVE.pop(self.number, None)
            else:
                _ACTIVE[self.number] = outer


def _module_of(path: str) -> str:
    """The longest importable module prefix of a dotted path."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:i])
        try:
            importlib.import_module(name)
            return name
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"no module found in {path!r}")


def _disarm(path: str, tripwire: _Tripwire) -> list[Callable[[], None]]:
    """Make the callable at ``path`` trip ``tripwire``; the functions that undo it.

    A Python function has its code swapped (every reference to it then fails, however it was obtained); a
    wrapper (a cache, a jitted kernel) is also replaced wherever its class or a module of the target's package
    (``minillm``) holds it."""
    module = _module_of(path)
    owner = importlib.import_module(module)
    *outer, name = path[len(module) + 1 :].split(".")
    for part in outer:
        owner = getattr(owner, part)
    raw = vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)
    func = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else getattr(raw, "fget", raw)
    inner = inspect.unwrap(func) if callable(func) else func
    undo: list[Callable[[], None]] = []
    if isinstance(inner, types.FunctionType) and not inner.__code__.co_freevars:
        code = inner.__code__
        template = _disarmed.__code__
        consts = tuple(tripwire if c == "__minillm_tripwire__" else c for c in template.co_consts)
        inner.__code__ = template.replace(co_consts=consts, co_name=code.co_name, co_qualname=code.co_qualname)
        undo.append(functools.partial(setattr, inner, "__code__", code))
        if raw is inner:
            return undo
    top = module.split(".")[0]  # the package whose modules may hold aliases: minillm for every exercise
    holders = [owner] + [m for n, m in list(sys.modules.items())
                         if (n == top or n.startswith(top + ".")) and m is not owner and m is not None]
    stand_in = _raiser(tripwire)
    if isinstance(raw, (staticmethod, classmethod)):  # keep the descriptor kind in the class's dict
        stand_in = type(raw)(stand_in)
    for holder in holders:
        for key, value in list(vars(holder).items()):
            if value is raw and not (key.startswith("__") and key != name):
                setattr(holder, key, stand_in)
                undo.append(functools.partial(setattr, holder, key, value))
    return undo


EXERCISES: dict[str, Exercise] = {}


def exercise(number: str, target: str, title: str, hint: str, *, hide: tuple[str, ...] = ()):
    """Register the decorated checker as the one for exercise ``number`` (a fenced region in ``target``).

    Returns the checker wrapped so that it runs with the library's solution hidden (module docstring): an answer
    that calls it fails with ``LibrarySolutionCalled``, even if the checker caught the error."""

    def register(check: Callable) -> Callable:
        if number in EXERCISES:
            raise ValueError(f"exercise {number} is registered twice")

        @functools.wraps(check)
        def guarded(*args, **kwargs):
            ex = EXERCISES[number]
            if any(getattr(a, ANSWER_MARK, None) == number for a in (*args, *kwargs.values())):
                raise LibrarySolutionCalled(ex.delegation_message + " (EXERCISES[...].answer() is the library's "
                                                                    "solution, not yours)")
            with ex.hidden() as tripwire:
                try:
                    result = check(*args, **kwargs)
                except LibrarySolutionCalled:
                    raise
                except Exception as e:
                    if tripwire.calls:  # the checker turned the refusal into another error: say what happened
                        raise LibrarySolutionCalled(ex.delegation_message) from e
                    raise
            if tripwire.calls:  # the checker swallowed the refusal: the answer still reached the solution
                raise LibrarySolutionCalled(ex.delegation_message)
            return result

        guarded.exercise = number
        EXERCISES[number] = Exercise(number, target, title, hint, guarded, tuple(hide))
        return guarded

    return register


def _passed(number: str) -> None:
    print(f"✓ Exercise {number} passed: {EXERCISES[number].title}")


def _close(got, expected, rel: float = 1e-9, abs_: float = 0.0) -> bool:
    """``got`` is a number (Python, numpy or a one-element tensor) within the tolerances of ``expected``."""
    if got is None or isinstance(got, bool):
        return False
    try:
        return math.isclose(float(got), expected, rel_tol=rel, abs_tol=abs_)
    except (TypeError, ValueError, RuntimeError):
        return False


# Configurations with known answers: Llama-2-7B (MHA, untied) and SmolLM2-135M (GQA, tied; the course's default
# model), their shapes from ``minillm.models.configs``.
LLAMA2_7B = llama2_7b_config()
SMOLLM2_135M = smollm2_135m_config()
# A made-up multi-query model (one K/V head) to catch H_q used where H_kv belongs.
TINY_MQA = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                       num_kv_heads=1, head_dim=32, max_position_embeddings=512)
CONFIGS = {"Llama-2-7B": LLAMA2_7B, "SmolLM2-135M": SMOLLM2_135M, "tiny MQA": TINY_MQA}
