"""Quantization benchmarks.

``bench_quant`` (``python -m minillm bench quant``): the default model (or any) per scheme — fp32, bf16 where the
device has it natively, int8, int4 g32 (quantized on load), int4 from the GGUF's own Q4_1 blocks, and at group 128
(64 where 128 does not divide K: ``apply.fit_group_size``) plain int4, AWQ and GPTQ (calibrated on load); then the
weight-and-activation schemes (``quant.smooth``): W8A8 dynamic, static, SmoothQuant at α 0.5 and 0.8, and FP8
where the GPU has fp8 GEMMs — side by side in one run (``--prefill-len 512 --batch 32``: the compute-bound rows
where W8A8 should pay): weight MB (stored, packed), KV bytes per token, batch-1 and batch-8 greedy decode tok/s, prefill
tok/s, GB/s and MBU counted in the bytes a decode step reads (packed weights + KV), and perplexity on held-out text;
then the KV-cache rows (fp32 weights, ``kv_cache_dtype`` int8 / fp8): KV bytes per token and perplexity only;
plus llama.cpp on the same GGUF when ``llama_cpp`` is importable.

``bench_quant_gemv``: the quantized GEMV alone — fp32 ``F.linear`` next to the native int8 and int4 (Q4_1)
kernels over SmolLM2-135M's layer stack, in GB/s counted in *stored* bytes (packed codes + scales), the roofline
unit of a bandwidth-bound decode.  Every layer gets its own weights, so the stack (≈ 390 MB fp32, 100 MB int8,
61 MB int4 over 30 layers) is streamed from memory, not served from cache, as in a real decode step.  Each scheme
runs twice: one Python call per GEMV (as the per-layer model path makes them) and as one native loop over the
whole stack ("stack" rows: the fused decode step's kernels and threading, no Python between the GEMVs).

Not a test: it times, it asserts nothing.  On a shared machine the numbers move with the neighbours' load;
compare ratios within one run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from minillm.models.configs import decoder_linear_shapes, smollm2_135m_config
from minillm.quant.activation import fp8_supported
from minillm.quant.smooth import W8A8_SCHEMES
from minillm.quant.weight import quantize_int4, quantize_int8

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query / 3 KV heads of 64 -> (N, K) of each linear per layer
SMOLLM2_LAYER_SHAPES = decoder_linear_shapes(smollm2_135m_config())  # qkv, o, gate_up, down
SMOLLM2_LAYERS = smollm2_135m_config().num_layers


def _stack_pass(fn: Callable, xs: dict[int, torch.Tensor], weights: list) -> float:
    """Seconds for one pass over every weight in order, one Python call per weight; ``xs[K]`` is the input for a
    weight with K columns."""
    t0 = time.perf_counter()
    for w in weights:
        fn(xs[w.shape[1]], w)
    return time.perf_counter() - t0


def _timed(run: Callable[[], object]) -> float:
    """Seconds for one call of ``run`` (a native stack: every GEMV in one ctypes call)."""
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def _read_pass(buf: torch.Tensor) -> float:
    """Seconds for one streaming read of ``buf`` (native.read_sum: the roof the GEMVs are compared with)."""
    from minillm.kernels.cpu import native

    t0 = time.perf_counter()
    native.read_sum(buf)
    return time.perf_counter() - t0


def bench_quant_gemv(rows: int = 1, layers: int = SMOLLM2_LAYERS, repeats: int = 5, group_size: int = 32,
                     seed: int = 0, read_bandwidth: bool = True, native_stack: bool = True) -> list[dict]:
    """Time y = x @ W.T over ``layers`` × SmolLM2's four linears with ``rows`` input rows (1..8): fp32 F.linear,
    native int8 (per-channel) and native int4 (Q4_1, ``group_size``), each with int8 activations (the default
    kernels) and exact fp32 activations — one Python call per GEMV, as the per-layer model path makes them.

    With ``native_stack`` (and the fused library built), the same weights also run as one native loop
    (``perf.bench.linear_stack.LinearStack``: every GEMV of the stack in one ctypes call, the kernels the fused decode
    step runs): "... stack" rows, one OpenMP region per GEMV as the fused step opens them, and "... stack 1 region", the
    whole stack in one region with a barrier around each GEMV; and "... read-only", the same stored bytes read in the
    same order and thread split with no arithmetic (``LinearStack.read_only``) — the memory roof of that access pattern:
    120 weights of 0.2–1 MB, each split across the threads, restart the hardware prefetchers' streams 240 times where
    one 256 MiB read starts them once. The gap between a Python-dispatched row and its stack row is dispatch (~10 µs a
    call, 120 calls); between the two stack rows, the per-GEMV regions' cost; between a stack row and its read-only row,
    the kernel's arithmetic not hidden under its loads.

    The schemes take turns within every repeat and each keeps its best pass (on a shared machine the
    least-disturbed one), so their ratios come from the same minutes.  With ``read_bandwidth`` a 256 MiB streaming
    read takes its turn too, and every scheme reports its stored-bytes rate as a share of it (``pct_of_read``).
    Returns one dict per scheme: ms per stack, stored MB, GB/s (stored bytes / time), speed-up over fp32 and, for
    the read probe, scheme "read bandwidth"."""
    from minillm.kernels.cpu import decode, native
    from minillm.kernels.cpu import quant as native_quant
    from minillm.perf.bench.linear_stack import LinearStack

    g = torch.Generator().manual_seed(seed)
    dense = [torch.randn(n, k, generator=g) * 0.02 for _ in range(layers) for n, k in SMOLLM2_LAYER_SHAPES]
    xs = {k: torch.randn(rows, k, generator=g) for _, k in SMOLLM2_LAYER_SHAPES}
    nd = sum(w.nbytes for w in dense)

    def per_call(fn, weights):
        return lambda: _stack_pass(fn, xs, weights)

    schemes: list[tuple[str, Callable[[], float], int]] = [("fp32 F.linear", per_call(F.linear, dense), nd)]
    stacks: list[tuple[str, list, int]] = [("fp32", dense, nd)]
    if native_quant.available():
        w8 = [quantize_int8(w) for w in dense]
        w4 = [quantize_int4(w, group_size) for w in dense]
        n8, n4 = sum(w.nbytes for w in w8), sum(w.nbytes for w in w4)
        schemes += [("int8 native", per_call(native_quant.int8_linear, w8), n8),
                    ("int8 native exact", per_call(lambda x, w: native_quant.int8_linear(x, w, exact=True), w8), n8),
                    (f"int4 g{group_size} native", per_call(native_quant.int4_linear, w4), n4),
                    (f"int4 g{group_size} exact",
                     per_call(lambda x, w: native_quant.int4_linear(x, w, exact=True), w4), n4)]
        stacks += [("int8", w8, n8), (f"int4 g{group_size}", w4, n4)]
    if native_stack and decode.available():
        for name, weights, nbytes in stacks:
            st = LinearStack(weights, rows)
            for x in st.inputs:
                x.copy_(xs[x.shape[1]])
            schemes += [(f"{name} stack", lambda st=st: _timed(st.run), nbytes),
                        (f"{name} stack 1 region", lambda st=st: _timed(lambda: st.run(one_region=True)), nbytes),
                        (f"{name} read-only", lambda st=st: _timed(st.read_only), nbytes)]
    buf = torch.ones(256 << 18) if read_bandwidth and native.available() else None  # 256 MiB fp32, ≫ L3
    best = {name: float("inf") for name, *_ in schemes} | ({"read bandwidth": float("inf")} if buf is not None else {})
    with torch.inference_mode():
        for _name, run, _ in schemes:
            run()  # warm-up (and the native libraries' first-use compile)
        for _ in range(repeats):
            for name, run, _ in schemes:
                best[name] = min(best[name], run())
            if buf is not None:
                best["read bandwidth"] = min(best["read bandwidth"], _read_pass(buf))
    out = [{"scheme": name, "rows": rows, "ms": best[name] * 1e3, "MB": nbytes / 1e6,
            "GB/s": nbytes / best[name] / 1e9} for name, _, nbytes in schemes]
    if buf is not None:
        out.append({"scheme": "read bandwidth", "rows": rows, "ms": best["read bandwidth"] * 1e3,
                    "MB": buf.nbytes / 1e6, "GB/s": buf.nbytes / best["read bandwidth"] / 1e9})
    for r in out:
        r["speedup_vs_fp32"] = out[0]["ms"] / r["ms"] if r["scheme"] != "read bandwidth" else float("nan")
        if buf is not None:
            r["pct_of_read"] = 100 * r["GB/s"] / out[-1]["GB/s"]
    return out


def print_table(rows: list[dict]) -> None:
    """One line per scheme."""
    print(f"{'scheme':<24}{'rows':>5}{'ms/stack':>10}{'MB':>8}{'GB/s':>8}{'x fp32':>8}{'% read':>8}")
    for r in rows:
        print(f"{r['scheme']:<24}{r['rows']:>5}{r['ms']:>10.2f}{r['MB']:>8.1f}{r['GB/s']:>8.1f}"
              f"{r['speedup_vs_fp32']:>8.2f}{r.get('pct_of_read', float('nan')):>8.0f}")



# --------------------------------------------------------------------------------------------- whole-model bench
SCHEMES = ("fp32", "bf16", "int8", "int4-g32", "int4-gguf", "int4-g128", "awq-g128", "gptq-g128",
           "w8a8", "w8a8-static", "w8a8-smooth", "w8a8-smooth-a0.8", "fp8")  # fp8: CUDA ≥ 8.9 only
SMOOTH_PREFIX = "w8a8-smooth-a"  # "w8a8-smooth-a0.8": SmoothQuant at alpha 0.8
KV_SCHEMES = ("int8", "fp8")  # kv_cache_dtype rows: fp32 weights, the cache quantized


def bf16_is_native(device: torch.device) -> bool:
    """Whether bf16 matmuls run at hardware speed here (CUDA with bf16; x86 with AVX512-BF16 or AMX)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False  # not Linux: unknown, so skipped (bf16 emulated on AVX2 is orders of magnitude slower than fp32)
    return "avx512_bf16" in flags or "amx_bf16" in flags


