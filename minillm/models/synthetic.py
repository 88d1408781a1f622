"""Checkpoints with published models' shapes and seeded random weights, made here instead of downloaded.

``python -m minillm make-model --shape llama-3.2-1b --out DIR --gguf q4_1,q8_0`` writes, for one shape of
``models.configs.SHAPES`` (layers, hidden, heads, K/V heads, intermediate, RoPE θ, tied or untied head as the real
model has them):

- a Hugging Face directory: ``config.json``, safetensors shards of at most ``SHARD_BYTES`` (with
  ``model.safetensors.index.json`` when there are several) and the default model's tokenizer files;
- one GGUF per asked format (``SHAPE-Q4_1.gguf`` ...) through the ``gguf`` package's writer and quantizers, with
  llama.cpp's metadata keys for the ``llama`` architecture, its Q/K row order, and the default model's tokenizer
  embedded as llama.cpp reads it (``tokenizer.ggml.*`` copied from the default GGUF); ``q4_k_m`` (K-quants, which
  the gguf package does not quantize) by llama.cpp's own quantizer from the f16 file, written for it.

Every engine (transformers, llama.cpp, vLLM, minillm) therefore loads the same weights and tokenizes identically.
Two departures from the real models: the vocabulary is the default model's (SmolLM2's 49152 tokens), unless
``vocab="shape"`` (``--vocab shape``) asks for the shape's own count — Llama-3's 128256, whose embedding and LM head
are a fifth of a 1B model's weights — and then the default tokenizer gains reserved special tokens
(``<|reserved_special_token_N|>``, as Llama-3 reserves its last 256) up to that count, in the HF tokenizer and the
GGUFs alike; and RoPE is unscaled (llama3 scaling needs a ``rope_freqs`` tensor in a GGUF; it changes frequencies,
not cost, and the benchmarks stay far below 8192 tokens).

Weights: normal(0, 0.02) — transformers' ``initializer_range`` — for every linear and the embedding, RMSNorm weights
1.  Each sub-layer then adds a small update to the residual stream, so activations stay finite through every
layer; the logits are near-uniform.  Random weights decide nothing about speed except speculative acceptance.

Memory: tensor by tensor.  Each tensor is drawn from its own seeded generator (the same values whatever file it
goes into), written into the current shard and quantized into every GGUF at once; only one shard (≤ SHARD_BYTES)
is held, never the model (an 8B shape is 16 GB in bf16, 32 GB in fp32).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from minillm.config import ModelConfig, RopeScaling
from minillm.dtypes import MODEL_DTYPES
from minillm.models.configs import hf_config_dict, shape_config

GGUF_FORMATS = ("q4_1", "q4_0", "q8_0", "f16")  # written here, through the gguf package's quantizers
# written by llama.cpp's own quantizer from the f16 file (llama-cpp-python, the bench extra): format -> llama_ftype.
# Q4_K_M is what most downloaded GGUFs are: Q4_K, with Q6_K for the embedding/LM head and some attn_v/ffn_down.
LLAMA_QUANTIZED = {"q4_k_m": 15}
HF_DTYPES = ("float32", "bfloat16")
# the vocabulary's size: the default tokenizer's own (49152), or the shape's (reserved special tokens added up to it)
VOCABS = ("default", "shape")
GGUF_CONTROL = 3  # tokenizer.ggml.token_type of a control (special) token, llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
INIT_STD = 0.02  # transformers' LlamaConfig.initializer_range
SHARD_BYTES = 2 << 30  # safetensors shard size (as save_pretrained's max_shard_size)
# llama.cpp's tensor names in a decoder layer, in its converter's order
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down")


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the checkpoint: its llama.cpp and Hugging Face names and its shape ([N, K] or [hidden])."""

    gguf: str
    hf: str
    shape: tuple[int, ...]


def synthetic_config(shape: str, vocab: str = "default") -> ModelConfig:
    """``shape``'s config as ``make_model`` writes it: the default model's token ids, plain RoPE, and the default
    vocabulary's size (``vocab="default"``) or the shape's own (``"shape"``; never fewer than the default's)."""
    from minillm.models.loader import load_config, resolve

    if vocab not in VOCABS:
        raise ValueError(f"vocab must be one of {', '.join(VOCABS)}, got {vocab!r}")
    default, own = load_config(resolve(None, weights=False)), shape_config(shape)
    size = default.vocab_size if vocab == "default" else max(own.vocab_size, default.vocab_size)
    return replace(own, vocab_size=size, rope_scaling=RopeScaling(),
                   bos_token_id=default.bos_token_id, eos_token_ids=default.eos_token_ids)


