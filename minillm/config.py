"""Model configuration: a frozen, validated view of a Hugging Face ``config.json``.

Only what the forward pass needs is kept, under the course's fixed names (H_q, H_kv, D, V).
Both the old (``rope_theta`` + ``rope_scaling``) and the new transformers-5 (``rope_parameters``)
spellings of the RoPE settings are understood.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minillm.kv.eviction import KV_EVICTIONS, H2OPolicy, KVEvictionPolicy

# model_type -> what differs from plain Llama. Everything else (RMSNorm, RoPE, SwiGLU, GQA) is shared.
SUPPORTED_ARCHITECTURES = {
    "llama": "Llama 2/3 and SmolLM2",
    "mistral": "Mistral (with its sliding window)",
    "qwen2": "Qwen2 (bias on q/k/v)",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` is one of ``SUPPORTED_ROPE_TYPES``."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self):
        if self.kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope scaling type {self.kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    D = ``head_dim``; the attention width H_q·D need not equal ``hidden_size`` (it does for Llama).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # H_q
    num_kv_heads: int  # H_kv; H_q % H_kv == 0 (MHA: equal, MQA: 1)
    head_dim: int  # D
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    sliding_window: int | None = None  # each token attends to itself and the W - 1 before it (Mistral)
    # which layers use ``sliding_window`` (local) and which attend to everything (global), as Qwen2's
    # ``layer_types``; None: every layer (Mistral).  With a global layer no block is ever freed (its queries read
    # every key): each layer masks by its own window, for correctness only.
    sliding_layers: tuple[bool, ...] | None = None
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) "
                "so that each K/V head serves a whole group of query heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(_unsupported(self.model_type))
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be None or a positive int, got {self.sliding_window!r}")
        if self.sliding_layers is not None and (self.sliding_window is None
                                                or len(self.sliding_layers) != self.num_layers):
            raise ValueError(f"sliding_layers must be None or one bool per layer ({self.num_layers}) with a "
                             f"sliding_window, got {self.sliding_layers!r} with sliding_window={self.sliding_window}")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window layer ``layer`` masks by, None for a layer that attends to every earlier key."""
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    @property
    def evicts_by_window(self) -> bool:
        """Every layer is windowed: blocks wholly outside the window can be freed (a global layer still reads
        them otherwise)."""
        return self.sliding_window is not None and self.sliding_layers is None

    @property
    def group_size(self) -> int:
        """Query heads per K/V head (H_q / H_kv)."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Parameter count from the shapes alone (tied embeddings counted once)."""
        h, f = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + 3 * h * f + 2 * h
        n = self.num_layers * per_layer + h  # + final norm
        if include_embeddings:
            n += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return n

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Build from a ``config.json`` dict or a transformers ``PretrainedConfig``."""
        d = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(_unsupported(model_type))
        n_heads = d["num_attention_heads"]
        theta, scaling = _rope_settings(d)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=n_heads,
            num_kv_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_sliding_settings(model_type, d, d["num_hidden_layers"]),
        )


def _sliding_settings(model_type: str, d: dict, num_layers: int) -> dict:
    """``sliding_window`` and ``sliding_layers`` from a config dict: Mistral's window covers every layer; Qwen2's
    (``use_sliding_window``) covers the layers its ``layer_types`` name "sliding_attention" (transformers fills
    them from ``max_window_layers``: the layers from that index on), the others attend globally."""
    if model_type == "mistral":
        return {"sliding_window": d.get("sliding_window")}
    if model_type != "qwen2" or not d.get("use_sliding_window") or d.get("sliding_window") is None:
        return {}
    types = d.get("layer_types") or ["sliding_attention" if i >= d.get("max_window_layers", 0) else "full_attention"
                                     for i in range(num_layers)]
    local = tuple(t == "sliding_attention" for t in types)
    if not any(local):
        return {}
    return {"sliding_window": d["sliding_window"], "sliding_layers": None if all(local) else local}


def _unsupported(model_type) -> str:
    names = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
    return f"unsupported architecture model_type={model_type!r}; minillm supports: {names}"


def _rope_settings(d: dict) -> tuple[float, RopeScaling]:
    params = d.get("rope_parameters") or {}
    legacy = d.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    src = params if params.get("rope_type", "default") != "default" or not legacy else legacy
    kind = src.get("rope_type", src.get("type", "default"))
    if kind == "default":
        return theta, RopeScaling()
    return theta, RopeScaling(
        kind=kind,
        factor=float(src.get("factor", 1.0)),
        low_freq_factor=float(src.get("low_freq_factor", 1.0)),
        high_freq_factor=float(src.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(src.get("original_max_position_embeddings", 8192)),
    )


POLICIES = ("continuous", "dynamic", "static")
PREEMPTION_MODES = ("recompute", "swap")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # vLLM's names; "auto": the model's dtype (kv/quant.py stores the others)
DEFAULT_KV_CACHE_BYTES = 256 * 2**20  # when neither num_kv_blocks nor kv_cache_bytes is given: fits a laptop


@dataclass(frozen=True)
class EngineConfig:
    """How ``LLMEngine`` batches and stores K/V.  Defaults suit a CPU; on a GPU raise the limits (the KV budget
    follows ``gpu_memory_utilization`` there).

    Each field is documented by the string under it; ``entrypoints/arg_utils.py`` reads those strings as the help
    of the command line's flags (``--max-num-seqs`` for ``max_num_seqs``).  The kernels are the model's choice
    (``load_model(kernels=...)``, ``Transformer.set_kernels``), not the engine's.
    """

    policy: str = "continuous"
    """How requests form batches: "continuous" admits and retires requests every step; "static" forms a batch of up
    to ``max_num_seqs`` from whatever is waiting and runs it to completion (everyone waits for the longest);
    "dynamic" does the same but waits until the batch is full or ``dynamic_window_s`` has passed since the oldest
    waiting request arrived."""
    block_size: int = 16
    """Tokens per KV block (16, as vLLM)."""
    num_kv_blocks: int | None = None
    """KV budget in blocks.  With neither this nor ``kv_cache_bytes``: on a CUDA engine of one process, what
    ``gpu_memory_utilization`` leaves; elsewhere enough for ``max_num_seqs`` full-context sequences capped at
    ``DEFAULT_KV_CACHE_BYTES``; never less than one full-context sequence."""
    kv_cache_bytes: int | None = None
    """KV budget in bytes (K and V of all layers); give this or ``num_kv_blocks``, not both."""
    gpu_memory_utilization: float = 0.9
    """(vLLM's name) The fraction of the CUDA device's total memory this engine may use — weights, activations and
    KV pool together.  With neither ``num_kv_blocks`` nor ``kv_cache_bytes``, a CUDA engine of one process gives
    the KV pool what is left of this share after the loaded weights and a profiled forward of
    ``max_num_batched_tokens`` tokens (``kv.memory.size_kv_pool``).  Memory others hold on the device counts
    against this share: for two engines on one device give the first 0.4 and the second 0.9 (its share covers the
    first's).  Ignored on CPU, with an explicit KV budget and across tensor/pipeline-parallel processes."""
    max_num_seqs: int = 32
    """Sequences that run at once."""
    max_num_batched_tokens: int = 512
    """Tokens per step: decode tokens + prefill chunks."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of a prompt's leading full blocks when an earlier request computed the same tokens."""
    chunked_prefill: bool = True
    """Split a prompt's prefill over steps to fit ``max_num_batched_tokens``; False never splits a prompt, so every
    prompt must fit the token budget."""
    preemption: str = "recompute"
    """What happens to the newest running sequence when blocks run out: "recompute" frees its blocks and prefills
    it again later, "swap" copies its blocks to ``num_host_blocks`` host blocks and back."""
    num_host_blocks: int | None = None
    """Host blocks that swapped-out sequences use (default: as many as on the device with "swap", else none)."""
    dynamic_window_s: float = 0.1
    """("dynamic" policy) seconds the oldest waiting request may wait for a batch to fill."""
    pad_batches: bool = True
    """(static and dynamic only) a batch keeps its shape until its last member finishes, as in transformers'
    batched ``generate`` or FasterTransformer — a finished member's row is still computed each step, on a pad token,
    and thrown away (the bubble costs compute, not only idle slots).  False drops finished rows, a batch that
    shrinks: cheaper where a step's cost grows with its rows (a compute-bound CPU), the same on a memory-bound
    GPU."""
    max_model_len: int | None = None
    """Cap on prompt + output tokens (default: the model's context)."""
    return_logits: bool = False
    """Each step update carries the fp32 logits its token was sampled from (tests, notebooks)."""
    enforce_eager: bool | None = None
    """(vLLM's name) True runs every step eagerly; False runs decode-only steps through static buffers in batch
    buckets (``engine.cuda_graph``: CUDA graphs on a GPU, the same padded path uncaptured on CPU); None (default):
    CUDA graphs on CUDA, eager on CPU unless the kernels are "compiled"."""
    kv_cache_dtype: str = "auto"
    """How K/V are stored — "auto" (the model's dtype), "int8" (symmetric, one fp32 scale per token and KV head)
    or "fp8" (e4m3 with the same scales; ``kv/quant.py``).  1 byte per element + 4 per (token, head): for D = 64 a
    block holds ~1.9× the tokens of bf16 and ~3.8× fp32 in the same bytes."""
    kv_eviction: str | None = None
    """Free the KV blocks no later query reads, so a sequence holds constant KV memory however long it runs:
    "sink" keeps the first ``sink_tokens`` tokens (StreamingLLM's attention sinks) and the last ``window_tokens``
    (``kv/eviction.py``; keys keep their original positions); "h2o" keeps those and ``heavy_tokens`` more, the
    blocks with the most accumulated attention mass (H2O's heavy hitters; scored on the reference attention, and
    prefix caching is off).  None keeps every token (a sliding-window model still frees what falls out of its
    window)."""
    sink_tokens: int = 4
    """(kv_eviction="sink"/"h2o") leading tokens every query keeps seeing; fewer than ``window_tokens``."""
    window_tokens: int | None = None
    """(kv_eviction="sink"/"h2o", required) recent tokens each query sees, itself included."""
    heavy_tokens: int | None = None
    """(kv_eviction="h2o", required) heavy-hitter tokens kept beside the sinks and the window, in whole blocks
    (rounded up): the ones earlier queries attended to most."""
    speculative_config: SpeculativeConfig | dict | None = None
    """Speculative decoding: a ``SpeculativeConfig``, or a dict of its fields (vLLM's shape, e.g.
    ``{"method": "ngram", "num_speculative_tokens": 4}``) that becomes one; None: off."""
    parallel_config: ParallelConfig | dict | None = None
    """How many processes the engine spans (``ParallelConfig``: tensor / pipeline parallel); a dict of its fields
    becomes one; None: this process alone."""

    def __post_init__(self):
        parallel = self.parallel_config
        if parallel is None or isinstance(parallel, dict):
            object.__setattr__(self, "parallel_config", ParallelConfig(**(parallel or {})))
        if not isinstance(self.parallel_config, ParallelConfig):
            raise ValueError("EngineConfig.parallel_config must be None, a dict or a ParallelConfig, got "
                             f"{type(self.parallel_config).__name__}")
        if isinstance(self.speculative_config, dict):
            object.__setattr__(self, "speculative_config", SpeculativeConfig(**self.speculative_config))
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            raise ValueError("EngineConfig.speculative_config must be None, a dict or a SpeculativeConfig, got "
                             f"{type(self.speculative_config).__name__}")
        if self.policy not in POLICIES:
            raise ValueError(f"EngineConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"EngineConfig.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"EngineConfig.preemption must be one of {PREEMPTION_MODES}, got {self.preemption!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not _positive_int(value):
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        for name in ("num_kv_blocks", "kv_cache_bytes", "max_model_len"):
            value = getattr(self, name)
            if value is not None and not _positive_int(value):
                raise ValueError(f"EngineConfig.{name} must be None or a positive int, got {value!r}")
        if self.num_kv_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("give EngineConfig either num_kv_blocks or kv_cache_bytes, not both")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        if self.num_host_blocks is not None and (not isinstance(self.num_host_blocks, int) or self.num_host_blocks < 0):
            raise ValueError(f"EngineConfig.num_host_blocks must be None or an int >= 0, got {self.num_host_blocks!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}) so every running sequence can decode each step; raise it or "
                             "lower max_num_seqs")
        if not isinstance(self.dynamic_window_s, (int, float)) or not self.dynamic_window_s >= 0:
            raise ValueError(f"EngineConfig.dynamic_window_s must be a number >= 0, got {self.dynamic_window_s!r}")
        for name in ("enable_prefix_caching", "chunked_prefill", "pad_batches", "return_logits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ValueError(f"EngineConfig.enforce_eager must be None, True or False, got {self.enforce_eager!r}")
        self._check_eviction()

    def _check_eviction(self) -> None:
        if self.kv_eviction != "h2o" and self.heavy_tokens is not None:
            raise ValueError(f"EngineConfig.heavy_tokens={self.heavy_tokens} is H2O's budget: pass "
                             'kv_eviction="h2o" with it, or drop heavy_tokens')
        if self.kv_eviction is None:
            return
        if self.kv_eviction not in KV_EVICTIONS:
            raise ValueError(f"EngineConfig.kv_eviction must be None or one of {KV_EVICTIONS}, got "
                             f"{self.kv_eviction!r}")
        if self.window_tokens is None:
            raise ValueError(f'EngineConfig(kv_eviction="{self.kv_eviction}") needs window_tokens, the recent '
                             "tokens kept (e.g. window_tokens=1024)")
        if self.kv_eviction == "h2o" and self.heavy_tokens is None:
            raise ValueError('EngineConfig(kv_eviction="h2o") needs heavy_tokens, the heavy-hitter tokens kept '
                             "beside the window and sinks (e.g. heavy_tokens=window_tokens)")
        if self.kv_eviction == "h2o":  # ValueError naming the fix for bad budgets
            H2OPolicy(self.window_tokens, self.sink_tokens, self.heavy_tokens)
        else:
            KVEvictionPolicy(self.window_tokens, self.sink_tokens)
        if self.enforce_eager is False:
            raise ValueError("enforce_eager=False (static decode buffers / CUDA graphs) cannot run kv_eviction: "
                             "its buffers hold whole block tables without the window; pass enforce_eager=None")
        spec = self.speculative_config
        if spec is not None and spec.method != "ngram":
            raise ValueError(f"kv_eviction works with speculative_config method 'ngram' only, got {spec.method!r}: "
                             "the other proposers run a model over their own KV cache that keeps every token, so "
                             "memory would not stay bounded; use method='ngram' or drop one of them")
        if spec is not None and self.kv_eviction == "h2o":
            raise ValueError('kv_eviction="h2o" cannot run with a speculative_config: the queries of rejected draft '
                             "tokens would add to the attention mass H2O evicts by; drop speculative_config or use "
                             'kv_eviction="sink"')

    def resolve_num_blocks(self, bytes_per_block: int, max_model_len: int) -> int:
        """Device KV blocks: ``num_kv_blocks``, or the byte budget divided by ``bytes_per_block`` (K and V, all
        layers, one block), by default enough for ``max_num_seqs`` sequences of ``max_model_len`` tokens capped at
        ``DEFAULT_KV_CACHE_BYTES`` — but always at least one sequence of ``max_model_len`` tokens."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        if self.kv_cache_bytes is not None:
            budget = self.kv_cache_bytes
        else:
            one = -(-max_model_len // self.block_size) * bytes_per_block  # one full-context sequence
            # max_num_seqs full sequences, capped at DEFAULT_KV_CACHE_BYTES but never below one full context: the
            # longest request the model accepts always fits (SmolLM2-135M fp32: 8192 tokens = 360 MiB)
            budget = min(self.max_num_seqs * one, max(DEFAULT_KV_CACHE_BYTES, one))
        blocks = budget // bytes_per_block
        if blocks < 1:
            raise ValueError(f"kv_cache_bytes={budget} holds no KV block (one is {bytes_per_block} bytes); raise it")
        return blocks

    def resolve_host_blocks(self, num_device_blocks: int) -> int:
        """Host blocks for swapping: ``num_host_blocks``, else as many as the device when preempting by swap."""
        if self.num_host_blocks is not None:
            return self.num_host_blocks
        return num_device_blocks if self.preemption == "swap" else 0


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes one engine spans (vLLM's names).  The engine schedules, samples and detokenizes in this
    process either way; the others only run their part of each step's forward.  Both sizes above 1 at once is not
    supported.
    """

    tensor_parallel_size: int = 1
    """Every layer split over this many ranks (heads, MLP units, vocabulary rows); the size must divide the model's
    heads (checked against the model by ``layers.parallel.check_shardable``)."""
    pipeline_parallel_size: int = 1
    """The layers cut into this many consecutive stages, one per rank; the size must divide the model's layers
    (``distributed.pipeline.stage_layers``)."""

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size cannot both be > 1 (yet): pick one")

    @property
    def world_size(self) -> int:
        """Processes the engine spans (1: this one alone)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


SPECULATIVE_METHODS = ("ngram", "early_exit", "draft", "quantized")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's shape: ``{"method": ..., "num_speculative_tokens": γ, ...}``.

    - ``method``: "ngram" (prompt lookup: the tokens that followed the last matching n-gram of the context),
      "early_exit" (the target's first ``num_layers`` layers + final norm + LM head), "draft" (a separate ``model``
      with the target's vocabulary; giving ``model`` alone implies it), "quantized" (the target's int4 copy).
    - ``num_speculative_tokens`` γ >= 1 tokens proposed per step; one target forward verifies all of them.
    - ``prompt_lookup_min`` / ``prompt_lookup_max`` (ngram): n-gram lengths tried, longest first.
    - ``num_layers`` (early_exit): how many leading layers draft; checked against the target in ``validate_for``.
    - ``model`` (draft): a hub id, directory, ``.gguf`` or an already loaded ``Transformer``.
    """

    method: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    num_layers: int | None = None
    model: Any = None

    def __post_init__(self):
        method = self.method if self.method is not None else ("draft" if self.model is not None else None)
        object.__setattr__(self, "method", method)
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {SPECULATIVE_METHODS} (or give a draft "
                             f"'model'), got {method!r}")
        if not _positive_int(self.num_speculative_tokens):
            raise ValueError("speculative_config num_speculative_tokens must be an int >= 1 (the γ tokens proposed "
                             f"per step), got {self.num_speculative_tokens!r}")
        if not (_positive_int(self.prompt_lookup_min) and _positive_int(self.prompt_lookup_max)
                and self.prompt_lookup_min <= self.prompt_lookup_max):
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min!r} and {self.prompt_lookup_max!r}")
        if method == "early_exit" and not _positive_int(self.num_layers):
            raise ValueError("speculative_config method 'early_exit' needs num_layers, an int >= 1 (how many of the "
                             f"target's layers draft), got {self.num_layers!r}")
        if method == "draft" and self.model is None:
            raise ValueError("speculative_config method 'draft' needs a draft 'model' (hub id, path or Transformer)")

    def validate_for(self, target: ModelConfig, draft: ModelConfig | None = None) -> None:
        """Checks that need the target (and draft) model: early-exit layers in range, equal vocabularies."""
        if self.method == "early_exit" and not 1 <= self.num_layers < target.num_layers:
            raise ValueError(f"speculative_config num_layers={self.num_layers} is out of range: early exit drafts "
                             f"with 1 .. {target.num_layers - 1} of the target's {target.num_layers} layers")
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.vocab_size} tokens) differs from the target's "
                             f"({target.vocab_size}): pick a draft from the same model family (same tokenizer)")
