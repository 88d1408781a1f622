"""``python -m minillm bench cpu-peers``: minillm beside llama.cpp and transformers on CPU, at published models'
shapes and weight formats, batch-1 decode and prefill, side by side in one run.

For each shape (``models.configs.SHAPES``; its checkpoint made once by ``models.synthetic.make_model`` under
``models_dir``, bf16 safetensors + GGUFs) and each format:

- fp32, bf16: minillm (``load_model`` in that dtype) and transformers (``from_pretrained``) on the HF directory;
- q8_0, q4_1, q4_0: minillm on the GGUF's own blocks (``quant.gguf.read_gguf_weights`` + ``model_from_packed``: no
  float round trip; Q4_0 from its own 18-byte blocks, m = −8·d taken by the kernels; a format its reader lacks is
  reported as failed, with the reader's message); q4_k_m (llama.cpp's quantizer made it) re-blocked into int4/int8
  groups of 32 at load — more bytes than the file, so each peer's decode GB/s counts the bytes it stores
  (``peer.weight_bytes``) — and llama.cpp
  (``llama-cpp-python``, in its own process, ``perf.bench.llamacpp``: a SIGILL there is reported, not fatal) on
  the same file.

Each peer measures greedy batch-1 decode tok/s after a short prompt, and prefill tok/s (one prompt through an
empty cache, each engine batching it its own default way) at each prompt length.  The peers take turns within every
repeat, with the same thread count, so a neighbour's load falls on all of them alike; each row reports the median of
its repeats and every run.  Two probes take their turn in each repeat as well, best of the repeats: the streaming
read bandwidth (``perf.hardware.read_bandwidth``) and the matmul peak (``kernels.probe.matmul_flops``).  Decode is
reported in GB/s — the bytes one step reads: every stored weight (the LM head included, the embedding's row lookup
not) plus the K/V cache at the activations' width — and as a % of that read bandwidth, and of the median read pass
(``%med``: where the memory serves a rare pass far faster than most, the best pass is a roof no sustained stream
meets, and the median decode is compared with the median read); prefill in GFLOP/s
(``perf.roofline.prefill_cost``) and as a % of the matmul peak (bf16's for bf16, fp32's otherwise).  When the
peers' weights would not fit in memory together, they run one after another instead (``"interleaved": false``).

``neighbour`` (``perf.bench.neighbour``: none, copy, compute) starts a separate process on the same cores once the
checkpoints exist, runs every load and measurement beside it (the probes too: the % columns are of the roofs under
that load) and stops it after; the JSON and the table's heading record which, and what the neighbour itself did.

Not a test: it times and asserts nothing.  Ratios within one run are the result; on a shared machine the absolute
numbers move with the neighbours' load.
"""

from __future__ import annotations

import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minillm.kernels.probe import available_memory
from minillm.perf.bench.llamacpp import LlamaCppPeer
from minillm.perf.bench.neighbour import COPY_BYTES, Neighbour, check_neighbour, describe_neighbour

FLOAT_FORMATS = ("fp32", "bf16")
GGUF_FORMATS = ("q8_0", "q4_1", "q4_0", "q4_k_m")  # the GGUF formats both minillm and llama.cpp are asked to run
FORMATS = FLOAT_FORMATS + GGUF_FORMATS
PROMPT_LENS = (128, 512, 2048)
DECODE_PROMPT_LEN = 32  # the prompt before the timed decode steps


def models_dir_default() -> Path:
    from minillm.models.loader import cache_root

    return cache_root() / "shapes"