def reserved_tokens(start: int, stop: int) -> list[str]:
    """The names of the special tokens that pad the default tokenizer from id ``start`` up to ``stop``."""
    return [f"<|reserved_special_token_{i}|>" for i in range(stop - start)]


def tensor_plan(config: ModelConfig) -> list[TensorPlan]:
    """Every tensor, in file order: embedding, each layer's nine, final norm, the LM head when it is untied."""
    from minillm.quant.gguf import hf_name

    c = config
    shapes = {"attn_norm": (c.hidden_size,), "ffn_norm": (c.hidden_size,), "attn_q": (c.q_size, c.hidden_size),
              "attn_k": (c.kv_size, c.hidden_size), "attn_v": (c.kv_size, c.hidden_size),
              "attn_output": (c.hidden_size, c.q_size), "ffn_gate": (c.intermediate_size, c.hidden_size),
              "ffn_up": (c.intermediate_size, c.hidden_size), "ffn_down": (c.hidden_size, c.intermediate_size)}
    names = [("token_embd", (c.vocab_size, c.hidden_size))]
    names += [(f"blk.{i}.{t}", shapes[t]) for i in range(c.num_layers) for t in LAYER_TENSORS]
    names += [("output_norm", (c.hidden_size,))] + ([] if c.tie_word_embeddings else
                                                    [("output", (c.vocab_size, c.hidden_size))])
    return [TensorPlan(f"{n}.weight", hf_name(f"{n}.weight"), s) for n, s in names]


def gguf_type(plan: TensorPlan, fmt: str):
    """The GGML type ``plan``'s tensor is stored in for ``fmt`` (one of ``GGUF_FORMATS``): norms F32; with f16 and
    q8_0 every matrix in that type; with q4_0/q4_1 the decoder linears in 4 bits and the embedding and LM head in
    Q8_0 (as the default model's Q4_1 GGUF keeps its head; llama.cpp's own Q4 mixes use Q6_K there, which minillm's
    GGUF reader does not take)."""
    from gguf import GGMLQuantizationType as T

    if len(plan.shape) == 1:
        return T.F32
    if fmt in ("q4_0", "q4_1") and plan.gguf.split(".")[0] in ("token_embd", "output"):
        return T.Q8_0
    types = {"f16": T.F16, "q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1}
    if fmt not in types:  # q4_k_m's types are llama.cpp's choice, per tensor: read them from the file
        raise ValueError(f"{fmt!r} is not written here through gguf's quantizers ({', '.join(types)} are); "
                         "a llama.cpp-quantized file's types and bytes are in the file (GGUFReader)")
    return types[fmt]


def gguf_nbytes(plan: TensorPlan, fmt: str) -> int:
    """Bytes ``plan``'s tensor takes in a ``fmt`` GGUF (blocks of 32: Q8_0 34 B, Q4_1 20 B, Q4_0 18 B)."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[gguf_type(plan, fmt)]
    return int(np.prod(plan.shape)) // block * size


def random_weight(plan: TensorPlan, seed: int, dtype: torch.dtype) -> Tensor:
    """``plan``'s tensor: ones for a norm, else normal(0, ``INIT_STD``) from a generator seeded by (``seed``, the
    tensor's name) — the same values in every file and in any order — rounded to ``dtype``."""
    if len(plan.shape) == 1:
        return torch.ones(plan.shape, dtype=dtype)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(plan.hf.encode()))
    return (torch.randn(plan.shape, generator=g) * INIT_STD).to(dtype)


def gguf_rows(plan: TensorPlan, w: Tensor, config: ModelConfig) -> np.ndarray:
    """``w`` as fp32 rows in llama.cpp's order: q_proj and k_proj rows permuted per head as its converter does
    (the inverse of ``quant.gguf.unpermute_index``, which minillm and transformers apply when they read it)."""
    from minillm.quant.gguf import unpermute_index

    x = w.float()
    short = plan.gguf.split(".")[-2]
    if short in ("attn_q", "attn_k"):
        heads = config.num_heads if short == "attn_q" else config.num_kv_heads
        x = x[torch.argsort(unpermute_index(x.shape[0], heads))]
    return x.contiguous().numpy()


@cache  # reading the 49k tokens and 49k merges takes seconds: once per process
def default_tokenizer_fields() -> tuple[tuple, ...]:
    """The default GGUF's ``tokenizer.*`` metadata as (key, value, type, array element type or None): the
    tokenizer as llama.cpp reads it (model "gpt2", pre-tokenizer, tokens, types, merges, special ids, chat
    template)."""
    from gguf import GGUFReader, GGUFValueType

    from minillm.models.loader import default_model_path

    fields = GGUFReader(default_model_path()).fields.items()
    return tuple((key, f.contents(), f.types[0], f.types[1] if f.types[0] == GGUFValueType.ARRAY else None)
                 for key, f in fields if key.startswith("tokenizer."))


