"""CPU kernels: plain C (``csrc/``), compiled on first use and called through ctypes (``native``, ``quant``,
``decode``), and two ATen paths for prefill rows: ``prefill`` (causal attention over query tiles) and ``onednn``
(linears on oneDNN-packed weights)."""
