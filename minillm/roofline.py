"""The roofline: what a machine can do, what a workload asks of it, and where a measurement lands.

Arithmetic intensity I = FLOPs / bytes moved; attainable FLOP/s = min(peak FLOP/s, I × bandwidth). Below the
ridge (peak / bandwidth) a kernel is memory bound, above it compute bound. A decode step reads every weight once
at I ≈ batch size, far below any GPU's ridge (~295 FLOP/byte on an H100 SXM), so its speed is bandwidth / bytes.

- Reference machines: ``HardwareSpec``, ``SPECS``, ``get_spec`` (dense datasheet figures).
- This machine: ``measure_device()`` → ``MeasuredSpec`` (read / copy / GEMV bandwidth, matmul FLOP/s per dtype).
- The cost model, plain arithmetic: ``linear_cost``, ``attention_cost``, ``prefill_cost``, ``decode_step_cost``.
- Helpers: ``ridge_point``, ``attainable_flops``, ``mbu``, ``mfu``, ``decode_tokens_per_s_bound``, ``plot_roofline``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cache, partial
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from .config import ModelConfig
from .kv_cache import kv_bytes_per_token

# Bytes per stored element. "tf32" is a tensor-core mode on fp32 storage; "int4" packs two values per byte.
DTYPE_BYTES: Mapping[str, float] = MappingProxyType(
    {"float64": 8, "float32": 4, "tf32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "int8": 1, "int4": 0.5})
PEAK_DTYPES = ("float32", "tf32", "float16", "bfloat16", "float8", "int8")  # keys a HardwareSpec may list
_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16",
            "fp8": "float8"}
DType = str | torch.dtype | float  # a name, a torch dtype, or bytes per element (e.g. 0.5625 for int4 + scales)


def dtype_name(dtype: str | torch.dtype) -> str:
    """Canonical name ("bfloat16", "float8", ...) of a dtype given by name, alias or ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        name = "float8" if dtype.is_floating_point and dtype.itemsize == 1 else str(dtype).removeprefix("torch.")
    else:
        name = _ALIASES.get(dtype, dtype)
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


def _plain(value: Any) -> Any:
    """Mappings (read-only views included) → plain dicts, recursively, for JSON."""
    return {k: _plain(v) for k, v in value.items()} if isinstance(value, Mapping) else value


# ---------------------------------------------------------------------------------------------- machines
@dataclass(frozen=True)
class HardwareSpec:
    """A machine's limits: dense peak FLOP/s per dtype, memory bandwidth (bytes/s), memory capacity (bytes).

    ``peak_flops`` keys come from ``PEAK_DTYPES``; figures are dense (datasheets' "with sparsity" numbers are 2×).
    ``memory_capacity`` 0 means unknown.
    """

    name: str
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    memory_capacity: int
    source: str

    def __post_init__(self):
        if not self.name or not self.source:
            raise ValueError("HardwareSpec needs a name and a source")
        if not self.peak_flops:
            raise ValueError(f"{self.name}: peak_flops must list at least one dtype")
        for k, v in self.peak_flops.items():
            if k not in PEAK_DTYPES or not v > 0:
                raise ValueError(f"{self.name}: peak_flops[{k!r}]={v!r}; keys from {PEAK_DTYPES}, values > 0")
        if not self.memory_bandwidth > 0 or self.memory_capacity < 0:
            raise ValueError(f"{self.name}: memory_bandwidth must be > 0 and memory_capacity ≥ 0")
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))  # frozen all the way down

    def peak(self, dtype: str | torch.dtype) -> float:
        """Dense peak FLOP/s for ``dtype``; ValueError naming the dtypes this machine lists."""
        name = dtype_name(dtype)
        if name not in self.peak_flops:
            raise ValueError(f"{self.name} lists no {name} peak; it has: {', '.join(self.peak_flops)}")
        return self.peak_flops[name]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        """Inverse of ``to_dict`` (e.g. a measurement saved on another machine)."""
        return cls(**{f.name: d[f.name] for f in fields(cls)})