def _gguf_writer(path: Path, config: ModelConfig, fmt: str, plans: list[TensorPlan], name: str):
    """A ``GGUFWriter`` with the metadata and every tensor's info written, ready for the tensors' data in order."""
    from gguf import GGUF_DEFAULT_ALIGNMENT, GGUFWriter, LlamaFileType
    from gguf.quants import quant_shape_to_byte_shape

    c = config
    w = GGUFWriter(path, "llama")
    w.add_name(name)
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type({"f16": LlamaFileType.MOSTLY_F16, "q8_0": LlamaFileType.MOSTLY_Q8_0,
                     "q4_0": LlamaFileType.MOSTLY_Q4_0, "q4_1": LlamaFileType.MOSTLY_Q4_1}[fmt])
    w.add_quantization_version(2)  # GGML_QNT_VERSION
    for key, value, vtype, sub in default_tokenizer_fields():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type") and c.vocab_size > len(value):
            pad = reserved_tokens(len(value), c.vocab_size)  # control tokens: never produced by tokenizing text
            value = list(value) + (pad if key == "tokenizer.ggml.tokens" else [GGUF_CONTROL] * len(pad))
        w.add_key_value(key, value, vtype, sub_type=sub)
    for p in plans:
        kind = gguf_type(p, fmt)
        if kind.name in ("F32", "F16"):
            dt = np.float32 if kind.name == "F32" else np.float16
            w.add_tensor_info(p.gguf, p.shape, np.dtype(dt), int(np.prod(p.shape)) * np.dtype(dt).itemsize)
        else:
            byte_shape = quant_shape_to_byte_shape(p.shape, kind)
            w.add_tensor_info(p.gguf, byte_shape, np.dtype(np.uint8), gguf_nbytes(p, fmt), raw_dtype=kind)
    assert w.data_alignment == GGUF_DEFAULT_ALIGNMENT
    w.open_output_file()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    return w


def _shards(plans: list[TensorPlan], itemsize: int) -> list[list[TensorPlan]]:
    """``plans`` cut, in order, into groups of at most ``SHARD_BYTES`` (one tensor per group at least)."""
    groups: list[list[TensorPlan]] = [[]]
    size = 0
    for p in plans:
        n = int(np.prod(p.shape)) * itemsize
        if groups[-1] and size + n > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += n
    return groups


def _write_hf_files(out: Path, config: ModelConfig, dtype: str) -> None:
    """config.json (with ``architectures``, which ``transformers serve`` and vLLM need) and the default model's
    tokenizer files."""
    from minillm.models.loader import resolve

    src = resolve(None, weights=False).directory
    for f in src.iterdir():
        if f.name not in ("config.json", "complete") and ".safetensors" not in f.name:
            shutil.copyfile(f, out / f.name)
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    start = len(tokenizer["model"]["vocab"])
    if config.vocab_size > start:  # reserved special tokens up to the vocabulary's size (ids start .. size-1)
        tokenizer["added_tokens"] += [{"id": start + i, "content": name, "single_word": False, "lstrip": False,
                                       "rstrip": False, "normalized": False, "special": True}
                                      for i, name in enumerate(reserved_tokens(start, config.vocab_size))]
        (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    pad = json.loads((src / "config.json").read_text()).get("pad_token_id")
    hf = hf_config_dict(config) | {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                   "hidden_act": "silu", "torch_dtype": dtype, "pad_token_id": pad,
                                   "initializer_range": INIT_STD}
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def llama_cpp_unavailable() -> str | None:
    """Why llama.cpp (``llama-cpp-python``) cannot run here, or None — found without importing it: a build that
    faults on this CPU must not load into this process."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (the optional bench extra: pip install 'minillm[bench]')"
    return None


def llama_quantize(src: Path, dst: Path, ftype: int, threads: int = 0) -> None:
    """llama.cpp's own quantizer (``llama_model_quantize``, what ``llama-quantize`` runs) from the GGUF ``src`` to
    ``dst`` as ``ftype`` (a ``llama_ftype``: 15 is Q4_K_M), in a process of its own: a build that dies of SIGILL on
    this CPU is reported, not fatal.  RuntimeError naming the cause when it fails."""
    if (why := llama_cpp_unavailable()) is not None:
        raise RuntimeError(why)
    code = ("import ctypes, sys, llama_cpp\n"
            "p = llama_cpp.llama_model_quantize_default_params()\n"
            "p.ftype, p.nthread = int(sys.argv[3]), int(sys.argv[4])\n"
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))")
    done = subprocess.run([sys.executable, "-c", code, str(src), str(dst), str(ftype), str(threads)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        how = (f"killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0
               else f"exit status {done.returncode}")
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"llama.cpp could not quantize {src} to {dst} (ftype {ftype}): {how}"
                           + (f": {tail}" if tail else ""))


def gguf_file_name(shape: str, fmt: str) -> str:
    """``llama-3.2-1b-Q4_1.gguf`` for ("llama-3.2-1b", "q4_1"): llama.cpp's naming, the format upper-case."""
    return f"{shape}-{fmt.upper()}.gguf"


def check_formats(gguf: tuple[str, ...] | list[str], dtype: str) -> None:
    """ValueError naming a GGUF format or HF dtype that ``make_model`` does not write."""
    for fmt in gguf:
        if fmt not in GGUF_FORMATS and fmt not in LLAMA_QUANTIZED:
            raise ValueError(f"--gguf format {fmt!r} is not one of {', '.join(GGUF_FORMATS + tuple(LLAMA_QUANTIZED))}")
    if dtype not in HF_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(HF_DTYPES)}, got {dtype!r}")
    if any(f in LLAMA_QUANTIZED for f in gguf):
        if (why := llama_cpp_unavailable()) is not None:
            raise ValueError(f"--gguf {', '.join(f for f in gguf if f in LLAMA_QUANTIZED)} is written by llama.cpp's "
                             f"quantizer, but {why}")


