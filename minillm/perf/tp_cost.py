"""When tensor parallelism pays: a layer's communication against its compute, on paper.

Per decoder layer, Megatron TP does two all-reduces (after ``o_proj`` and after ``down_proj``) of the
[tokens, hidden] activations.  A ring all-reduce sends and receives 2 (tp − 1)/tp × n bytes per rank (reduce-scatter,
then all-gather), so a layer moves

    per-layer all-reduce bytes = 2 all-reduces × 2 (tp − 1)/tp × tokens × hidden × bytes per element

over a link of bandwidth β per direction with a fixed latency α per collective: t_comm = 2 (α + bytes_1 / β).
Meanwhile each rank reads 1/tp of the layer's weights (and its heads' K/V) — a decode layer is memory bound, so
t_compute ≈ max(layer bytes / tp / HBM bandwidth, layer FLOPs / tp / peak).  TP pays when the compute it divides is
large against t_comm: big hidden sizes on fast links (Llama-2-70B on an NVLink node), not a 135M model whose layer
takes microseconds (where α alone exceeds the saving).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from minillm.config import ModelConfig
from minillm.dtypes import DType, dtype_bytes
from minillm.layers.parallel import rank_config
from minillm.models.configs import llama2_7b_config, llama2_70b_config
from minillm.perf.hardware import SPECS, HardwareSpec
from minillm.perf.roofline import Cost, attention_cost, check_sizes, linear_cost

ALLREDUCES_PER_LAYER = 2  # after o_proj and after down_proj (Megatron-LM, Shoeybi et al. 2019, §3)


@dataclass(frozen=True)
class Link:
    """An interconnect: ``bandwidth`` bytes/s per direction per GPU, ``latency_s`` fixed cost per collective."""

    name: str
    bandwidth: float
    latency_s: float
    source: str

    def __post_init__(self):
        if not self.bandwidth > 0 or self.latency_s < 0:
            raise ValueError(f"{self.name}: bandwidth must be > 0 and latency_s >= 0")


def fit_link(name: str, nbytes: list[float], seconds: list[float], source: str = "fitted") -> tuple[Link, str]:
    """Fit t = α + bytes / β to timed collectives (``nbytes[i]`` sent per rank took ``seconds[i]``), robustly:
    the slope is the median of the pairwise slopes (Theil–Sen) and α the median of t − bytes · slope, so one
    stalled run on a busy host moves neither.  Returns the ``Link`` and a note, empty unless the data could not
    give a physical fit: a slope ≤ 0 (noise larger than the bytes' cost) falls back to the largest message's
    bytes ÷ its time as β (a lower bound), and a negative α is clamped to 0 — the note says which.  O(n²) pairs.
    Raises ``ValueError`` for fewer than two points, unequal lengths or a non-positive size or time."""
    if len(nbytes) != len(seconds) or len(nbytes) < 2:
        raise ValueError(f"fit_link needs ≥ 2 (bytes, seconds) pairs of equal length, got {len(nbytes)} and "
                         f"{len(seconds)}")
    if min(nbytes) <= 0 or min(seconds) <= 0:
        raise ValueError("fit_link: every size and time must be > 0 (a zero time means the clock did not advance)")
    pairs = sorted(zip(nbytes, seconds, strict=True))
    slopes = [(t2 - t1) / (b2 - b1) for i, (b1, t1) in enumerate(pairs) for b2, t2 in pairs[i + 1:] if b2 > b1]
    if not slopes:
        raise ValueError("fit_link: the sizes must differ to separate latency from bandwidth")
    slope = statistics.median(slopes)
    notes = []
    if slope <= 0:
        big_bytes, big_s = pairs[-1]
        slope = big_s / big_bytes
        notes.append("the times did not grow with the size (noise above the bytes' cost): β is the largest "
                     "message's bytes ÷ its time, a lower bound")
    alpha = statistics.median(t - b * slope for b, t in pairs)
    if alpha < 0:
        alpha = 0.0
        notes.append("the fitted latency came out negative and is clamped to 0")
    return Link(name, 1 / slope, alpha, source), "; ".join(notes)


LINKS = {
    # NVLink 4 on H100 SXM: 900 GB/s total per GPU (H100 datasheet) = 450 GB/s each way. The latency is an
    # assumption of the order NCCL's small-message all-reduce shows inside one NVLink node (~10 µs).
    "H100-NVLink": Link("H100-NVLink", 450e9, 10e-6, "H100 datasheet: NVLink 900 GB/s bidirectional; α assumed"),
    # PCIe Gen5 x16: ~64 GB/s each way (PCI-SIG 32 GT/s × 16 lanes); α assumed a little above NVLink's.
    "H100-PCIe": Link("H100-PCIe", 64e9, 20e-6, "PCIe 5.0 x16 ≈ 64 GB/s per direction; α assumed"),
}


def allreduce_bytes(tp: int, tokens: int, hidden: int, dtype: DType) -> float:
    """Bytes one rank sends (and receives) in one ring all-reduce of [tokens, hidden]: 2 (tp − 1)/tp × n."""
    check_sizes(tp=tp, tokens=tokens, hidden=hidden)
    return 2 * (tp - 1) / tp * tokens * hidden * dtype_bytes(dtype)


def layer_allreduce_bytes(tp: int, tokens: int, hidden: int, dtype: DType) -> float:
    """Per decoder layer: ``ALLREDUCES_PER_LAYER`` all-reduces of [tokens, hidden]."""
    return ALLREDUCES_PER_LAYER * allreduce_bytes(tp, tokens, hidden, dtype)


def layer_comm_time(tp: int, tokens: int, hidden: int, dtype: DType, link: Link) -> float:
    """Seconds one decoder layer spends in all-reduces at tensor-parallel size ``tp``: ``tokens`` rows of
    ``hidden`` values in ``dtype`` (``dtype_bytes``), a ring all-reduce after each row-parallel layer, each costing
    ``link.latency_s`` plus the bytes one rank sends over ``link.bandwidth``.  Zero at tp = 1 (nothing to reduce)."""
    ### BEGIN SOLUTION
    if tp == 1:
        return 0.0
    payload = tokens * hidden * dtype_bytes(dtype)  # the [tokens, hidden] activations being summed
    per_rank = 2 * (tp - 1) / tp * payload  # ring: reduce-scatter then all-gather, (tp − 1)/tp of n each
    return ALLREDUCES_PER_LAYER * (link.latency_s + per_rank / link.bandwidth)  # after o_proj and after down_proj
    ### END SOLUTION


def layer_decode_cost(config: ModelConfig, tp: int, batch: int, kv_len: int, dtype: DType) -> Cost:
    """One rank's share of one decoder layer at decode (``batch`` tokens over ``kv_len`` positions each)."""
    c = rank_config(config, tp)
    return (linear_cost(batch, c.hidden_size, c.q_size + 2 * c.kv_size, dtype)
            + attention_cost(batch, 1, kv_len, c.num_heads, c.num_kv_heads, c.head_dim, dtype)
            + linear_cost(batch, c.q_size, c.hidden_size, dtype)
            + linear_cost(batch, c.hidden_size, 2 * c.intermediate_size, dtype)
            + linear_cost(batch, c.intermediate_size, c.hidden_size, dtype))


def layer_compute_time(cost: Cost, spec: HardwareSpec, dtype: DType) -> float:
    """Roofline time of ``cost`` on ``spec``: the larger of bytes / bandwidth and FLOPs / peak."""
    return max(cost.bytes / spec.memory_bandwidth, cost.flops / spec.peak(dtype))


@dataclass(frozen=True)
class TPEstimate:
    """Per-layer decode times at one TP size: rank compute, communication, and the speedup over tp = 1."""

    tp: int
    compute_s: float
    comm_s: float
    comm_bytes: float
    speedup: float  # t(tp=1) / (compute + comm)

    @property
    def comm_fraction(self) -> float:
        """Share of the layer's time spent in all-reduces."""
        return self.comm_s / (self.compute_s + self.comm_s)


def tp_estimate(config: ModelConfig, tp: int, *, batch: int = 1, kv_len: int = 1024, dtype: DType = "bfloat16",
                spec: HardwareSpec | str = "H100-SXM", link: Link | str = "H100-NVLink") -> TPEstimate:
    """Decode-layer time at ``tp`` against tp = 1 on ``spec`` GPUs joined by ``link`` (names from ``SPECS``,
    ``LINKS``).  Ignores overlap of communication with compute (Megatron's layer cannot overlap: the next
    matmul needs the reduced sum) and kernel launch overheads."""
    spec = SPECS[spec] if isinstance(spec, str) else spec
    link = LINKS[link] if isinstance(link, str) else link
    base = layer_compute_time(layer_decode_cost(config, 1, batch, kv_len, dtype), spec, dtype)
    compute = layer_compute_time(layer_decode_cost(config, tp, batch, kv_len, dtype), spec, dtype)
    comm = layer_comm_time(tp, batch, config.hidden_size, dtype, link)
    return TPEstimate(tp, compute, comm, layer_allreduce_bytes(tp, batch, config.hidden_size, dtype),
                      base / (compute + comm))


def report(batch: int = 1, kv_len: int = 1024) -> list[dict]:
    """The cost model's figures for Llama-2-7B and 70B at TP 1, 2, 4, 8 over H100 NVLink and PCIe (bf16 decode)."""
    rows = []
    for name, cfg in (("Llama-2-7B", llama2_7b_config()), ("Llama-2-70B", llama2_70b_config())):
        for link in LINKS:
            for tp in (1, 2, 4, 8):
                e = tp_estimate(cfg, tp, batch=batch, kv_len=kv_len, link=link)
                rows.append(dict(model=name, link=link, tp=tp, batch=batch, kv_len=kv_len,
                                 compute_us=e.compute_s * 1e6, comm_us=e.comm_s * 1e6, comm_bytes=e.comm_bytes,
                                 comm_fraction=e.comm_fraction, layer_speedup=e.speedup,
                                 decode_tok_s_bound=1 / (cfg.num_layers * (e.compute_s + e.comm_s))))
    return rows
