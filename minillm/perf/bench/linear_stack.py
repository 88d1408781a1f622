"""The GEMVs of a decode step as one native loop: the benchmark harness that times the fused step's kernels alone.

``LinearStack`` runs a list of linear weights through ``kernels/cpu/decode.py``'s ``linear_stack`` (the same GEMV
kernels, in the same order and thread split, as the fused decode step) and reads the same bytes with no arithmetic
(``stack_read``): the stack's time against the memory roof of its own access pattern (``bench quant``).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from minillm.kernels.cpu import decode

vp = ctypes.c_void_p


class LinearStack:
    """A list of linear weights run as one native loop (``csrc/decode.c`` ``linear_stack``): the GEMVs of a decode
    step with no Python between them, for benchmarks that time the kernels alone (``bench quant``).

    ``weights``: fp32 [N, K] tensors, ``Int8Weight`` or ``Int4Weight`` (contiguous, CPU) — the kinds the fused step
    runs, through the same kernels (quantized ones with int8 activations, as ``decode_stack`` does); ``rows``: M
    (1..``decode.MAX_ROWS``).  ``inputs[i]`` [M, K_i] (zeros; one tensor per distinct K, shared by the weights of
    that K: fill it in place) and ``outputs[i]`` [M, N_i] are allocated once here, and their addresses passed to C
    once, so a call costs one ctypes dispatch.
    """

    def __init__(self, weights: list, rows: int = 1):
        if not decode.available():
            raise ValueError("the fused native decode library did not build here")
        if not 1 <= rows <= decode.MAX_ROWS:
            raise ValueError(f"rows must be in [1, {decode.MAX_ROWS}], got {rows}")
        if any(isinstance(w, Tensor) and w.dtype != torch.float32 for w in weights):
            raise ValueError("LinearStack runs fp32 activations: dense weights must be fp32 (bf16 ones run only in "
                             "the bf16 decode step)")
        keep: list[Tensor] = []
        self._table = (decode.LinearT * max(len(weights), 1))(*[decode.weight_struct(w, None, keep) for w in weights])
        for t in keep:
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("LinearStack needs contiguous CPU weights")
        self._keep, self.rows = keep, rows
        self.shapes = [(int(s.N), int(s.K)) for s in self._table[:len(weights)]]
        by_k = {K: torch.zeros(rows, K) for _, K in self.shapes}
        self.inputs = [by_k[K] for _, K in self.shapes]
        self.outputs = [torch.empty(rows, N) for N, _ in self.shapes]
        n = max(len(weights), 1)
        self._xs = (vp * n)(*[x.data_ptr() for x in self.inputs])
        self._ys = (vp * n)(*[y.data_ptr() for y in self.outputs])

    def __len__(self) -> int:
        return len(self.shapes)

    def run(self, one_region: bool = False) -> list[Tensor]:
        """outputs[i] = inputs[i] @ W_i^T for every weight, in order, in one native call.  ``one_region``: all the
        GEMVs inside one OpenMP region with a barrier around each (else one region per GEMV, as the fused decode step
        runs them); the results are the same.  Returns ``outputs`` (overwritten by the next call)."""
        decode.library().linear_stack(self._table, len(self), self._xs, self._ys, self.rows, int(one_region))
        return self.outputs

    def read_only(self) -> int:
        """Read every stored byte of the weights (codes, scales, mins) once, in ``run``'s order and thread split, with
        no arithmetic (``csrc/decode.c`` ``stack_read``): the memory roof of that access pattern, which ``run`` can
        approach but not beat.  Returns the OR of the bytes' 64-bit words."""
        return int(decode.library().stack_read(self._table, len(self)))