_T = 1e12
SPECS: Mapping[str, HardwareSpec] = MappingProxyType({s.name: s for s in (
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (sparse figures halved); 80 GB HBM3
    HardwareSpec("H100-SXM", {"float32": 67 * _T, "tf32": 494.5 * _T, "bfloat16": 989 * _T, "float16": 989 * _T,
                              "float8": 1979 * _T, "int8": 1979 * _T}, 3.35e12, 80 * 10**9,
                 "NVIDIA H100 Tensor Core GPU datasheet (SXM), dense"),
    # NVIDIA H100 PCIe product brief / H100 datasheet PCIe column (sparse figures halved); 80 GB HBM2e
    HardwareSpec("H100-PCIe", {"float32": 51 * _T, "tf32": 378 * _T, "bfloat16": 756 * _T, "float16": 756 * _T,
                               "float8": 1513 * _T, "int8": 1513 * _T}, 2.0e12, 80 * 10**9,
                 "NVIDIA H100 PCIe datasheet, dense"),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (same compute as H100 SXM); 141 GB HBM3e
    HardwareSpec("H200", {"float32": 67 * _T, "tf32": 494.5 * _T, "bfloat16": 989 * _T, "float16": 989 * _T,
                          "float8": 1979 * _T, "int8": 1979 * _T}, 4.8e12, 141 * 10**9,
                 "NVIDIA H200 Tensor Core GPU datasheet (SXM), dense"),
    # NVIDIA A100 Tensor Core GPU datasheet, A100 40GB SXM column; 1,555 GB/s HBM2
    HardwareSpec("A100-40GB", {"float32": 19.5 * _T, "tf32": 156 * _T, "bfloat16": 312 * _T, "float16": 312 * _T,
                               "int8": 624 * _T}, 1.555e12, 40 * 10**9,
                 "NVIDIA A100 Tensor Core GPU datasheet (40GB SXM), dense"),
    # NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column; 2,039 GB/s HBM2e
    HardwareSpec("A100-80GB", {"float32": 19.5 * _T, "tf32": 156 * _T, "bfloat16": 312 * _T, "float16": 312 * _T,
                               "int8": 624 * _T}, 2.039e12, 80 * 10**9,
                 "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM), dense"),
    # NVIDIA L4 Tensor Core GPU datasheet (sparse figures halved); 24 GB GDDR6, 300 GB/s
    HardwareSpec("L4", {"float32": 30.3 * _T, "tf32": 60 * _T, "bfloat16": 121 * _T, "float16": 121 * _T,
                        "float8": 242.5 * _T, "int8": 242.5 * _T}, 0.30e12, 24 * 10**9,
                 "NVIDIA L4 Tensor Core GPU datasheet, dense"),
    # NVIDIA T4 Tensor Core GPU datasheet: Turing has no bf16; 65 TF is mixed fp16/fp32; 16 GB GDDR6, 320 GB/s
    HardwareSpec("T4", {"float32": 8.1 * _T, "float16": 65 * _T, "int8": 130 * _T}, 0.32e12, 16 * 10**9,
                 "NVIDIA T4 Tensor Core GPU datasheet"),
)})


def get_spec(name: str) -> HardwareSpec:
    """The reference spec called ``name`` (case-insensitive), e.g. ``get_spec("h100-sxm")``."""
    for key, spec in SPECS.items():
        if key.lower() == name.lower():
            return spec
    raise ValueError(f"unknown hardware {name!r}; known: {', '.join(SPECS)}")


