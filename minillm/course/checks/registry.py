"""Exercise checkers, shared by the course notebooks and the test suite.

Each exercise is a fenced function (or method) inside ``minillm`` (``### BEGIN SOLUTION`` … ``### END SOLUTION``).
``EXERCISES`` is the registry: number → where the function lives, its title, a one-line hint and its checker.
The course build (``course/build.py``) reads it to render the student stub, whose body is
``raise NotImplementedError("Exercise N.k: <title> — <hint>")``.

A checker ``check_<name>(student, ...)``:
- calls the student's code on several inputs, edge cases included, and compares with the library's solution;
- raises ``AssertionError`` naming the input, the expected and the received value when they differ;
- lets any exception from the student's code through unchanged — a stub's ``NotImplementedError`` included, so a
  grader's report says which exercise is unfinished;
- prints ``✓ Exercise N.k passed: <title>`` on success.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

from minillm.config import ModelConfig


@dataclass(frozen=True)
class Exercise:
    """One exercise: ``target`` is the dotted path of the fenced function ("minillm.kv.contiguous.kv_bytes_per_token")
    or method ("minillm.kv.contiguous.KVCache.update")."""

    number: str
    target: str
    title: str
    hint: str
    check: Callable

    @property
    def stub_message(self) -> str:
        """What the student's stub raises (and so what a grader sees for an unfinished exercise)."""
        return f"Exercise {self.number}: {self.title} — {self.hint}"

    @property
    def module(self) -> str:
        """The module holding the target, e.g. "minillm.kv.contiguous"."""
        parts = self.target.split(".")
        for i in range(len(parts) - 1, 0, -1):
            name = ".".join(parts[:i])
            try:
                importlib.import_module(name)
                return name
            except ModuleNotFoundError:
                continue
        raise ModuleNotFoundError(f"no module found in {self.target!r}")

    @property
    def qualname(self) -> str:
        """The target's name inside its module: "kv_bytes_per_token" or "KVCache.update"."""
        return self.target[len(self.module) + 1 :]

    def reference(self):
        """The library's own function, method, or (for a method) its class."""
        obj = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj

    def answer(self):
        """What the checker takes, from the library: the function, or the class for a method exercise."""
        obj = importlib.import_module(self.module)
        for part in self.qualname.split(".")[:1]:
            obj = getattr(obj, part)
        return obj


EXERCISES: dict[str, Exercise] = {}


def exercise(number: str, target: str, title: str, hint: str):
    """Register the decorated checker as the one for exercise ``number`` (a fenced region in ``target``)."""

    def register(check: Callable) -> Callable:
        if number in EXERCISES:
            raise ValueError(f"exercise {number} is registered twice")
        EXERCISES[number] = Exercise(number, target, title, hint, check)
        check.exercise = number
        return check

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


# Small configurations with known answers.  Llama-2-7B: 32 layers, hidden 4096, MLP 11008, 32 heads (MHA),
# vocab 32000, untied embeddings (its config.json on the hub); SmolLM2-135M: the course's default model.
LLAMA2_7B = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                        num_kv_heads=32, head_dim=128, max_position_embeddings=4096)
SMOLLM2_135M = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                           num_kv_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True)
# A made-up multi-query model (one K/V head) to catch H_q used where H_kv belongs.
TINY_MQA = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                       num_kv_heads=1, head_dim=32, max_position_embeddings=512)
CONFIGS = {"Llama-2-7B": LLAMA2_7B, "SmolLM2-135M": SMOLLM2_135M, "tiny MQA": TINY_MQA}
