"""Native CPU kernels: plain C (``csrc/``), compiled on first use and called through ctypes (``native``)."""