def make_model(shape: str, out: str | Path, gguf: tuple[str, ...] | list[str] = (), dtype: str = "bfloat16",
               seed: int = 0, vocab: str = "default") -> dict:
    """Write ``shape``'s checkpoint into ``out`` (see the module docstring): the HF directory in ``dtype`` and a
    GGUF per format in ``gguf``, with the default vocabulary or the shape's (``vocab``: one of ``VOCABS``).  Returns
    ``{"shape", "out", "parameters", "vocab_size", "seconds", "files": {name: bytes}}``.  The GGUFs quantize the
    ``dtype``-rounded weights, so they encode exactly what the HF files hold."""
    check_formats(tuple(gguf), dtype)
    config = synthetic_config(shape, vocab)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    torch_dtype = MODEL_DTYPES[dtype]
    plans = tensor_plan(config)
    _write_hf_files(out, config, dtype)
    by_llama = [f for f in gguf if f in LLAMA_QUANTIZED]
    written = [f for f in gguf if f in GGUF_FORMATS] + (["f16"] if by_llama and "f16" not in gguf else [])
    writers = {fmt: _gguf_writer(out / gguf_file_name(shape, fmt), config, fmt, plans,
                                 f"minillm random {shape} {fmt}") for fmt in written}
    shards = _shards(plans, torch_dtype.itemsize)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    try:
        for group, fname in zip(shards, files, strict=True):
            _write_shard(out / fname, group, config, seed, torch_dtype, writers)
    finally:
        for w in writers.values():
            w.close()
    for fmt in by_llama:  # from the f16 file, which holds the dtype-rounded weights exactly
        llama_quantize(out / gguf_file_name(shape, "f16"), out / gguf_file_name(shape, fmt), LLAMA_QUANTIZED[fmt])
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(int(np.prod(p.shape)) * torch_dtype.itemsize for p in plans)},
                 "weight_map": {p.hf: f for group, f in zip(shards, files, strict=True) for p in group}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    report = {"shape": shape, "out": str(out), "dtype": dtype, "seed": seed, "vocab_size": config.vocab_size,
              "parameters": config.num_parameters(), "seconds": time.perf_counter() - start,
              "files": {f.name: f.stat().st_size for f in sorted(out.iterdir()) if f.is_file()}}
    return report


def _write_shard(path: Path, group: list[TensorPlan], config: ModelConfig, seed: int, dtype: torch.dtype,
                 writers: dict) -> None:
    """Draw ``group``'s tensors, save them as one safetensors file, and append each to every GGUF writer."""
    from gguf.quants import quantize
    from safetensors.torch import save_file

    shard = {}
    for p in group:
        w = random_weight(p, seed, dtype)
        shard[p.hf] = w
        if writers:
            rows = gguf_rows(p, w, config)
            for fmt, writer in writers.items():
                writer.write_tensor_data(quantize(rows, gguf_type(p, fmt)))
    save_file(shard, path, metadata={"format": "pt"})


def print_report(report: dict) -> None:
    """What was written, how big, how long it took."""
    print(f"{report['shape']}: {report['parameters'] / 1e6:,.0f}M parameters ({report['dtype']}, seed "
          f"{report['seed']}, vocabulary {report['vocab_size']}) written to {report['out']} in "
          f"{report['seconds']:.1f} s")
    for name, size in report["files"].items():
        print(f"  {name:<40} {size / 1e6:>10.1f} MB")
