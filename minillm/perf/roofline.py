"""The roofline: what a machine can do, what a workload asks of it, and where a measurement lands.

Arithmetic intensity I = FLOPs / bytes moved; attainable FLOP/s = min(peak FLOP/s, I × bandwidth). Below the
ridge (peak / bandwidth) a kernel is memory bound, above it compute bound. A decode step reads every weight once
at I ≈ batch size, far below any GPU's ridge (~295 FLOP/byte on an H100 SXM), so its speed is bandwidth / bytes.

- Machines (from ``minillm.perf.hardware``, re-exported): ``HardwareSpec``, ``SPECS``, ``get_spec``, and this machine's
  ``measure_device()`` → ``MeasuredSpec`` (read / copy / GEMV bandwidth, matmul FLOP/s per dtype);
  ``machine_spec()`` (``minillm.perf.machine``): the same, best of several runs, cached per machine on disk —
  the one roof every notebook and benchmark uses.
- The cost model, plain arithmetic: ``linear_cost``, ``attention_cost``, ``prefill_cost``, ``decode_step_cost``.
- Helpers: ``ridge_point``, ``attainable_flops``, ``mbu``, ``mfu``, ``decode_tokens_per_s_bound``, ``plot_roofline``.
"""


from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import torch

from minillm.config import ModelConfig
from minillm.kv.quant import kv_bytes_per_token
from minillm.perf.hardware import (  # noqa: F401  (re-exported: the roofline is specs + measurements + the cost model)
    DTYPE_BYTES,
    PEAK_DTYPES,
    SPECS,
    DType,
    HardwareSpec,
    MeasuredSpec,
    _MiB,
    dtype_bytes,
    dtype_name,
    get_spec,
    measure_device,
)
from minillm.perf.machine import cache_path, describe, machine_spec  # noqa: F401  (re-exported: the cached roof)


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


def check_sizes(**sizes: int) -> None:
    """Raise ``ValueError`` naming the first size that is not a positive int (the cost functions' input check)."""
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
    check_sizes(M=M, K=K, N=N)
    ### BEGIN SOLUTION
    a, w = dtype_bytes(dtype), dtype_bytes(dtype if weight_dtype is None else weight_dtype)
    flops = 2 * M * K * N + (M * N if bias else 0)
    weights = K * N * w + (N * a if bias else 0)
    acts = (M * K + M * N) * a
    return Cost(flops, weights + acts, {"weights": weights, "activations": acts}, {"linear": flops})
    ### END SOLUTION


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
    check_sizes(batch=batch, q_len=q_len, kv_len=kv_len, num_heads=num_heads, num_kv_heads=num_kv_heads,
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
    kv_write = M * kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, "auto", kv_dtype)  # new K/V
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
    check_sizes(batch=batch, prompt_len=prompt_len)
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
    check_sizes(batch=batch, kv_len=kv_len)
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


def attainable_flops(spec: HardwareSpec, intensity: float | Sequence[float] | torch.Tensor,
                     dtype: str | torch.dtype) -> float | list[float]:
    """The roofline of ``spec`` in ``dtype``: the most FLOP/s that work of arithmetic intensity ``intensity``
    (FLOP per byte moved) can reach on that machine.

    ``intensity``: one number (→ a float), or a sequence of them — a list, a tuple, a 1-D numpy array or tensor —
    (→ a list of floats, one per intensity, in order: what a plot draws). Intensity 0 (pure data movement)
    reaches 0 FLOP/s. ``spec.peak(dtype)`` is the machine's FLOP/s ceiling for ``dtype`` (a ``ValueError`` when
    the spec lists none), ``spec.memory_bandwidth`` its bytes/s. ``ValueError`` naming any intensity that is
    negative or not a number.
    """
    ### BEGIN SOLUTION
    try:  # a sequence (0-d tensors and arrays refuse iteration: they are one number)
        values, many = [float(i) for i in intensity], True
    except TypeError:
        values, many = [float(intensity)], False
    bad = [i for i in values if not i >= 0]  # catches NaN too: every comparison with NaN is False
    if bad:
        raise ValueError(f"intensity must be >= 0 FLOP/byte, got {bad[0]}")
    peak, bandwidth = spec.peak(dtype), spec.memory_bandwidth
    roof = [min(peak, i * bandwidth) for i in values]  # memory feeds i FLOPs per byte, until the arithmetic caps it
    return roof if many else roof[0]
    ### END SOLUTION


def positive_rate(x: float | HardwareSpec) -> float:
    """A rate per second: a ``HardwareSpec``'s memory bandwidth, or the number given; ``ValueError`` unless > 0."""
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
    peak_bandwidth = positive_rate(bandwidth)  # bytes/s: the number given, or the spec's memory_bandwidth
    ### BEGIN SOLUTION
    return bytes_per_step * steps_per_s / peak_bandwidth
    ### END SOLUTION


def mfu(flops_per_step: float, steps_per_s: float, peak: float) -> float:
    """Model FLOP/s utilisation: FLOPs per step × steps/s ÷ peak FLOP/s (0..1)."""
    if flops_per_step < 0 or steps_per_s < 0:
        raise ValueError("flops_per_step and steps_per_s must be ≥ 0")
    return flops_per_step * steps_per_s / positive_rate(peak)


