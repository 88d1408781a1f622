"""Shared test setup.

TRITON_INTERPRET=1 is set here, before any Triton kernel is defined, when there is no CUDA GPU: the kernels then
run on CPU tensors in Triton's interpreter (fp32/fp16 only, small shapes).

`make test` runs tests/ in two pytest-xdist workers and the solution notebooks (nbval) in one
process afterwards: an xdist worker tears a notebook's kernel down between cells whenever its queue runs dry.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_dir():
    """The default model converted once to a directory of config.json + safetensors + tokenizer."""
    from minillm.models.loader import resolve

    return resolve(None).directory


@pytest.fixture(scope="session")
def default_llm():
    """One ``LLM()`` on the default model (fp32, CPU) for every test that needs the real model and its tokenizer:
    loading it costs seconds, so the session pays once.  Tests must leave it as they found it."""
    from minillm import LLM

    return LLM(dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def default_model(default_llm):
    """The default model's ``Transformer`` (the one ``default_llm`` runs: one copy of the weights)."""
    return default_llm.model


@pytest.fixture(scope="session")
def solution_copy():
    """``solution_copy(ex)``: an unmarked copy of exercise ``ex``'s solution, as the solution notebook's cell runs
    it.  ``Exercise.answer()`` copies are marked and rejected by their checker (a notebook can import them, so they
    are not a student's work); tests that pass the solution itself take this one."""
    return lambda ex: ex._run(ex.code(student=False), "test copy")
