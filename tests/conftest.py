"""Shared test setup.

TRITON_INTERPRET=1 is set here, before any Triton kernel is defined, when there is no CUDA GPU: the kernels then
run on CPU tensors in Triton's interpreter (fp32/fp16 only, small shapes).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_dir():
    """The default model converted once to a directory of config.json + safetensors + tokenizer."""
    from minillm.models.loader import resolve

    return resolve(None).directory


@pytest.fixture(scope="session")
def default_model():
    from minillm import load_model

    return load_model(None, dtype="float32", device="cpu")
