"""Model configuration: a frozen, validated view of a Hugging Face ``config.json``.

Only what the forward pass needs is kept, under the course's fixed names (H_q, H_kv, D, V).
Both the old (``rope_theta`` + ``rope_scaling``) and the new transformers-5 (``rope_parameters``)
spellings of the RoPE settings are understood.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    def from_hf(cls, hf_config: Any) -> "ModelConfig":
        """Build from a ``config.json`` dict or a transformers ``PretrainedConfig``."""
        d = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(_unsupported(model_type))
        if model_type == "qwen2" and d.get("use_sliding_window"):
            raise ValueError("Qwen2 with use_sliding_window=True is not supported yet; only full attention is")
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
            sliding_window=d.get("sliding_window") if model_type == "mistral" else None,
        )


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
