"""Quantization: number formats and their error (``formats``), packed int8/int4 weights with plain PyTorch
reference matmuls (``weight``), and the default model's own GGUF Q4_1/Q8_0 blocks read straight into those packed
weights (``gguf``).  The kernels that consume the packed weights live in ``minillm.kernels.cpu.quant`` (native C)
and ``minillm.kernels.triton.dequant_gemv`` (CUDA)."""
