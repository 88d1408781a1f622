"""SamplingParams: how one request is decoded, with vLLM's meanings.  Invalid values raise ``ValueError``."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from minillm.sampling.guided import GuidedDecodingParams

# Below this temperature sampling is greedy: logits / 1e-45 overflow fp32 to inf (softmax -> nan), and any
# temperature this small already puts all the mass on the argmax.  The same floor as vLLM's _SAMPLING_EPS.
MIN_TEMPERATURE = 1e-5

# Stop strings are checked on the engine thread every token, so one request's list is bounded: OpenAI allows 4
# strings; vLLM's TGIS-compatible front end 6 of at most 240 characters.  Evaluation harnesses pass a handful of
# short stops ("\n\n", "Question:"), so 16 strings of 1,024 characters leave them room while keeping a request's
# stop matchers small (O(total characters) to build, once).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024


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
    logprobs: int | None = None
    """Per generated token: its logprob and the ``logprobs`` most likely tokens' (0: the sampled one only; None:
    off).  Raw: ``log_softmax`` of the model's logits, before penalties, logit_bias, temperature, top-k/p — vLLM
    V1's default (``logprobs_mode="raw_logprobs"``)."""
    prompt_logprobs: int | None = None
    """Per prompt token after the first: its raw logprob and the top ``prompt_logprobs`` (None: off).  The request
    skips prefix-cache hits (its prompt rows must be computed)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already in the output, once (-2 to 2; 0 disables it)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it occurs in the output (-2 to 2; 0 disables it)."""
    repetition_penalty: float = 1.0
    """Tokens of the prompt or the output: positive logits divided by it, negative multiplied (> 0; 1 disables)."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` × the most likely one's probability, after temperature (0 to 1)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> added to its logit before sampling (clamped to [-100, 100]; ids checked against the vocab)."""
    min_tokens: int = 0
    """EOS and ``stop_token_ids`` cannot end the output before this many tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the output (finish_reason "stop", ``stop_reason`` the id); not part of the text."""
    include_stop_str_in_output: bool = False
    """Keep the stop string (or a stop token's text) at the end of the output text."""
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
        _check_stop_limits(self.stop)
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
            raise ValueError(f"guided_decoding must be a GuidedDecodingParams(json=... | regex=... | choice=[...] | "
                             f"grammar=... | json_object=True), got {self.guided_decoding!r}")
        check_extras(self)

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler changes this request's logits by its history (penalties, ``logit_bias``,
        ``min_tokens``): speculative decoding does not draft for such requests."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or self.logit_bias is not None or self.min_tokens > 0)

    @property
    def greedy(self) -> bool:
        """Temperature 0 — or below ``MIN_TEMPERATURE``, where sampling is the argmax anyway."""
        return self.temperature < MIN_TEMPERATURE


def finish_reason(params: SamplingParams, token: int, num_output: int, length: int, eos_token_ids,
                  max_len: int) -> str | None:
    """The stop rule every generation loop applies after appending ``token`` (the ``num_output``-th output token;
    ``length``: prompt + output): "stop" for an EOS (unless ``ignore_eos``) or one of ``stop_token_ids`` (from
    the ``min_tokens``-th output token on), "length" at ``max_tokens`` or the context end ``max_len``, else None.
    Stop strings are the detokenizer's (they need text)."""
    if num_output >= params.min_tokens and ((token in eos_token_ids and not params.ignore_eos)
                                            or token in params.stop_token_ids):
        return "stop"
    if num_output >= params.max_tokens or length >= max_len:
        return "length"
    return None


def check_extras(params: SamplingParams) -> None:
    """Normalise and check the logprobs, penalty and stop-token fields (``SamplingParams.__post_init__``'s second
    half): numpy numbers become Python ones, ``stop_token_ids`` a tuple, ``logit_bias`` a ``{int: float}`` dict
    clamped to [-100, 100].  Raises ``ValueError`` naming the field, its value and the range."""
    def put(name, value):
        object.__setattr__(params, name, value)

    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(params, name)
        if v is not None and (not _is_int(v) or v < 0):
            raise ValueError(f"{name} must be None (off) or an integer >= 0 (top alternatives per token), got {v!r}")
        put(name, None if v is None else int(v))
    for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0), ("min_p", 0.0, 1.0)):
        v = getattr(params, name)
        if not _is_real(v) or not lo <= v <= hi:
            raise ValueError(f"{name} must be a number in [{lo:g}, {hi:g}], got {v!r}")
        put(name, float(v))
    v = params.repetition_penalty
    if not _is_real(v) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables it), got {v!r}")
    put("repetition_penalty", float(v))
    if not _is_int(params.min_tokens) or not 0 <= params.min_tokens <= params.max_tokens:
        raise ValueError(f"min_tokens must be an integer in [0, max_tokens={params.max_tokens}], "
                         f"got {params.min_tokens!r}")
    put("min_tokens", int(params.min_tokens))
    ids = params.stop_token_ids
    ids = () if ids is None else tuple(ids) if isinstance(ids, Iterable) and not isinstance(ids, (str, bytes)) else ids
    if not isinstance(ids, tuple) or not all(_is_int(t) and t >= 0 for t in ids):
        raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), got {params.stop_token_ids!r}")
    put("stop_token_ids", tuple(int(t) for t in ids))
    bias = params.logit_bias
    if bias is not None:
        if not isinstance(bias, Mapping):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
        clean = {}
        for k, b in bias.items():
            tid = int(k) if isinstance(k, str) and k.isdigit() else k  # JSON object keys are strings
            if not _is_int(tid) or tid < 0 or not _is_real(b) or not math.isfinite(b):
                raise ValueError(f"logit_bias must map token ids (integers >= 0) to finite numbers, got {k!r}: {b!r}")
            clean[int(tid)] = min(max(float(b), -100.0), 100.0)
        put("logit_bias", clean or None)
    if not isinstance(params.include_stop_str_in_output, bool):
        raise ValueError(f"include_stop_str_in_output must be True or False, got "
                         f"{params.include_stop_str_in_output!r}")


def check_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Raise ``ValueError`` for token ids (``logit_bias``, ``stop_token_ids``) or logprob counts beyond a model's
    vocabulary of ``vocab_size`` tokens (the engine calls this when a request arrives)."""
    for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} must hold token ids below the vocabulary size {vocab_size}, got {bad[0]}")
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(params, name)
        if v is not None and v > vocab_size:
            raise ValueError(f"{name} must be at most the vocabulary size {vocab_size}, got {v}")


def _check_stop_limits(stop: tuple[str, ...]) -> None:
    """At most ``MAX_STOP_STRINGS`` stop strings of at most ``MAX_STOP_CHARS`` characters each (values are not
    echoed: a refused stop string may be megabytes)."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}: send fewer")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"stop must hold strings of at most {MAX_STOP_CHARS} characters, got one of {longest}: "
                         "send a shorter stop string")


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)