def decode_tokens_per_s_bound(config: ModelConfig, dtype: DType, bandwidth: float | HardwareSpec, batch: int = 1,
                              kv_len: int = 1, kv_dtype: DType | None = None) -> float:
    """Upper bound on decode throughput (tokens/s over the batch) when memory bound: B × bandwidth / bytes per step.

    SmolLM2-135M bf16 (~270 MB/step) on 3.35 TB/s: ~12 000 steps/s; on a ~30 GB/s laptop: ~110.
    """
    return batch * positive_rate(bandwidth) / decode_step_cost(config, batch, kv_len, dtype, kv_dtype).bytes


PHASE_COLORS: Mapping[str, str] = MappingProxyType(
    {"prefill": "tab:blue", "decode": "tab:orange", "other": "tab:green"})  # one colour per phase, every plot


@dataclass(frozen=True)
class RooflinePoint:
    """A measured kernel or step on the roofline: intensity (FLOP/byte) and achieved FLOP/s.

    ``phase`` ("prefill", "decode" or "other") sets its colour; empty, it is read from the label ("prefill …",
    "decode …"), else "other"."""

    label: str
    intensity: float
    flops_per_s: float
    phase: str = ""

    def __post_init__(self):
        if not self.intensity > 0 or not self.flops_per_s > 0:
            raise ValueError(f"{self.label}: intensity and flops_per_s must be > 0 for a log-log plot")
        if not self.phase:
            words = self.label.lower()
            object.__setattr__(self, "phase", next((p for p in ("prefill", "decode") if p in words), "other"))
        if self.phase not in PHASE_COLORS:
            raise ValueError(f"{self.label}: phase must be one of {', '.join(PHASE_COLORS)}, got {self.phase!r}")

    @classmethod
    def from_cost(cls, label: str, cost: Cost, seconds: float, phase: str = "") -> RooflinePoint:
        """The point of work ``cost`` that took ``seconds``."""
        if not seconds > 0:
            raise ValueError(f"seconds must be > 0, got {seconds}")
        return cls(label, cost.intensity, cost.flops / seconds, phase)


def plot_roofline(spec: HardwareSpec, points: Sequence[RooflinePoint] = (), dtype: str = "bfloat16", ax=None):
    """Log-log roofline of ``spec`` for ``dtype`` (bandwidth roof, compute roof, ridge) with labelled ``points``,
    coloured by phase (``PHASE_COLORS``: prefill blue, decode orange), one legend entry per phase present.

    Point labels are spread apart (``minillm.perf.figures.spread_labels``) so that none covers another. Draws on
    ``ax`` (a new figure when None) and returns the Axes; never calls ``plt.show()``.
    """
    import matplotlib.pyplot as plt

    from minillm.perf.figures import spread_labels

    peak, bw = spec.peak(dtype), spec.memory_bandwidth
    ridge = peak / bw
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    lo = min([ridge / 1e3, *(p.intensity for p in points)]) / 2
    hi = max([ridge * 30, *(p.intensity for p in points)]) * 2
    # y = I·bw is a straight line on log-log axes, so three vertices draw both roofs exactly.
    xs = [lo, ridge, hi]
    ax.plot(xs, attainable_flops(spec, xs, dtype), color="black",
            label=f"{spec.name}: {bw / 1e9:.4g} GB/s, {peak / 1e12:.4g} TFLOP/s {dtype_name(dtype)}")
    ax.axvline(ridge, color="grey", linestyle=":")
    ax.annotate(f"ridge {ridge:.3g} FLOP/B", (ridge, peak), textcoords="offset points", xytext=(4, -14),
                color="grey")
    for phase, color in PHASE_COLORS.items():
        mine = [p for p in points if p.phase == phase]
        if mine:
            ax.scatter([p.intensity for p in mine], [p.flops_per_s for p in mine], zorder=3, color=color,
                       label=phase)
    labels = [ax.annotate(p.label, (p.intensity, p.flops_per_s), textcoords="offset points", xytext=(5, 4),
                          color=PHASE_COLORS[p.phase]) for p in points if p.label.strip()]
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="FLOP/s",
           title=f"Roofline: {spec.name} ({dtype_name(dtype)})")
    ax.legend(loc="lower right", fontsize="small")
    spread_labels(ax, labels)
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
    """``python -m minillm roofline [--device D] [--quick] [--remeasure] [--runs N] [--json PATH]``: this
    machine's cached roofline (measured now if there is none, or with ``--remeasure``), printed, optionally saved."""
    parser = argparse.ArgumentParser(prog="python -m minillm roofline",
                                     description="This machine's measured bandwidth and FLOP/s (cached per machine "
                                                 "in $MINILLM_CACHE_DIR or ~/.cache/minillm); reference specs.")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--quick", action="store_true", help="small probes (~1 s per run), less accurate")
    parser.add_argument("--remeasure", action="store_true", help="measure again and replace the cached roofline")
    parser.add_argument("--runs", type=int, default=3, help="measurements combined, each probe's best (default 3)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="save measured and reference specs as JSON")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    measured = machine_spec(device, quick=args.quick, force=args.remeasure, runs=args.runs)
    print(describe(measured, cache_path(device)))
    print(format_measurement(measured), format_specs(), sep="\n\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"measured": measured.to_dict(), "reference": {k: s.to_dict() for k, s in SPECS.items()}}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nsaved {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