def check_schemes(schemes) -> None:
    """ValueError naming any scheme ``bench_quant`` does not know (an unknown name must not load fp32 silently)."""
    for scheme in schemes:
        if scheme.startswith(SMOOTH_PREFIX):
            try:
                alpha = float(scheme.removeprefix(SMOOTH_PREFIX))
            except ValueError:
                alpha = -1.0
            if 0.0 <= alpha <= 1.0:
                continue
        elif scheme in SCHEMES:
            continue
        raise ValueError(f"schemes: unknown scheme {scheme!r}; use any of {', '.join(SCHEMES)} "
                         f"(or {SMOOTH_PREFIX}<alpha in [0, 1]>)")


def _load(scheme: str, model_name: str | None, device: torch.device):
    from minillm.models.loader import load_model

    dtype = "bfloat16" if scheme == "bf16" else "float32"
    quantization = {"int8": "int8", "int4-g32": "int4", "int4-gguf": "int4"}.get(scheme)
    if scheme in ("int4-g32", "int4-g128"):  # quantize the float checkpoint on load, not the GGUF's blocks
        from minillm.quant.apply import quantize_model

        group = 32 if scheme == "int4-g32" else 128
        return quantize_model(load_model(model_name, dtype=dtype, device=device), "int4", group, fit_group=True)
    if scheme in ("awq-g128", "gptq-g128"):  # calibrated on load (a GGUF is dequantized to fp32 first)
        return load_model(model_name, dtype=dtype, device=device, quantization=scheme.split("-")[0])
    if scheme.startswith(SMOOTH_PREFIX):
        return load_model(model_name, dtype=dtype, device=device, quantization="w8a8-smooth",
                          quantization_config={"alpha": float(scheme.removeprefix(SMOOTH_PREFIX))})
    if scheme in W8A8_SCHEMES:  # weights and activations (quant.smooth), the calibrated ones on the same split
        return load_model(model_name, dtype=dtype, device=device, quantization=scheme)
    return load_model(model_name, dtype=dtype, device=device, quantization=quantization)


