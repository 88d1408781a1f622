"""Dtype names: one vocabulary for "bfloat16", "bf16" and ``torch.bfloat16``, and what each element costs.

- ``DTYPE_BYTES``: bytes per stored element, by canonical name ("float32", "bfloat16", "float8", "int4", ...).
- ``dtype_name``: the canonical name of a name, an alias ("bf16", "fp16", "half") or a ``torch.dtype``.
- ``dtype_bytes``: bytes per element of any of those, or of a plain number of bytes (``DType``).
- ``torch_dtype``: the ``torch.dtype`` of a name or alias that has one; ``MODEL_DTYPES``: the float dtypes a model
  runs in, under every name a user may give them.

The cost model (``minillm.perf``), the loader and the quantization formats all read these, so a name means
the same thing everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

# Bytes per stored element. "tf32" is a tensor-core mode on fp32 storage; "int4" packs two values per byte.
DTYPE_BYTES: Mapping[str, float] = MappingProxyType(
    {"float64": 8, "float32": 4, "tf32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "int8": 1, "int4": 0.5})
ALIASES: Mapping[str, str] = MappingProxyType(
    {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16", "fp8": "float8"})
_MODEL_FLOATS = ("float32", "float16", "bfloat16")
# The dtypes a model computes in, under every name ``load_model(dtype=...)`` accepts: canonical names and their
# aliases, except torch's own "float" (which the loader has never taken).
MODEL_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {name: getattr(torch, canon) for name, canon in {**{n: n for n in _MODEL_FLOATS}, **ALIASES}.items()
     if canon in _MODEL_FLOATS and name != "float"})
DType = str | torch.dtype | float  # a name, a torch dtype, or bytes per element (e.g. 0.5625 for int4 + scales)


def dtype_name(dtype: str | torch.dtype) -> str:
    """Canonical name ("bfloat16", "float8", ...) of a dtype given by name, alias or ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        name = "float8" if dtype.is_floating_point and dtype.itemsize == 1 else str(dtype).removeprefix("torch.")
    else:
        name = ALIASES.get(dtype, dtype)
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)} (or a torch.dtype)")
    return name


def dtype_bytes(dtype: DType) -> float:
    """Bytes per element: a dtype's width, or ``dtype`` itself when it is a positive number of bytes."""
    if isinstance(dtype, (int, float)) and not isinstance(dtype, bool):
        if dtype <= 0:
            raise ValueError(f"bytes per element must be > 0, got {dtype}")
        return float(dtype)
    return DTYPE_BYTES[dtype_name(dtype)]


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The ``torch.dtype`` named by ``dtype`` (canonical name or alias); "tf32" is fp32 storage.  ValueError for
    a name torch has no dtype of ("int4", "float8": which of e4m3 / e5m2 is ambiguous)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype_name(dtype)
    if name in ("int4", "float8"):
        raise ValueError(f"{dtype!r} has no single torch dtype")
    return torch.float32 if name == "tf32" else getattr(torch, name)
