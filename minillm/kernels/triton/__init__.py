"""Triton kernels (CUDA; CPU tensors under ``TRITON_INTERPRET=1``): ``flash``, ``decode``, ``paged_decode``."""