def ensure_checkpoint(shape: str, formats: tuple[str, ...], models_dir: Path, vocab: str = "default") -> Path:
    """``models_dir/shape`` (``models_dir/shape-vocabN`` with the shape's own vocabulary of N tokens, ``vocab=
    "shape"``): the shape's bf16 HF directory and the GGUFs ``formats`` need, made once (seed 0)."""
    from minillm.models.synthetic import LLAMA_QUANTIZED, make_model, print_report, synthetic_config

    size = synthetic_config(shape, vocab).vocab_size
    out = Path(models_dir) / (shape if size == synthetic_config(shape).vocab_size else f"{shape}-vocab{size}")
    gguf = [f for f in formats if f in GGUF_FORMATS]
    if LlamaCppPeer.unavailable() is not None:  # llama.cpp's quantizer writes these: their rows say so instead
        gguf = [f for f in gguf if f not in LLAMA_QUANTIZED]
    if not (out / "config.json").exists() or any(not gguf_path(out, shape, f).exists() for f in gguf):
        print(f"[making the {shape} checkpoint in {out}]", flush=True)
        print_report(make_model(shape, out, gguf=gguf, dtype="bfloat16", vocab=vocab))
    return out


def gguf_path(directory: Path, shape: str, fmt: str) -> Path:
    from minillm.models.synthetic import gguf_file_name

    return Path(directory) / gguf_file_name(shape, fmt)


# ------------------------------------------------------------------------------------------------ the peers
class MinillmPeer:
    """minillm's engine (``LLMEngine``: the path ``LLM.generate`` takes) on the HF directory or the GGUF's blocks."""

    name = "minillm"

    def __init__(self, directory: Path, shape: str, fmt: str):
        self.source = gguf_path(directory, shape, fmt) if fmt in GGUF_FORMATS else Path(directory)
        self.fmt, self.model = fmt, None

    def load(self) -> None:
        from minillm.models.loader import load_config, load_model, resolve

        if self.fmt in GGUF_FORMATS:
            from minillm.quant.apply import model_from_packed
            from minillm.quant.gguf import read_gguf_weights

            config = load_config(resolve(self.source.parent))
            self.model = model_from_packed(config, read_gguf_weights(self.source), dtype=torch.float32, device="cpu")
        else:
            self.model = load_model(self.source, dtype="float32" if self.fmt == "fp32" else "bfloat16", device="cpu")

    def weight_bytes(self) -> int:
        """The bytes of weights its decode step reads, as loaded (``perf.bench.quant.weight_bytes_per_step``)."""
        from minillm.perf.bench.quant import weight_bytes_per_step

        return weight_bytes_per_step(self.model)

    def decode(self, prompt: list[int], n: int) -> float:
        from minillm.perf.bench.quant import decode_rate

        return decode_rate(self.model, [prompt], n)[1]

    def prefill(self, prompt: list[int]) -> float:
        from minillm.perf.bench.quant import decode_rate

        return len(prompt) / decode_rate(self.model, [prompt], 1)[0]

    def close(self) -> None:
        self.model = None


class TransformersPeer:
    """transformers ``generate`` (decode) and one forward with the last position's logits (prefill)."""

    name = "transformers"

    def __init__(self, directory: Path, shape: str, fmt: str):
        self.source, self.dtype, self.model = Path(directory), torch.float32 if fmt == "fp32" else torch.bfloat16, None

    def load(self) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(self.source, dtype=self.dtype).eval()

    def decode(self, prompt: list[int], n: int) -> float:
        from minillm.perf.bench.decode import time_hf

        return 1.0 / time_hf(self.model, [prompt], n, count_ops=False)[0]

    def prefill(self, prompt: list[int]) -> float:
        import time

        ids = torch.tensor([prompt])
        with torch.inference_mode():
            start = time.perf_counter()
            self.model(ids, logits_to_keep=1)
            return len(prompt) / (time.perf_counter() - start)

    def close(self) -> None:
        self.model = None


# ------------------------------------------------------------------------------------------------ bytes and FLOPs
def weight_bytes(config, fmt: str) -> int:
    """Stored weight bytes one decode step reads in ``fmt``: every linear, the norms and the LM head (the embedding
    table itself when tied), not the embedding's row lookup.  GGUF formats as ``models.synthetic`` stores them."""
    from minillm.models.synthetic import gguf_nbytes, tensor_plan

    total = 0
    for p in tensor_plan(config):
        if p.gguf == "token_embd.weight" and not config.tie_word_embeddings:
            continue
        numel = 1
        for s in p.shape:
            numel *= s
        total += gguf_nbytes(p, fmt) if fmt in GGUF_FORMATS else numel * (4 if fmt == "fp32" else 2)
    return total


