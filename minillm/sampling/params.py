"""SamplingParams: how one request is decoded, with vLLM's meanings.  Invalid values raise ``ValueError``."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass

from minillm.sampling.guided import GuidedDecodingParams

# Below this temperature sampling is greedy: logits / 1e-45 overflow fp32 to inf (softmax -> nan), and any
# temperature this small already puts all the mass on the argmax.  The same floor as vLLM's _SAMPLING_EPS.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. Invalid values raise ``ValueError`` naming the parameter and its range.

    Each field is documented by the string under it (also the help of the command line's sampling flags).
    Numbers may be any ``numbers.Integral`` / ``numbers.Real`` (numpy scalars included) and are stored as Python
    ``int`` / ``float``.  ``temperature`` below ``MIN_TEMPERATURE`` (1e-5) is greedy.  ``stop``: None (no stop
    strings), one string, or any iterable of strings (a generator is read once, here).  With ``n > 1`` and a
    ``seed``, sample i draws from ``sample_seed(seed, i)`` (sample 0 from ``seed`` itself).
    """

    max_tokens: int = 16
    """The most tokens to generate; the answer ends earlier at the end-of-sequence token or a stop string."""
    temperature: float = 1.0
    """Divides the logits before sampling: below 1 sharper, above 1 flatter; 0 = greedy (the argmax)."""
    top_k: int = 0
    """Sample among the k most likely tokens only; 0 or -1 disables it."""
    top_p: float = 1.0
    """Nucleus sampling: among the most likely tokens whose probabilities sum to p; 1 disables it."""
    seed: int | None = None
    """Seeds this request's sampling, so the same request draws the same tokens (None: unseeded)."""
    stop: tuple[str, ...] = ()
    """Stop strings: the output ends before the first one generated."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token, to exactly ``max_tokens`` tokens."""
    n: int = 1
    """Samples drawn for the prompt."""
    guided_decoding: GuidedDecodingParams | None = None
    """Structured output: the tokens are constrained to a JSON schema, regex, choice or grammar (needs xgrammar)."""

    def __post_init__(self):
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, Iterable) and not isinstance(stop, (bytes, bytearray)):
            stop = tuple(stop)  # materialised once: a generator must not be consumed by the checks below
        object.__setattr__(self, "stop", stop)
        for name in ("max_tokens", "top_k", "n", "seed"):  # numpy ints -> int (after the type check below)
            v = getattr(self, name)
            if _is_int(v):
                object.__setattr__(self, name, int(v))
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if _is_real(v):
                object.__setattr__(self, name, float(v))
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or 0 / -1 to disable it, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be None or an integer in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
            raise ValueError(f"guided_decoding must be a GuidedDecodingParams(json=... | regex=... | choice=[...] | "
                             f"grammar=... | json_object=True), got {self.guided_decoding!r}")

    @property
    def greedy(self) -> bool:
        """Temperature 0 — or below ``MIN_TEMPERATURE``, where sampling is the argmax anyway."""
        return self.temperature < MIN_TEMPERATURE


def finish_reason(params: SamplingParams, token: int, num_output: int, length: int, eos_token_ids,
                  max_len: int) -> str | None:
    """The stop rule every generation loop applies after appending ``token`` (the ``num_output``-th output token;
    ``length``: prompt + output): "stop" for an EOS (unless ``ignore_eos``), "length" at ``max_tokens`` or the
    context end ``max_len``, else None.  Stop strings are the detokenizer's (they need text)."""
    if token in eos_token_ids and not params.ignore_eos:
        return "stop"
    if num_output >= params.max_tokens or length >= max_len:
        return "length"
    return None


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)