def weight_bytes_per_step(model) -> int:
    """Bytes of the weights one decode step reads: every linear's stored weight (packed or float, the LM head in
    full) and the norms; the embedding lookup reads B rows, counted as nothing."""
    from minillm.layers.linear import Linear, QuantLinear

    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.packed_weight.nbytes
        elif isinstance(m, Linear):
            total += m.weight.nbytes
    return total + sum(p.nbytes for n, p in model.named_parameters() if "norm" in n)


def decode_rate(model, prompts: list[list[int]], n_tokens: int) -> tuple[float, float]:
    """(seconds to the first token, decode tokens/s summed over the batch after it) for a greedy batch, through
    ``LLMEngine`` — the path a user's ``LLM.generate`` takes (paged KV, the scheduler, and on CPU the fused native
    decode step where ``engine.native_runner`` supports the model).  The engine is made before the clock starts."""
    from minillm.config import EngineConfig
    from minillm.engine.llm_engine import LLMEngine
    from minillm.sampling.params import SamplingParams

    B = len(prompts)
    longest = max(len(p) for p in prompts) + n_tokens
    engine = LLMEngine(model, None, EngineConfig(max_model_len=longest, max_num_seqs=max(B, 1)), eos_token_ids=())
    params = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    first = None  # the end of the step that gave every sequence its first token
    produced = later = 0
    while engine.has_unfinished_requests():
        n = sum(len(u.token_ids) for u in engine.step())
        produced += n
        if first is None and produced >= B:
            first, later = time.perf_counter(), 0
        elif first is not None:
            later += n
    end = time.perf_counter()
    return first - start, (later / (end - first) if later else float("nan"))


