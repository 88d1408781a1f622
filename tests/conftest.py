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


@pytest.fixture(scope="session")
def k_record_weight():
    """A factory ``make(N, K, seed) -> Int4Weight`` in K records (GGUF Q4_K's two levels; K a multiple of 256):
    random codes, fp16 super-scales d in [0.5, 1) · ``scale`` and −dmin in −[0.5, 1) · ``scale``, random 6-bit
    sub-values — what ``quant.gguf.q4_k_to_int4`` builds from a file, without the gguf package."""
    from minillm.quant.weight import K_RECORD, QK_K, Int4Weight

    def make(N: int, K: int, seed: int, scale: float = 1e-2) -> Int4Weight:
        g = torch.Generator().manual_seed(seed)
        S = K // QK_K

        def records(sign: float) -> torch.Tensor:
            sup = (sign * scale * (0.5 + 0.5 * torch.rand(N, S, 1, generator=g))).half().view(torch.uint8)  # [N,S,2]
            sub = torch.randint(0, 64, (N, S, K_RECORD - 2), generator=g, dtype=torch.uint8)
            return torch.cat([sup, sub], dim=-1)  # [N, S, 10]

        packed = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
        return Int4Weight(packed, records(1.0), records(-1.0), 32)

    return make