def _activation_dtype(fmt: str) -> torch.dtype:
    return torch.bfloat16 if fmt == "bf16" else torch.float32


def decode_bytes(config, fmt: str, kv_len: int, weights: int | None = None) -> float:
    """Bytes of one batch-1 decode step at ``kv_len`` cached tokens: the weights (``weights``, else
    ``weight_bytes``) + the K/V read and written."""
    from minillm.perf.roofline import decode_step_cost

    kv = decode_step_cost(config, 1, kv_len, _activation_dtype(fmt)).breakdown["kv_cache"]
    return (weight_bytes(config, fmt) if weights is None else weights) + kv


def prefill_flops(config, prompt_len: int) -> float:
    from minillm.perf.roofline import prefill_cost

    return prefill_cost(config, 1, prompt_len, torch.float32).flops


# ------------------------------------------------------------------------------------------------ probes
@dataclass
class Probes:
    """The roofs measured in this run, best of its repeats: read bandwidth (bytes/s), matmul peak per dtype."""

    nbytes: int
    matmul_n: int
    dtypes: tuple[str, ...]
    read_bandwidth: float = 0.0
    read_passes: list = field(default_factory=list)  # every timed read pass, bytes/s
    matmul_peak: dict = field(default_factory=dict)

    def take_turn(self) -> None:
        """One turn between the peers' repeats: a streaming read of an ``nbytes`` buffer (allocated for the turn
        only: the peers' weights keep the memory) and a ``matmul_n``³ matmul per dtype; the best so far is kept."""
        from minillm.kernels.cpu import native
        from minillm.kernels.probe import matmul_flops
        from minillm.perf.hardware import read_bandwidth

        buf = torch.full((self.nbytes // 4,), 1.0)  # written, so every page is mapped before the timed reads
        reduce = native.read_sum if native.available() else torch.sum
        self.read_passes += [read_bandwidth(buf, repeats=1, reduce=reduce) for _ in range(3)]
        self.read_bandwidth = max(self.read_passes)
        for dt in self.dtypes:
            self.matmul_peak[dt] = max(self.matmul_peak.get(dt, 0.0), matmul_flops(dt, self.matmul_n))


def cpu_info() -> dict:
    """``lscpu``'s model name, its instruction-set flags and the core/cache lines (``/proc/cpuinfo``'s name when
    lscpu is missing)."""
    from minillm.perf.bench.decode import machine_info

    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}
    keep = ("Architecture", "Vendor ID", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Socket(s)",
            "L1d cache", "L2 cache", "L3 cache", "Hypervisor vendor")
    return {"model": fields.get("Model name") or machine_info()["processor"], "flags": fields.get("Flags", "").split(),
            "lscpu": {k: fields[k] for k in keep if k in fields}}


# ------------------------------------------------------------------------------------------------ the benchmark
def _peers(directory: Path, shape: str, fmt: str, threads: int, n_ctx: int) -> tuple[list, dict[str, str]]:
    """The peers that run ``fmt`` here, and {name: reason} for those skipped."""
    peers: list = [MinillmPeer(directory, shape, fmt)]
    skipped: dict[str, str] = {}
    if fmt in FLOAT_FORMATS:
        peers.append(TransformersPeer(directory, shape, fmt))
    elif (why := LlamaCppPeer.unavailable()) is not None:
        skipped["llama.cpp"] = why
    else:
        peers.append(LlamaCppPeer(gguf_path(directory, shape, fmt), threads=threads, n_ctx=n_ctx))
    return peers, skipped


@dataclass
class _Record:
    """One peer's measurements at one (shape, format) as they accumulate over the repeats."""

    peer: object
    weight_bytes: int | None = None  # what the peer's decode step reads, where it can say (else the format's plan)
    decode: list = field(default_factory=list)
    prefill: dict = field(default_factory=dict)  # prompt_len -> [tok/s, ...]
    error: str | None = None

    def measure(self, decode_prompt: list[int], n_tokens: int, prompts: dict[int, list[int]]) -> None:
        if self.error is not None:
            return
        try:
            self.decode.append(self.peer.decode(decode_prompt, n_tokens))
            for n, prompt in prompts.items():
                self.prefill.setdefault(n, []).append(self.peer.prefill(prompt))
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, the others go on
            self.error = f"{type(e).__name__}: {e}"
            self.peer.close()


def _load(record: _Record, decode_prompt: list[int], prompt: list[int]) -> None:
    """Load the peer and warm it up untimed (first-call costs: native libraries, allocations, thread pools)."""
    try:
        record.peer.load()
        if hasattr(record.peer, "weight_bytes"):
            record.weight_bytes = record.peer.weight_bytes()
        record.peer.decode(decode_prompt, 4)
        record.peer.prefill(prompt)
    except Exception as e:  # noqa: BLE001 - e.g. a format minillm's GGUF reader lacks, a SIGILL'd llama.cpp
        record.error = f"{type(e).__name__}: {e}"
        record.peer.close()


def bench_cpu_peers(shapes: tuple[str, ...] = ("llama-3.2-1b",), formats: tuple[str, ...] = FORMATS,
                    prompt_lens: tuple[int, ...] = PROMPT_LENS, threads: int | None = None, repeats: int = 3,
                    n_tokens: int = 64, models_dir: Path | None = None, out: Path | None = None,
                    probe_bytes: int = 256 << 20, matmul_n: int = 1024, save: bool = True, neighbour: str = "none",
                    neighbour_bytes: int = COPY_BYTES, vocab: str = "default") -> dict:
    """Measure every (shape, format, peer) as the module docstring says; print the table; save the JSON to ``out``
    (default ``benchmarks/results/cpu-peers.json``).  ``threads``: torch's (and so minillm's native kernels') and
    llama.cpp's thread count (default: torch's).  ``neighbour``: the process beside the measurement (none, copy,
    compute; a copy streams over two arrays of ``neighbour_bytes``).  ``vocab``: the checkpoints' vocabulary
    (``models.synthetic.VOCABS``).  Returns the payload."""
    from minillm.models.configs import shape_config

    for s in shapes:
        shape_config(s)  # ValueError naming the shapes
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise ValueError(f"--formats: {bad[0]!r} is not one of {', '.join(FORMATS)}")
    check_neighbour(neighbour)
    if not prompt_lens or min(prompt_lens) < 1 or repeats < 1 or n_tokens < 4:
        raise ValueError(f"prompt lengths must be >= 1 (got {prompt_lens}), repeats >= 1 (got {repeats}) and "
                         f"tokens >= 4 (got {n_tokens}: transformers times the steps after its second token)")
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    probes = Probes(probe_bytes, matmul_n, tuple(sorted({"float32"} | ({"bfloat16"} if "bf16" in formats else set()))))
    rows, models_dir = [], Path(models_dir or models_dir_default())
    directories = {shape: ensure_checkpoint(shape, tuple(formats), models_dir, vocab) for shape in shapes}
    with Neighbour(neighbour, neighbour_bytes) as beside:
        if neighbour != "none":
            print(f"[a {neighbour} neighbour beside the measurement: pid {beside.proc.pid}]", flush=True)
        for shape in shapes:
            rows += _measure_shape(shape, directories[shape], formats, prompt_lens, threads, repeats, n_tokens, probes)
    _finish_rows(rows, probes)
    payload = {"benchmark": "cpu-peers", "cpu": cpu_info(), "threads": threads, "repeats": repeats,
               "neighbour": beside.record, "n_tokens": n_tokens, "decode_prompt_len": DECODE_PROMPT_LEN,
               "prompt_lens": list(prompt_lens),
               "shapes": list(shapes), "formats": list(formats), "vocab": vocab, "models_dir": str(models_dir),
               "read_bandwidth_gb_s": probes.read_bandwidth / 1e9,
               "read_bandwidth_median_gb_s": statistics.median(probes.read_passes) / 1e9,
               "read_passes_gb_s": [r / 1e9 for r in probes.read_passes],
               "matmul_peak_gflop_s": {k: v / 1e9 for k, v in probes.matmul_peak.items()},
               "rows": rows, "ratios": ratios(rows)}
    print_table(payload)
    if save:
        from minillm.perf.bench.decode import save_results

        path = Path(out) if out else None
        saved = save_results(path.stem if path else "cpu-peers", payload, path.parent if path else None)
        payload["path"] = str(saved)
        print(f"saved {saved}")
    return payload


def _measure_shape(shape: str, directory: Path, formats, prompt_lens, threads: int, repeats: int, n_tokens: int,
                   probes: Probes) -> list[dict]:
    """Every format's peers at one shape, taking turns within each repeat (see the module docstring): their rows."""
    from minillm.models.synthetic import synthetic_config

    rows: list[dict] = []
    gen = torch.Generator().manual_seed(0)
    config = synthetic_config(shape)
    decode_prompt = torch.randint(100, config.vocab_size, (DECODE_PROMPT_LEN,), generator=gen).tolist()
    prompts = {n: torch.randint(100, config.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens}
    n_ctx = max(max(prompt_lens), DECODE_PROMPT_LEN + n_tokens) + 16
    for fmt in formats:
        if fmt in GGUF_FORMATS and not gguf_path(directory, shape, fmt).exists():
            why = f"no {gguf_path(directory, shape, fmt).name}: {LlamaCppPeer.unavailable()}"
            rows += [{"shape": shape, "format": fmt, "peer": name, "status": "skipped", "reason": why}
                     for name in ("minillm", "llama.cpp")]
            continue
        peers, skipped = _peers(directory, shape, fmt, threads, n_ctx)
        # a peer holds its weights plus, while loading a float format, the bf16 file's tensors (~1.5x); a GGUF's
        # re-blocked K-quants take up to ~1.3x the file
        stored = gguf_path(directory, shape, fmt).stat().st_size if fmt in GGUF_FORMATS else weight_bytes(config, fmt)
        need, free = 1.5 * stored, available_memory()
        for p in [p for p in peers if need > 0.9 * free]:
            peers.remove(p)
            skipped[p.name] = f"needs ~{need / 1e9:.1f} GB of memory, {free / 1e9:.1f} GB available"
        records = [_Record(p) for p in peers]
        interleaved = need * len(records) < 0.8 * free
        print(f"[{shape} {fmt}: {', '.join(p.name for p in peers)}"
              f"{'' if interleaved else ', one after another (they do not fit in memory together)'}]", flush=True)
        groups = [records] if interleaved else [[r] for r in records]
        for group in groups:
            for r in group:
                _load(r, decode_prompt, prompts[min(prompt_lens)])
            for _ in range(repeats):
                probes.take_turn()
                for r in group:
                    r.measure(decode_prompt, n_tokens, prompts)
            for r in group:
                r.peer.close()
        kv_len = DECODE_PROMPT_LEN + n_tokens // 2
        rows += [_row(shape, fmt, r, config, kv_len, interleaved) for r in records]
        rows += [{"shape": shape, "format": fmt, "peer": name, "status": "skipped", "reason": why}
                 for name, why in skipped.items()]
    return rows


def _row(shape: str, fmt: str, r: _Record, config, kv_len: int, interleaved: bool) -> dict:
    """A peer's row: medians and every run; the roofline units are filled in by ``_finish_rows``."""
    row = {"shape": shape, "format": fmt, "peer": r.peer.name, "interleaved": interleaved,
           "status": "failed" if r.error and not r.decode else "ok", "reason": r.error,
           "decode_bytes_per_token": decode_bytes(config, fmt, kv_len, r.weight_bytes)}
    if getattr(r.peer, "version", None):
        row["version"] = r.peer.version
    if r.decode:
        row["decode_tok_s"], row["decode_runs"] = statistics.median(r.decode), r.decode
        row["prefill"] = [{"prompt_len": n, "tok_s": statistics.median(v), "runs": v,
                           "flops_per_prompt": prefill_flops(config, n)} for n, v in r.prefill.items()]
    return row


def _finish_rows(rows: list[dict], probes: Probes) -> None:
    """GB/s and % of the read bandwidth (decode), GFLOP/s and % of the matmul peak (prefill), from the probes."""
    for row in rows:
        if "decode_tok_s" not in row:
            continue
        gb_s = row["decode_bytes_per_token"] * row["decode_tok_s"]
        row["decode_gb_s"] = gb_s / 1e9
        row["decode_pct_read"] = 100 * gb_s / probes.read_bandwidth
        row["decode_pct_read_median"] = 100 * gb_s / statistics.median(probes.read_passes)
        peak = probes.matmul_peak["bfloat16" if row["format"] == "bf16" else "float32"]
        for p in row["prefill"]:
            p["gflop_s"] = p["flops_per_prompt"] * p["tok_s"] / p["prompt_len"] / 1e9
            p["pct_matmul_peak"] = 100 * p["gflop_s"] * 1e9 / peak


def ratios(rows: list[dict]) -> list[dict]:
    """minillm ÷ each other peer at the same (shape, format): decode and each prompt length's prefill."""
    ok = {(r["shape"], r["format"], r["peer"]): r for r in rows if "decode_tok_s" in r}
    out = []
    for (shape, fmt, peer), theirs in ok.items():
        ours = ok.get((shape, fmt, "minillm"))
        if peer == "minillm" or ours is None:
            continue
        pre = {p["prompt_len"]: p["tok_s"] for p in theirs["prefill"]}
        out.append({"shape": shape, "format": fmt, "peer": peer,
                    "decode": ours["decode_tok_s"] / theirs["decode_tok_s"],
                    "prefill": {str(p["prompt_len"]): p["tok_s"] / pre[p["prompt_len"]] for p in ours["prefill"]
                                if p["prompt_len"] in pre}})
    return out


def print_table(payload: dict) -> None:
    """One line per (shape, format, peer): decode tok/s, GB/s, % read; prefill tok/s and % peak per length."""
    print(f"\n{payload['cpu']['model']}, {payload['threads']} threads, {payload['repeats']} interleaved repeats; "
          f"read {payload['read_bandwidth_gb_s']:.1f} GB/s (median pass "
          f"{payload.get('read_bandwidth_median_gb_s', float('nan')):.1f}), matmul peak "
          + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in payload["matmul_peak_gflop_s"].items())
          + f"; neighbour: {describe_neighbour(payload.get('neighbour', {'kind': 'none'}))}")
    lens = payload["prompt_lens"]
    print(f"{'shape':<14}{'fmt':<8}{'peer':<14}{'decode tok/s':>13}{'GB/s':>7}{'%read':>6}{'%med':>6}"
          + "".join(f"{f'prefill {n}':>14}{'%peak':>6}" for n in lens))
    for r in payload["rows"]:
        head = f"{r['shape']:<14}{r['format']:<8}{r['peer']:<14}"
        if "decode_tok_s" not in r:
            print(head + f"{r['status']}: {r.get('reason')}")
            continue
        pre = {p["prompt_len"]: p for p in r["prefill"]}
        print(head + f"{r['decode_tok_s']:>13.1f}{r['decode_gb_s']:>7.1f}{r['decode_pct_read']:>6.0f}"
              f"{r.get('decode_pct_read_median', float('nan')):>6.0f}"
              + "".join(f"{pre[n]['tok_s']:>14.1f}{pre[n]['pct_matmul_peak']:>6.0f}" if n in pre else f"{'-':>20}"
                        for n in lens)
              + (f"  (then failed: {r['reason']})" if r["reason"] else ""))
    for q in payload["ratios"]:
        pre = ", ".join(f"{n}: {v:.2f}x" for n, v in q["prefill"].items())
        print(f"minillm / {q['peer']} at {q['shape']} {q['format']}: decode {q['decode']:.2f}x, prefill {pre}")