def _llama_cpp_row(gguf, prompt: list[int], n_tokens: int, repeats: int) -> dict | None:
    """llama.cpp's batch-1 decode on ``gguf`` in its own process (``perf.bench.llamacpp``: a build that dies of
    SIGILL is reported in the row); None when llama-cpp-python (the optional ``bench`` extra) is not installed."""
    from minillm.perf.bench.llamacpp import LlamaCppPeer, PeerDied

    if LlamaCppPeer.unavailable() is not None:
        return None
    peer = LlamaCppPeer(gguf, threads=torch.get_num_threads(), n_ctx=1024)
    try:
        peer.load()
        rates = sorted(peer.decode(prompt, n_tokens) for _ in range(repeats))
    except PeerDied as e:
        return {"scheme": "llama.cpp Q4_1", "error": str(e)}
    finally:
        peer.close()
    return {"scheme": "llama.cpp Q4_1", "decode_b1_tok_s": rates[len(rates) // 2]}


def bench_quant(model_name: str | None = None, device: str | None = None, schemes=SCHEMES, n_tokens: int = 32,
                prompt_len: int = 32, prefill_len: int = 256, batch: int = 8, repeats: int = 3,
                ppl_tokens: int = 2048, kv_schemes=KV_SCHEMES, save: bool = True) -> dict:
    """Per scheme: weight MB, KV bytes/token, decode tok/s at batch 1 and ``batch``, prefill tok/s, GB/s and MBU
    (bytes per step ÷ the read bandwidth ``measure_device`` measured here), and perplexity on the first
    ``ppl_tokens`` held-out tokens (0 skips it).  Then per ``kv_schemes`` cache dtype, fp32 weights: KV bytes/token
    and perplexity through that cache.  Medians of ``repeats``.  Saved as JSON (``save_results``)."""
    from minillm.models.loader import default_model_path, load_tokenizer, resolve_device
    from minillm.perf.bench.decode import save_results
    from minillm.perf.machine import machine_spec
    from minillm.perf.perplexity import heldout_token_ids, perplexity

    check_schemes(schemes)
    dev = resolve_device(device)
    bandwidth = machine_spec(str(dev)).memory_bandwidth  # the cached roof of this machine
    tokenizer = load_tokenizer(model_name)
    ppl_ids = heldout_token_ids(tokenizer, "evaluation", ppl_tokens) if ppl_tokens else None
    gen = torch.Generator().manual_seed(0)
    rows = []
    for scheme in schemes:
        if scheme == "bf16" and not bf16_is_native(dev):
            continue
        if scheme == "int4-gguf" and model_name is not None and not str(model_name).endswith(".gguf"):
            continue
        if scheme == "fp8" and fp8_supported(dev) is not None:
            continue  # no fp8 GEMM on this device (CPUs, GPUs below compute capability 8.9)
        model = _load(scheme, model_name, dev)
        cfg = model.config
        kv_token = 2 * cfg.num_layers * cfg.kv_size * model.dtype.itemsize  # K and V, every layer
        prompts = [torch.randint(100, cfg.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
        long = torch.randint(100, cfg.vocab_size, (prefill_len,), generator=gen).tolist()
        decode_rate(model, prompts[:1], 4)  # warm-up (native library load, first allocations)
        b1 = sorted(decode_rate(model, prompts[:1], n_tokens)[1] for _ in range(repeats))[repeats // 2]
        bn = sorted(decode_rate(model, prompts, n_tokens)[1] for _ in range(repeats))[repeats // 2]
        ttft = sorted(decode_rate(model, [long], 1)[0] for _ in range(repeats))[repeats // 2]
        wbytes = weight_bytes_per_step(model)
        kv_len = prompt_len + n_tokens // 2
        step1, stepn = wbytes + kv_len * kv_token, wbytes + batch * kv_len * kv_token
        row = {"scheme": scheme, "dtype": str(model.dtype).replace("torch.", ""), "weight_MB": wbytes / 1e6,
               "kv_bytes_per_token": kv_token, "decode_b1_tok_s": b1, f"decode_b{batch}_tok_s": bn,
               "prefill_tok_s": prefill_len / ttft, "b1_GB_s": step1 * b1 / 1e9, "b1_MBU": step1 * b1 / bandwidth,
               f"b{batch}_GB_s": stepn * bn / batch / 1e9, f"b{batch}_MBU": stepn * bn / batch / bandwidth}
        if ppl_ids is not None:
            row["perplexity"] = perplexity(model, ppl_ids).ppl
        rows.append(row)
        print_quant_row(row, batch)
        del model
    rows += _kv_rows(model_name, dev, kv_schemes, ppl_ids, batch)
    if model_name is None or str(model_name).endswith(".gguf"):
        gguf = default_model_path() if model_name is None else model_name
        peer = _llama_cpp_row(gguf, prompts[0], n_tokens, repeats)
        if peer is not None:
            rows.append(peer)
            print_quant_row(peer, batch)
    base = next((r for r in rows if r["scheme"] == "fp32"), None)
    for r in rows:
        if base is not None:
            if "decode_b1_tok_s" in r:  # the KV rows measure bytes and perplexity only
                r["b1_speedup_vs_fp32"] = r["decode_b1_tok_s"] / base["decode_b1_tok_s"]
            if "perplexity" in r and "perplexity" in base:
                r["ppl_vs_fp32"] = r["perplexity"] / base["perplexity"] - 1
    result = {"benchmark": "quant", "model": model_name or "default (SmolLM2-135M-Instruct Q4_1)",
              "device": str(dev), "read_bandwidth_gb_s": bandwidth / 1e9, "n_tokens": n_tokens,
              "prompt_len": prompt_len, "prefill_len": prefill_len, "batch": batch, "repeats": repeats,
              "ppl_tokens": ppl_tokens, "rows": rows}
    if save:
        print(f"saved {save_results('quant-' + dev.type, result)}")
    return result


def _kv_rows(model_name, dev: torch.device, kv_schemes, ppl_ids, batch: int) -> list[dict]:
    """One row per quantized KV-cache dtype on the fp32 model: K+V bytes per token (codes + per-(token, head)
    scales, ``kv.quant.kv_bytes_per_token``) and perplexity scored through that cache."""
    from minillm.kv.quant import kv_bytes_per_token
    from minillm.perf.perplexity import perplexity

    if not kv_schemes:
        return []
    model = _load("fp32", model_name, dev)
    cfg, rows = model.config, []
    for kv in kv_schemes:
        row = {"scheme": f"fp32 kv-{kv}", "dtype": "float32",
               "kv_bytes_per_token": kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv)}
        if ppl_ids is not None:
            row["perplexity"] = perplexity(model, ppl_ids, kv_cache_dtype=kv).ppl
        rows.append(row)
        print_quant_row(row, batch)
    return rows


def print_quant_row(r: dict, batch: int) -> None:
    """One scheme's line (fields a peer lacks print as '-')."""
    def f(key, fmt):
        return format(r[key], fmt) if key in r else "-"

    print(f"{r['scheme']:<15} {f('weight_MB', '.1f'):>9} MB  kv {f('kv_bytes_per_token', '.0f'):>6} B/tok  "
          f"b1 {f('decode_b1_tok_s', '.1f'):>6} tok/s ({f('b1_GB_s', '.1f')} GB/s, MBU {f('b1_MBU', '.0%')})  "
          f"b{batch} {f(f'decode_b{batch}_tok_s', '.1f'):>6} tok/s  prefill {f('prefill_tok_s', '.0f'):>5} tok/s  "
          f"ppl {f('perplexity', '.3f')}", flush=True)


if __name__ == "__main__":
    for m in (1, 4, 8):
        print_table(bench_quant_gemv(rows=m))
