"""Kernels: fast paths with a plain PyTorch reference each.

- ``cpu_gemv``: a native (C, compiled on first use) decode GEMV for CPUs; reference ``F.linear``.
"""
