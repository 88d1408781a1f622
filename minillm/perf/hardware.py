"""Machines: datasheet specs of reference GPUs and the measured peaks of *this* machine.

- Reference machines: ``HardwareSpec``, ``SPECS``, ``get_spec`` (dense datasheet figures, sources in comments).
- This machine: ``measure_device()`` → ``MeasuredSpec`` (read / copy / GEMV bandwidth, matmul FLOP/s per dtype),
  cached per process; ``read_bandwidth()`` its read probe (the fastest of repeated passes of a reduction over a
  large buffer); ``matmul_flops()`` one quick matmul rate (from ``minillm.kernels.probe``, re-exported).
  Notebooks and benchmarks use ``minillm.perf.machine.machine_spec()``: best of several runs, cached on disk per
  machine, so that every one of them prices its measurements against the same roof.
- Dtype sizes: ``DTYPE_BYTES``, ``dtype_name``, ``dtype_bytes`` (from ``minillm.dtypes``, re-exported).

``minillm.perf.roofline`` re-exports all of these next to the cost model and plots.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from functools import cache, partial
from types import MappingProxyType
from typing import Any

import torch

from minillm.dtypes import DTYPE_BYTES, DType, dtype_bytes, dtype_name  # noqa: F401  (re-exported)
from minillm.kernels.probe import matmul_flops  # noqa: F401  (re-exported; _probe_matmul reads it from here)
from minillm.models.configs import decoder_linear_shapes, smollm2_135m_config

PEAK_DTYPES = ("float32", "tf32", "float16", "bfloat16", "float8", "int8")  # keys a HardwareSpec may list


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
        """Inverse of ``to_dict`` (e.g. a measurement saved on another machine); fields with defaults may be absent."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


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
    measured_at: str = ""  # ISO 8601, UTC: a roofline says when it was measured (machine.machine_spec caches it)

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
DECODE_GEMV_SHAPES = decoder_linear_shapes(smollm2_135m_config())
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


def read_bandwidth(buffer: torch.Tensor, *, repeats: int = 5,
                   reduce: Callable[[torch.Tensor], object] = torch.sum) -> float:
    """Streaming read bandwidth of ``buffer``'s device, in bytes per second: how fast ``reduce`` reads it all.

    ``buffer``: any tensor, ideally a few times larger than the last-level cache (else the figure is the
    cache's speed, not memory's); its pages should be written beforehand so that the first pass does not pay for
    mapping them. ``reduce(buffer)`` must read every byte once (default ``torch.sum``; on CPU
    ``native.read_sum`` is an alternative). The contract: one untimed warm-up call, then ``repeats`` timed calls,
    each a whole pass over the buffer (on CUDA, wait for the GPU before reading the clock: launches are
    asynchronous); the rate of the **fastest** pass is returned, since interference from other work only ever
    slows a pass down. ``ValueError`` for ``repeats`` < 1 or an empty buffer.
    """
    ### BEGIN SOLUTION
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if buffer.numel() == 0:
        raise ValueError("read_bandwidth needs a non-empty buffer (0 bytes read: no rate)")
    sync = torch.cuda.synchronize if buffer.is_cuda else (lambda: None)
    reduce(buffer)  # warm-up: first-call costs (allocations, kernel selection, page faults) are not bandwidth
    best = math.inf
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        reduce(buffer)
        sync()  # a CUDA launch returns at once; the read has finished only after the sync
        best = min(best, time.perf_counter() - t0)
    return buffer.nbytes / max(best, 1e-12)  # bytes of one pass ÷ its fastest time
    ### END SOLUTION


def _probe_read(device: str, plan: dict) -> dict[str, float]:
    from minillm.kernels.cpu import native

    a = torch.full((plan["read_bytes"] // 4,), 1.0, device=device)  # written, so every page is really mapped
    impls: dict[str, Callable[[torch.Tensor], object]] = {"torch": torch.sum}
    if device == "cpu" and native.available():
        impls["native"] = native.read_sum
    return {k: read_bandwidth(a, repeats=plan["repeats"], reduce=f) for k, f in impls.items()}


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
    from minillm.kernels.cpu import native

    rates: dict[str, dict[str, float]] = {"torch": {}}
    layers_timed: dict[str, int] = {}
    per_layer = len(plan["gemv_shapes"])
    for name in ("float32", "bfloat16"):
        dt = getattr(torch, name)
        ws = [torch.full(s, 0.01, dtype=dt, device=device) for _ in range(plan["gemv_layers"])
              for s in plan["gemv_shapes"]]
        xs = {k: torch.full((1, k), 1.0, dtype=dt, device=device) for k in {s[1] for s in plan["gemv_shapes"]}}
        impls = {"torch": torch.nn.functional.linear}
        if device == "cpu" and native.available():
            impls["native"] = native.linear
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


def _probe_matmul(device: str, plan: dict) -> tuple[dict[str, float], dict[str, int]]:
    """Matmul FLOP/s per dtype, and the n each was timed at.  A dtype so slow at n=256 that one call of the
    planned n would outlast the whole time budget is emulated, not compute bound (bf16 on an AVX2 CPU: orders
    of magnitude below fp32, so one n=2048 call takes seconds): an n that fits a third of the budget (≥ 256)
    measures the same rate.  (n=256 underrates fast paths, which is why only a call past the whole budget shrinks.)"""
    result: dict[str, float] = {}
    sizes: dict[str, int] = {}
    for name in plan["matmul_dtypes"]:
        n = plan["matmul_n"]
        small = matmul_flops(name, 256, device, repeats=1)
        if 2 * n**3 / small > plan["budget_s"]:
            n = max(256, int((small * plan["budget_s"] / 3 / 2) ** (1 / 3)) // 256 * 256)  # 2 n³ in budget / 3
        sizes[name] = n
        dt = torch.float32 if name == "tf32" else getattr(torch, name)
        a, b = (torch.randn(n, n, device=device).to(dt) for _ in range(2))
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high" if name == "tf32" else "highest")  # tf32 = fp32 on tensor cores
        try:
            result[name] = 2 * n**3 / _median_seconds(partial(torch.matmul, a, b), device, plan)
        finally:
            torch.set_float32_matmul_precision(before)
    return result, sizes


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

    Read: ``read_bandwidth``, a sum over a buffer far beyond the last-level cache (CPU: best of ``torch.sum`` and
    the native ``native.read_sum``). Copy: ``dst.copy_(src)``, read + write bytes. GEMV: one batch-1 decode
    step's linears of SmolLM2-135M ([576→960], [576→576], [576→3072], [1536→576] × layers) through ``F.linear``
    and, on CPU, ``native.linear``. Matmul: n×n @ n×n per dtype. Each probe: warm-up, then the median of repeats
    (read: the fastest repeat).
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
    peaks, matmul_n_timed = found["matmul"]
    roof = max([read, *(v for per_dtype in gemv.values() for v in per_dtype.values())])
    return MeasuredSpec(
        name=name, peak_flops=peaks, memory_bandwidth=roof, memory_capacity=memory,
        source=f"measured by minillm.perf.hardware.measure_device({device!r}, quick={quick})",
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        device=device, read_bandwidth=read, read_by_impl=found["read"], copy_bandwidth=found["copy"],
        gemv_bandwidth=gemv, method={**plan, "gemv_shapes": [list(s) for s in plan["gemv_shapes"]],
                                     "gemv_layers_timed": gemv_layers_timed, "matmul_n_timed": matmul_n_timed,
                                     "matmul_dtypes": list(plan["matmul_dtypes"])})