# ---------------------------------------------------------------------------------------------- measurement
@dataclass(frozen=True)
class MeasuredSpec(HardwareSpec):
    """This machine's peaks as measured (bytes/s, FLOP/s), usable anywhere a ``HardwareSpec`` is.

    ``memory_bandwidth`` is the highest read rate any probe reached (the roof, so no measured point sits above
    it); ``read_bandwidth`` the best plain read, ``read_by_impl`` per implementation ("torch", "native");
    ``copy_bandwidth`` counts read + write bytes; ``gemv_bandwidth[impl][dtype]`` is the weight bytes a decode-like
    stack of GEMVs streams per second; ``peak_flops`` holds the measured matmul rates; ``method`` the sizes used.
    """

    device: str
    read_bandwidth: float
    read_by_impl: Mapping[str, float]
    copy_bandwidth: float
    gemv_bandwidth: Mapping[str, Mapping[str, float]]
    method: Mapping[str, Any]

    def __post_init__(self):
        super().__post_init__()
        rates = [self.read_bandwidth, self.copy_bandwidth, *self.read_by_impl.values()]
        rates += [v for per_dtype in self.gemv_bandwidth.values() for v in per_dtype.values()]
        if not all(r > 0 for r in rates):
            raise ValueError(f"measured bandwidths must be > 0, got {rates}")
        for name in ("read_by_impl", "method"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        object.__setattr__(self, "gemv_bandwidth", MappingProxyType(
            {k: MappingProxyType(dict(v)) for k, v in self.gemv_bandwidth.items()}))


# SmolLM2-135M's per-layer linears as weight shapes [N, K]: qkv, o, gate_up, down (the default model's config).
DECODE_GEMV_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
_MiB = 1 << 20


def _plan(device: str, quick: bool) -> dict[str, Any]:
    """Probe sizes: buffers well past the last-level cache (CPU L3 ~32 MiB, H100 L2 50 MB), GEMMs compute bound."""
    cuda = device.startswith("cuda")
    return {
        "read_bytes": (256 if quick else 1024) * _MiB if cuda else (64 if quick else 256) * _MiB,
        "copy_bytes": (256 if quick else 1024) * _MiB if cuda else (64 if quick else 256) * _MiB,  # source size
        "gemv_layers": 8 if quick else 30,  # 30 = all of SmolLM2-135M's layers: 425 MB fp32, 212 MB bf16
        "gemv_shapes": DECODE_GEMV_SHAPES,
        "gemv_min_bytes": (256 if cuda else 64) * _MiB,  # a shortened stack still ≥ 2× the LLC (32 MiB L3 here)
        "matmul_n": (4096 if quick else 8192) if cuda else (1024 if quick else 2048),
        "matmul_dtypes": ("float32", "tf32", "float16", "bfloat16") if cuda else ("float32", "bfloat16"),
        "warmup": 1, "repeats": 3 if quick else (10 if cuda else 5), "budget_s": 0.3 if quick else 1.0,
        "statistic": "median seconds per call (repeats stop early past budget_s per probe)",
        "quick": quick, "torch": torch.__version__,
        "threads": None if cuda else torch.get_num_threads(),
    }


def _median_seconds(fn: Callable[[], object], device: str, plan: dict,
                    warm: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn()`` over ``plan["repeats"]`` calls after ``plan["warmup"]`` calls of ``warm``
    (default ``fn``; a cheaper call with the same shapes will do); CUDA work is synchronised around every call.
    Repeats stop early once ``plan["budget_s"]`` is spent (a slow path, such as torch's bf16 GEMV on some CPUs,
    would otherwise blow the time budget); at least one call is always timed."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(plan["warmup"]):
        (warm or fn)()
    times: list[float] = []
    while len(times) < plan["repeats"] and (not times or sum(times) < plan["budget_s"]):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _graphed(fn: Callable[[], object], device: str) -> Callable[[], object]:
    """On CUDA, capture ``fn`` in a CUDA graph: 120 small launches at ~5 µs each would hide the bandwidth."""
    if not device.startswith("cuda"):
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as graph capture requires
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:  # capture unsupported here: time it eagerly (launch overhead included, figure lower)
        torch.cuda.synchronize()
        return fn
    return graph.replay


def _probe_read(device: str, plan: dict) -> dict[str, float]:
    from .kernels import cpu_gemv

    a = torch.full((plan["read_bytes"] // 4,), 1.0, device=device)  # written, so every page is really mapped
    impls: dict[str, Callable[[], object]] = {"torch": a.sum}
    if device == "cpu" and cpu_gemv.available():
        impls["native"] = lambda: cpu_gemv.read_sum(a)
    return {k: a.nbytes / _median_seconds(f, device, plan) for k, f in impls.items()}


def _probe_copy(device: str, plan: dict) -> float:
    src = torch.full((plan["copy_bytes"] // 4,), 1.0, device=device)
    dst = torch.zeros_like(src)
    # Counted as read + write (2 × size). A CPU also reads dst's lines before writing them (write-allocate),
    # so the true traffic is ~3 × size there: this figure understates the bus, as STREAM's "copy" does.
    return 2 * src.nbytes / _median_seconds(lambda: dst.copy_(src), device, plan)


def _gemv_stack(linear: Callable, weights: list[torch.Tensor], xs: dict[int, torch.Tensor]) -> None:
    """One batch-1 decode step's GEMVs: each weight [N, K] times the vector xs[K] [1, K]."""
    for w in weights:
        linear(xs[w.shape[1]], w)


def _probe_gemv(device: str, plan: dict) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """GEMV bytes/s per implementation and dtype, and the number of layers each timed pass covered."""
    from .kernels import cpu_gemv

    rates: dict[str, dict[str, float]] = {"torch": {}}
    layers_timed: dict[str, int] = {}
    per_layer = len(plan["gemv_shapes"])
    for name in ("float32", "bfloat16"):
        dt = getattr(torch, name)
        ws = [torch.full(s, 0.01, dtype=dt, device=device) for _ in range(plan["gemv_layers"])
              for s in plan["gemv_shapes"]]
        xs = {k: torch.full((1, k), 1.0, dtype=dt, device=device) for k in {s[1] for s in plan["gemv_shapes"]}}
        impls = {"torch": torch.nn.functional.linear}
        if device == "cpu" and cpu_gemv.available():
            impls["native"] = cpu_gemv.linear
        for impl, linear in impls.items():
            # Time one layer first (it also warms every shape). A path so slow that a full pass would not fit a
            # third of the time budget is not limited by memory, so fewer layers measure it just as well, as long
            # as they still overflow the last-level cache (gemv_min_bytes).
            one = _median_seconds(partial(_gemv_stack, linear, ws[:per_layer], xs), device, {**plan, "repeats": 1})
            floor = math.ceil(plan["gemv_min_bytes"] / sum(w.nbytes for w in ws[:per_layer]))
            layers = min(plan["gemv_layers"], max(floor, int(plan["budget_s"] / (3 * one))))
            stack = ws[: layers * per_layer]
            step = _graphed(partial(_gemv_stack, linear, stack, xs), device)
            secs = _median_seconds(step, device, {**plan, "warmup": 0})  # warmed above
            rates.setdefault(impl, {})[name] = sum(w.nbytes for w in stack) / secs  # weights: x, y are < 0.1 %
            layers_timed[f"{impl}.{name}"] = layers
    return rates, layers_timed


def _probe_matmul(device: str, plan: dict) -> dict[str, float]:
    n, result = plan["matmul_n"], {}
    for name in plan["matmul_dtypes"]:
        dt = torch.float32 if name == "tf32" else getattr(torch, name)
        a, b = (torch.randn(n, n, device=device).to(dt) for _ in range(2))
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high" if name == "tf32" else "highest")  # tf32 = fp32 on tensor cores
        try:
            result[name] = 2 * n**3 / _median_seconds(partial(torch.matmul, a, b), device, plan)
        finally:
            torch.set_float32_matmul_precision(before)
    return result


def _device_name_and_memory(device: str) -> tuple[str, int]:
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        return props.name, props.total_memory
    name = platform.processor() or platform.machine()
    try:
        name = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):  # not Linux, or no "model name" line (some ARM kernels)
        pass
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # Windows has no sysconf: capacity unknown
        memory = 0
    return f"{name} ({torch.get_num_threads()} threads)", memory


def measure_device(device: str | torch.device = "cpu", quick: bool = False) -> MeasuredSpec:
    """Measure this machine's read / copy / GEMV bandwidth and matmul FLOP/s on ``device`` ("cpu", "cuda", ...).

    Read: a sum over a buffer far beyond the last-level cache (CPU: best of ``torch.sum`` and the native
    ``cpu_gemv.read_sum``). Copy: ``dst.copy_(src)``, read + write bytes. GEMV: one batch-1 decode step's
    linears of SmolLM2-135M ([576→960], [576→576], [576→3072], [1536→576] × layers) through ``F.linear`` and,
    on CPU, ``cpu_gemv.linear``. Matmul: n×n @ n×n per dtype. Each probe: warm-up, then the median of repeats.
    A full CPU run takes ~10 s, ``quick=True`` ~1 s (smaller buffers and GEMMs, fewer repeats). Results are
    cached per process and (device, quick), so notebooks and benchmarks pay for a measurement once.
    """
    return _measure(str(torch.device(device)), bool(quick))


@cache  # the per-process measurement cache, keyed by the normalised (device, quick)
def _measure(device: str, quick: bool) -> MeasuredSpec:
    from tqdm.auto import tqdm

    plan = _plan(device, quick)
    probes = {"read": _probe_read, "copy": _probe_copy, "gemv": _probe_gemv, "matmul": _probe_matmul}
    found: dict[str, Any] = {}
    with torch.inference_mode(), tqdm(probes.items(), desc=f"measuring {device}", leave=False) as bar:
        for key, probe in bar:
            bar.set_postfix_str(key)
            found[key] = probe(device, plan)
    name, memory = _device_name_and_memory(device)
    read = max(found["read"].values())
    gemv, gemv_layers_timed = found["gemv"]
    roof = max([read, *(v for per_dtype in gemv.values() for v in per_dtype.values())])
    return MeasuredSpec(
        name=name, peak_flops=found["matmul"], memory_bandwidth=roof, memory_capacity=memory,
        source=f"measured by minillm.roofline.measure_device({device!r}, quick={quick})",
        device=device, read_bandwidth=read, read_by_impl=found["read"], copy_bandwidth=found["copy"],
        gemv_bandwidth=gemv, method={**plan, "gemv_shapes": [list(s) for s in plan["gemv_shapes"]],
                                     "gemv_layers_timed": gemv_layers_timed,
                                     "matmul_dtypes": list(plan["matmul_dtypes"])})


# ---------------------------------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class Cost:
    """FLOPs and bytes moved by a piece of work (a layer, a model step), and where they come from.

    ``breakdown`` splits ``bytes`` by source: "weights", "kv_cache", "activations" (those present; they sum to
    ``bytes``). ``flops_breakdown`` splits ``flops``: "linear" (matmuls with weights), "attention". Costs add
    (``a + b``) and scale by an int (``num_layers * layer``).
    """

    flops: float
    bytes: float
    breakdown: Mapping[str, float] = field(default_factory=dict)
    flops_breakdown: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self):
        if self.flops < 0 or self.bytes < 0:
            raise ValueError(f"Cost needs flops ≥ 0 and bytes ≥ 0, got {self.flops}, {self.bytes}")
        for total, parts in ((self.bytes, self.breakdown), (self.flops, self.flops_breakdown)):
            if parts and not math.isclose(sum(parts.values()), total, rel_tol=1e-9):
                raise ValueError(f"breakdown {dict(parts)} does not sum to {total}")
        object.__setattr__(self, "breakdown", MappingProxyType(dict(self.breakdown)))
        object.__setattr__(self, "flops_breakdown", MappingProxyType(dict(self.flops_breakdown)))

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return arithmetic_intensity(self)

    def __add__(self, other: Cost) -> Cost:
        def merge(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
            return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in dict.fromkeys([*a, *b])}
        return Cost(self.flops + other.flops, self.bytes + other.bytes, merge(self.breakdown, other.breakdown),
                    merge(self.flops_breakdown, other.flops_breakdown))

    def __mul__(self, k: int) -> Cost:
        return Cost(self.flops * k, self.bytes * k, {n: v * k for n, v in self.breakdown.items()},
                    {n: v * k for n, v in self.flops_breakdown.items()})

    __rmul__ = __mul__


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def linear_cost(M: int, K: int, N: int, dtype: DType, *, weight_dtype: DType | None = None,
                bias: bool = False) -> Cost:
    """x [M, K] @ W [K, N] → y [M, N]: 2·M·K·N FLOPs; reads W once (K·N), reads x, writes y.

    Intensity = 2MKN / (b·(KN + MK + MN)) → 2M/b when M ≪ K, N: ≈ M FLOP/byte at 2 bytes, so a decode GEMV
    (M = batch) sits far below the ridge. ``weight_dtype`` (default ``dtype``) prices quantized weights
    (quantization scales not counted); ``bias`` adds N weights and M·N adds.
    """
    _check_sizes(M=M, K=K, N=N)
    a, w = dtype_bytes(dtype), dtype_bytes(dtype if weight_dtype is None else weight_dtype)
    flops = 2 * M * K * N + (M * N if bias else 0)
    weights = K * N * w + (N * a if bias else 0)
    acts = (M * K + M * N) * a
    return Cost(flops, weights + acts, {"weights": weights, "activations": acts}, {"linear": flops})


def attention_cost(batch: int, q_len: int, kv_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
                   dtype: DType, *, kv_dtype: DType | None = None, causal: bool = True,
                   fused: bool = True) -> Cost:
    """One attention layer: q [B, H_q, L, D] over k, v [B, H_kv, S, D] → [B, H_q, L, D].

    FLOPs: 4·D per (query, key) pair per head (QKᵀ and PV; softmax ignored). Causal: the L queries are the last L
    of the S positions, so query i sees S − L + i + 1 keys. Bytes: q read and output written (activations), each
    K/V head read once for its whole group of H_q/H_kv query heads (the GQA saving): 2·B·H_kv·S·D·kv_bytes.
    ``fused=False`` prices naive attention, which writes the L×S scores, reads them for softmax, writes the
    probabilities and reads them for PV (4·B·H_q·L·S elements). Decode (L = 1) intensity ≈ 2·(H_q/H_kv)/kv_bytes
    whatever B: MHA fp16 gives exactly S / (S + 1) FLOP/byte; batching does not help attention.
    """
    _check_sizes(batch=batch, q_len=q_len, kv_len=kv_len, num_heads=num_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if causal and q_len > kv_len:
        raise ValueError(f"causal attention needs q_len ≤ kv_len (queries are the last positions), "
                         f"got {q_len} > {kv_len}")
    B, L, S, Hq, Hkv, D = batch, q_len, kv_len, num_heads, num_kv_heads, head_dim
    a, kvb = dtype_bytes(dtype), dtype_bytes(dtype if kv_dtype is None else kv_dtype)
    pairs = L * (S - L) + L * (L + 1) // 2 if causal else L * S
    flops = 4 * B * Hq * D * pairs
    kv = 2 * B * Hkv * S * D * kvb
    acts = 2 * B * Hq * L * D * a + (0 if fused else 4 * B * Hq * L * S * a)
    return Cost(flops, kv + acts, {"kv_cache": kv, "activations": acts}, {"attention": flops})


def _kv_token_bytes(config: ModelConfig, kv_dtype: DType) -> float:
    """Bytes of K+V per token over all layers, from ``kv_bytes_per_token`` (the one place that formula lives)."""
    if not isinstance(kv_dtype, (int, float)) and dtype_name(kv_dtype) in ("float64", "float32", "float16",
                                                                            "bfloat16"):
        return kv_bytes_per_token(config, getattr(torch, dtype_name(kv_dtype)))
    # 8/4-bit formats (no torch.finfo for int8/int4): count elements at one byte each, then scale by the width.
    return kv_bytes_per_token(config, torch.float8_e4m3fn) * dtype_bytes(kv_dtype)


def _forward_cost(config: ModelConfig, batch: int, new: int, past: int, dtype: DType, kv_dtype: DType | None,
                  weight_dtype: DType | None, logit_rows: int) -> Cost:
    """``new`` tokens per sequence on top of ``past`` cached ones, through the whole model."""
    c, M = config, batch * new
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    lin = {"dtype": dtype, "weight_dtype": weight_dtype}
    norms = Cost(0, 2 * c.hidden_size * dtype_bytes(dtype), {"weights": 2 * c.hidden_size * dtype_bytes(dtype)})
    layer = (linear_cost(M, c.hidden_size, c.q_size + 2 * c.kv_size, bias=c.qkv_bias, **lin)  # fused q/k/v
             + attention_cost(batch, new, past + new, c.num_heads, c.num_kv_heads, c.head_dim, dtype,
                              kv_dtype=kv_dtype)
             + linear_cost(M, c.q_size, c.hidden_size, **lin)  # o_proj
             + linear_cost(M, c.hidden_size, 2 * c.intermediate_size, **lin)  # fused gate/up
             + linear_cost(M, c.intermediate_size, c.hidden_size, **lin)  # down_proj
             + norms)  # input and post-attention RMSNorm weights
    kv_write = M * _kv_token_bytes(c, kv_dtype)  # the new tokens' K/V, all layers
    lookup = M * c.hidden_size * dtype_bytes(dtype)  # embedding gather: only the M rows fed, not the matrix
    final_norm = c.hidden_size * dtype_bytes(dtype)
    # LM head reads the whole V×hidden matrix once per step (the embedding matrix itself when tied).
    head = linear_cost(logit_rows, c.hidden_size, c.vocab_size, **lin)
    extra = Cost(0, kv_write + lookup + final_norm,
                 {"kv_cache": kv_write, "activations": lookup, "weights": final_norm})
    return c.num_layers * layer + extra + head


def prefill_cost(config: ModelConfig, batch: int, prompt_len: int, dtype: DType, kv_dtype: DType | None = None,
                 *, past_len: int = 0, weight_dtype: DType | None = None, all_logits: bool = False) -> Cost:
    """Cost of one prefill forward: ``batch`` prompts of ``prompt_len`` tokens (after ``past_len`` cached ones,
    e.g. a prefix-cache hit or an earlier chunk), causal attention, K/V written to the cache.

    Weights are read once for all B·L tokens (intensity ~ B·L: compute bound for long prompts). Logits are
    computed for the last token only, as serving engines do; ``all_logits=True`` prices all B·L rows (what
    ``Transformer.forward`` returns). Activations count each matmul's input/output and attention's q/out once,
    as an ideally fused engine moves them; unfused norms, RoPE, SwiGLU and residual adds add a few more passes.
    """
    _check_sizes(batch=batch, prompt_len=prompt_len)
    if not isinstance(past_len, int) or past_len < 0:
        raise ValueError(f"past_len must be an int ≥ 0, got {past_len!r}")
    rows = batch * prompt_len if all_logits else batch
    return _forward_cost(config, batch, prompt_len, past_len, dtype, kv_dtype, weight_dtype, rows)


def decode_step_cost(config: ModelConfig, batch: int, kv_len: int, dtype: DType, kv_dtype: DType | None = None,
                     *, weight_dtype: DType | None = None) -> Cost:
    """Cost of one decode step: one new token for each of ``batch`` sequences attending over ``kv_len`` positions
    (the new one included).

    Bytes: every weight once (tied embeddings once, for the LM head), K/V of ``kv_len`` tokens read and of the
    new token written per sequence ((kv_len + 1) × ``kv_bytes_per_token`` × B), and small activations.
    """
    _check_sizes(batch=batch, kv_len=kv_len)
    return _forward_cost(config, batch, 1, kv_len - 1, dtype, kv_dtype, weight_dtype, batch)


# ---------------------------------------------------------------------------------------------- helpers
def arithmetic_intensity(cost: Cost) -> float:
    """FLOPs per byte moved."""
    if cost.bytes <= 0:
        raise ValueError("arithmetic intensity is undefined for a cost that moves no bytes")
    return cost.flops / cost.bytes


def ridge_point(spec: HardwareSpec, dtype: str | torch.dtype) -> float:
    """Intensity (FLOP/byte) where the roofs meet: peak / bandwidth. H100 SXM bf16: 989e12 / 3.35e12 ≈ 295."""
    return spec.peak(dtype) / spec.memory_bandwidth


def attainable_flops(spec: HardwareSpec, intensity: float, dtype: str | torch.dtype) -> float:
    """min(peak FLOP/s, intensity × bandwidth): the most a kernel of this intensity can reach on ``spec``."""
    if intensity < 0:
        raise ValueError(f"intensity must be ≥ 0, got {intensity}")
    return min(spec.peak(dtype), intensity * spec.memory_bandwidth)


def _rate(x: float | HardwareSpec) -> float:
    value = x.memory_bandwidth if isinstance(x, HardwareSpec) else x
    if not value > 0:
        raise ValueError(f"bandwidth / peak must be > 0, got {value!r}")
    return value


def mbu(bytes_per_step: float, steps_per_s: float, bandwidth: float | HardwareSpec) -> float:
    """Model bandwidth utilisation: bytes read per step × steps/s ÷ peak bandwidth (0..1).

    7e9 params × 2 bytes × 100 tok/s = 1.4 TB/s on a 2 TB/s A100 → 0.70.
    """
    if bytes_per_step < 0 or steps_per_s < 0:
        raise ValueError("bytes_per_step and steps_per_s must be ≥ 0")
    return bytes_per_step * steps_per_s / _rate(bandwidth)


def mfu(flops_per_step: float, steps_per_s: float, peak: float) -> float:
    """Model FLOP/s utilisation: FLOPs per step × steps/s ÷ peak FLOP/s (0..1)."""
    if flops_per_step < 0 or steps_per_s < 0:
        raise ValueError("flops_per_step and steps_per_s must be ≥ 0")
    return flops_per_step * steps_per_s / _rate(peak)


def decode_tokens_per_s_bound(config: ModelConfig, dtype: DType, bandwidth: float | HardwareSpec, batch: int = 1,
                              kv_len: int = 1, kv_dtype: DType | None = None) -> float:
    """Upper bound on decode throughput (tokens/s over the batch) when memory bound: B × bandwidth / bytes per step.

    SmolLM2-135M bf16 (~270 MB/step) on 3.35 TB/s: ~12 000 steps/s; on a ~30 GB/s laptop: ~110.
    """
    return batch * _rate(bandwidth) / decode_step_cost(config, batch, kv_len, dtype, kv_dtype).bytes


@dataclass(frozen=True)
class RooflinePoint:
    """A measured kernel or step on the roofline: intensity (FLOP/byte) and achieved FLOP/s."""

    label: str
    intensity: float
    flops_per_s: float

    def __post_init__(self):
        if not self.intensity > 0 or not self.flops_per_s > 0:
            raise ValueError(f"{self.label}: intensity and flops_per_s must be > 0 for a log-log plot")

    @classmethod
    def from_cost(cls, label: str, cost: Cost, seconds: float) -> RooflinePoint:
        """The point of work ``cost`` that took ``seconds``."""
        if not seconds > 0:
            raise ValueError(f"seconds must be > 0, got {seconds}")
        return cls(label, cost.intensity, cost.flops / seconds)


def plot_roofline(spec: HardwareSpec, points: Sequence[RooflinePoint] = (), dtype: str = "bfloat16", ax=None):
    """Log-log roofline of ``spec`` for ``dtype`` (bandwidth roof, compute roof, ridge) with labelled ``points``.

    Draws on ``ax`` (a new figure when None) and returns the Axes; never calls ``plt.show()``.
    """
    import matplotlib.pyplot as plt

    peak, bw = spec.peak(dtype), spec.memory_bandwidth
    ridge = peak / bw
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    lo = min([ridge / 1e3, *(p.intensity for p in points)]) / 2
    hi = max([ridge * 30, *(p.intensity for p in points)]) * 2
    # y = I·bw is a straight line on log-log axes, so three vertices draw both roofs exactly.
    ax.plot([lo, ridge, hi], [lo * bw, peak, peak], color="black",
            label=f"{spec.name}: {bw / 1e9:.4g} GB/s, {peak / 1e12:.4g} TFLOP/s {dtype_name(dtype)}")
    ax.axvline(ridge, color="grey", linestyle=":")
    ax.annotate(f"ridge {ridge:.3g} FLOP/B", (ridge, peak), textcoords="offset points", xytext=(4, -14),
                color="grey")
    if points:
        ax.scatter([p.intensity for p in points], [p.flops_per_s for p in points], zorder=3, color="tab:red")
        for p in points:
            ax.annotate(p.label, (p.intensity, p.flops_per_s), textcoords="offset points", xytext=(5, 4))
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="FLOP/s",
           title=f"Roofline: {spec.name} ({dtype_name(dtype)})")
    ax.legend(loc="lower right")
    return ax


# ---------------------------------------------------------------------------------------------- command line
def format_measurement(m: MeasuredSpec) -> str:
    """This machine's measured peaks as a text table (GB/s per probe and implementation, GFLOP/s per dtype)."""
    p = m.method
    impls = ["torch", "native"]
    rows = [(f"read (sum over {p['read_bytes'] // _MiB} MiB)", *(m.read_by_impl.get(i) for i in impls)),
            (f"copy (read+write, {p['copy_bytes'] // _MiB} MiB)", m.copy_bandwidth, None)]
    for dt in ("float32", "bfloat16"):
        rows.append((f"GEMV {dt} (SmolLM2 layers)",
                     *(m.gemv_bandwidth.get(i, {}).get(dt) for i in impls)))
    cell = lambda v: f"{v / 1e9:10.1f}" if v is not None else f"{'-':>10}"  # noqa: E731
    lines = [f"{m.name} [{m.device}, torch {p['torch']}{', quick' if p['quick'] else ''}]",
             f"{'bandwidth, GB/s':38}{'torch':>10}{'native':>10}"]
    lines += [f"  {label:36}{cell(t)}{cell(n)}" for label, t, n in rows]
    lines.append(f"{'matmul ' + str(p['matmul_n']) + '³, GFLOP/s':38}{'':>10}{'ridge':>10}")
    lines += [f"  {dt:36}{v / 1e9:10.1f}{ridge_point(m, dt):10.2f}" for dt, v in m.peak_flops.items()]
    timed = p.get("gemv_layers_timed", {})
    lines.append(f"GEMV layers timed of {p['gemv_layers']}: " + ", ".join(f"{k} {v}" for k, v in timed.items()))
    lines.append(f"roof: {m.memory_bandwidth / 1e9:.1f} GB/s (best of the read and GEMV probes); ridge in FLOP/byte")
    return "\n".join(lines)


def format_specs() -> str:
    """The reference datasheet specs as a text table, with each one's bf16 (or fp16) ridge point."""
    lines = [f"{'reference (dense)':18}{'fp32 TF':>9}{'bf16/fp16 TF':>14}{'TB/s':>7}{'ridge':>7}{'GB':>6}"]
    for s in SPECS.values():
        half = "bfloat16" if "bfloat16" in s.peak_flops else "float16"
        short = {"bfloat16": "bf16", "float16": "fp16"}[half]
        lines.append(f"{s.name:18}{s.peak('float32') / 1e12:9.1f}{s.peak(half) / 1e12:9.0f} {short}"
                     f"{s.memory_bandwidth / 1e12:7.3g}{ridge_point(s, half):7.0f}{s.memory_capacity / 1e9:6.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m minillm roofline [--device D] [--quick] [--json PATH]``: measure, print, optionally save."""
    parser = argparse.ArgumentParser(prog="python -m minillm roofline",
                                     description="Measure this machine's bandwidth and FLOP/s; show reference specs.")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--quick", action="store_true", help="small probes (~1 s), less accurate")
    parser.add_argument("--json", type=Path, metavar="PATH", help="save measured and reference specs as JSON")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    measured = measure_device(device, quick=args.quick)
    print(format_measurement(measured), format_specs(), sep="\n\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"measured": measured.to_dict(), "reference": {k: s.to_dict() for k, s in SPECS.items()}}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nsaved {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
