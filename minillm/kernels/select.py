"""Which implementation runs each op."""

from __future__ import annotations

# "auto": the native CPU decode kernels on CPU, Triton attention on CUDA; "torch": the PyTorch references only;
# "native": require the native CPU kernels; "triton": force the Triton attention kernels (CPU: TRITON_INTERPRET=1).
KERNEL_CHOICES = ("auto", "torch", "native", "triton")


def attention_impl(kernels: str) -> str:
    """The ``impl`` argument of ``minillm.kernels`` attention functions for a model-level ``kernels`` choice."""
    return {"auto": "auto", "native": "auto", "triton": "triton"}.get(kernels, "torch")
