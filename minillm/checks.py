"""Exercise checkers, shared by the course notebooks and the test suite.

Each exercise is a fenced function (or method) inside ``minillm`` (``### BEGIN SOLUTION`` … ``### END SOLUTION``).
``EXERCISES`` is the registry: number → where the function lives, its title, a one-line hint and its checker.
The course build (``course/build.py``) reads it to render the student stub, whose body is
``raise NotImplementedError("Exercise N.k: <title> — <hint>")``.

A checker ``check_<name>(student, ...)``:
- calls the student's code on several inputs, edge cases included, and compares with the library's solution;
- raises ``AssertionError`` naming the input, the expected and the received value when they differ;
- lets any exception from the student's code through unchanged — a stub's ``NotImplementedError`` included, so a
  grader's report says which exercise is unfinished;
- prints ``✓ Exercise N.k passed: <title>`` on success.
"""

from __future__ import annotations

import importlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .config import ModelConfig


@dataclass(frozen=True)
class Exercise:
    """One exercise: ``target`` is the dotted path of the fenced function ("minillm.kv_cache.kv_bytes_per_token")
    or method ("minillm.kv_cache.KVCache.update")."""

    number: str
    target: str
    title: str
    hint: str
    check: Callable

    @property
    def stub_message(self) -> str:
        """What the student's stub raises (and so what a grader sees for an unfinished exercise)."""
        return f"Exercise {self.number}: {self.title} — {self.hint}"

    @property
    def module(self) -> str:
        """The module holding the target, e.g. "minillm.kv_cache"."""
        parts = self.target.split(".")
        for i in range(len(parts) - 1, 0, -1):
            name = ".".join(parts[:i])
            try:
                importlib.import_module(name)
                return name
            except ModuleNotFoundError:
                continue
        raise ModuleNotFoundError(f"no module found in {self.target!r}")

    @property
    def qualname(self) -> str:
        """The target's name inside its module: "kv_bytes_per_token" or "KVCache.update"."""
        return self.target[len(self.module) + 1 :]

    def reference(self):
        """The library's own function, method, or (for a method) its class."""
        obj = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj

    def answer(self):
        """What the checker takes, from the library: the function, or the class for a method exercise."""
        obj = importlib.import_module(self.module)
        for part in self.qualname.split(".")[:1]:
            obj = getattr(obj, part)
        return obj


EXERCISES: dict[str, Exercise] = {}


def exercise(number: str, target: str, title: str, hint: str):
    """Register the decorated checker as the one for exercise ``number`` (a fenced region in ``target``)."""

    def register(check: Callable) -> Callable:
        if number in EXERCISES:
            raise ValueError(f"exercise {number} is registered twice")
        EXERCISES[number] = Exercise(number, target, title, hint, check)
        check.exercise = number
        return check

    return register


def _passed(number: str) -> None:
    print(f"✓ Exercise {number} passed: {EXERCISES[number].title}")


def _close(got, expected, rel: float = 1e-9, abs_: float = 0.0) -> bool:
    """``got`` is a number (Python, numpy or a one-element tensor) within the tolerances of ``expected``."""
    if got is None or isinstance(got, bool):
        return False
    try:
        return math.isclose(float(got), expected, rel_tol=rel, abs_tol=abs_)
    except (TypeError, ValueError, RuntimeError):
        return False


# Small configurations with known answers.  Llama-2-7B: 32 layers, hidden 4096, MLP 11008, 32 heads (MHA),
# vocab 32000, untied embeddings (its config.json on the hub); SmolLM2-135M: the course's default model.
LLAMA2_7B = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                        num_kv_heads=32, head_dim=128, max_position_embeddings=4096)
SMOLLM2_135M = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                           num_kv_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True)
# A made-up multi-query model (one K/V head) to catch H_q used where H_kv belongs.
TINY_MQA = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                       num_kv_heads=1, head_dim=32, max_position_embeddings=512)
CONFIGS = {"Llama-2-7B": LLAMA2_7B, "SmolLM2-135M": SMOLLM2_135M, "tiny MQA": TINY_MQA}


# --------------------------------------------------------------------------------------------- notebook 00
def _kwargs_text(kw: dict) -> str:
    return "".join(f", {k}={v!r}" for k, v in kw.items())


def _check_specs() -> list:
    """(name, spec, dtype) for every reference GPU and dtype it lists, plus a made-up CPU-like laptop
    (200 GFLOP/s fp32, 30 GB/s, no 16-bit entry: catches a hard-coded dtype)."""
    from .hardware import SPECS, HardwareSpec

    laptop = HardwareSpec("made-up laptop", {"float32": 200e9}, 30e9, 0, "made up for the checks")
    return [(s.name, s, dt) for s in (*SPECS.values(), laptop) for dt in s.peak_flops]


@exercise("0.1", "minillm.roofline.linear_cost", "FLOPs and bytes of a linear layer",
          "2·M·K·N FLOPs (+ M·N for a bias); weight bytes K·N (+ N for a bias) at the weight dtype's size, "
          "activation bytes M·K (x read) + M·N (y written) at dtype's size (dtype_bytes gives sizes); return "
          "Cost(flops, bytes, {'weights': …, 'activations': …}, {'linear': flops})")
def check_linear_cost(linear_cost: Callable) -> None:
    """``linear_cost(M, K, N, dtype, weight_dtype=, bias=)``: FLOPs, bytes and their split, exactly, on decode,
    batched, prefill and square shapes, with a bias and with quantized weights; then intensity ≈ M when M ≪ K, N."""
    from .roofline import linear_cost as reference

    cases = [
        ("decode GEMV (Llama-2-7B q_proj, batch 1)", (1, 4096, 4096, "bfloat16"), {}),
        ("batched decode (Llama-2-7B gate+up, batch 64)", (64, 4096, 2 * 11008, "float16"), {}),
        ("prefill (SmolLM2 gate+up, 512 tokens)", (512, 576, 3072, "float32"), {}),
        ("square matmul", (2048, 2048, 2048, "float32"), {}),
        ("with a bias (a Qwen2-style qkv projection)", (3, 576, 960, "bfloat16"), {"bias": True}),
        ("int4 weights, bf16 activations", (8, 4096, 4096, "bfloat16"), {"weight_dtype": "int4"}),
        ("weights priced in bytes per element (int4 + group scales)", (2, 1024, 256, torch.float16),
         {"weight_dtype": 0.5625}),
    ]
    for name, (M, K, N, dtype), kw in cases:
        got, expected = linear_cost(M, K, N, dtype, **kw), reference(M, K, N, dtype, **kw)
        call = f"linear_cost(M={M}, K={K}, N={N}, dtype={dtype!r}{_kwargs_text(kw)})"
        flops, nbytes = getattr(got, "flops", None), getattr(got, "bytes", None)
        assert _close(flops, expected.flops), (
            f"{name}: {call}.flops is {flops!r}, expected {expected.flops:,}: 2 FLOPs (a multiply and an add) per "
            "weight per row of x, 2·M·K·N, plus M·N adds for a bias.")
        assert _close(nbytes, expected.bytes), (
            f"{name}: {call}.bytes is {nbytes!r}, expected {expected.bytes:,.0f}: the weights once (K·N elements, "
            "+ N for a bias) at the weight dtype's size, plus x read (M·K) and y written (M·N) at dtype's size.")
        parts = getattr(got, "breakdown", None) or {}
        for part in ("weights", "activations"):
            assert _close(parts.get(part), expected.breakdown[part]), (
                f"{name}: {call}.breakdown[{part!r}] is {parts.get(part)!r}, expected "
                f"{expected.breakdown[part]:,.0f} bytes (breakdown splits bytes into 'weights' and 'activations').")
    for M in (1, 4, 16):  # the lesson of the exercise, from the student's own numbers
        c = linear_cost(M, 8192, 8192, "bfloat16")
        assert abs(c.flops / c.bytes / M - 1) < 0.01, (
            f"a bf16 linear with M={M} ≪ K = N = 8192 should have intensity ≈ M = {M} FLOP/byte, expected "
            f"within 1 %, got {c.flops / c.bytes:.3f}")
    _passed("0.1")


@exercise("0.2", "minillm.roofline.ridge_point", "the ridge point",
          "peak FLOP/s for the dtype (spec.peak(dtype)) divided by the memory bandwidth in bytes/s")
def check_ridge_point(ridge_point: Callable) -> None:
    """``ridge_point(spec, dtype)``: H100 SXM bf16 ≈ 295 FLOP/byte, then every reference GPU and dtype."""
    from .hardware import get_spec
    from .roofline import ridge_point as reference

    got = ridge_point(get_spec("H100-SXM"), "bfloat16")
    assert _close(got, 989e12 / 3.35e12, rel=1e-9), (
        f"H100 SXM in bfloat16 (989 TFLOP/s dense, 3.35 TB/s): ridge_point returned {got!r}, expected "
        f"{989e12 / 3.35e12:.1f} FLOP/byte = peak FLOP/s ÷ bandwidth (bytes/s).")
    for name, spec, dtype in _check_specs():
        got, expected = ridge_point(spec, dtype), reference(spec, dtype)
        assert _close(got, expected), (
            f"{name} in {dtype} ({spec.peak(dtype) / 1e12:g} TFLOP/s, {spec.memory_bandwidth / 1e12:g} TB/s): "
            f"ridge_point returned {got!r}, expected {expected:.4g} FLOP/byte (use the peak of the dtype asked for).")
    _passed("0.2")


@exercise("0.3", "minillm.roofline.attainable_flops", "attainable FLOP/s (the roofline)",
          "the lower of the two roofs: min(spec.peak(dtype), intensity × spec.memory_bandwidth)")
def check_attainable_flops(attainable_flops: Callable) -> None:
    """``attainable_flops(spec, intensity, dtype)`` below, at and above the ridge, for every reference GPU and dtype."""
    from .roofline import attainable_flops as reference

    for name, spec, dtype in _check_specs():
        ridge = spec.peak(dtype) / spec.memory_bandwidth
        for intensity in (0.0, 0.5, 1.0, ridge / 3, ridge, 2 * ridge, 1e5):
            got, expected = attainable_flops(spec, intensity, dtype), reference(spec, intensity, dtype)
            side = "below the ridge: intensity × bandwidth" if intensity < ridge else "at or above the ridge: the peak"
            assert _close(got, expected, rel=1e-9), (
                f"{name} in {dtype} (ridge {ridge:.3g} FLOP/byte): attainable_flops(intensity={intensity:.4g}) "
                f"returned {got!r}, expected {expected:.4g} FLOP/s ({side}).")
    _passed("0.3")


@exercise("0.4", "minillm.roofline.mbu", "model bandwidth utilisation (MBU)",
          "bytes the model reads per step × steps per second = achieved bytes/s; divide by peak_bandwidth "
          "(a fraction 0..1, not a percentage)")
def check_mbu(mbu: Callable) -> None:
    """``mbu(bytes_per_step, steps_per_s, bandwidth)``: the 7B / 100 tok/s / A100 example (70 %), then others,
    with the bandwidth given as a number and as a ``HardwareSpec``."""
    from .hardware import get_spec
    from .roofline import mbu as reference

    got = mbu(7e9 * 2, 100, 2e12)
    assert _close(got, 0.7, rel=1e-9), (
        f"a 7B-parameter model in 16-bit weights (14 GB read per token) decoding 100 tokens/s on a 2 TB/s A100: "
        f"mbu(14e9, 100, 2e12) returned {got!r}, expected 0.70 (1.4 TB/s achieved ÷ 2 TB/s, as a fraction).")
    a100, h100 = get_spec("A100-80GB"), get_spec("H100-SXM")
    cases = [(270e6, 1000.0, a100), (270e6, 1000.0, a100.memory_bandwidth), (14e9, 200.0, h100), (1e9, 0.0, 30e9),
             (2.5e8, 55.5, 34e9)]
    for nbytes, steps, bandwidth in cases:
        got, expected = mbu(nbytes, steps, bandwidth), reference(nbytes, steps, bandwidth)
        shown = bandwidth.name if hasattr(bandwidth, "name") else f"{bandwidth:g} B/s"
        assert _close(got, expected, rel=1e-9, abs_=1e-15), (
            f"mbu(bytes_per_step={nbytes:g}, steps_per_s={steps:g}, bandwidth={shown}) returned {got!r}, "
            f"expected {expected:.4g}: bytes per step × steps per second ÷ peak bandwidth (bytes/s).")
    _passed("0.4")


# --------------------------------------------------------------------------------------------- notebook 01
@exercise("1.1", "minillm.metrics.decode_weight_bytes", "weight bytes read per decode step",
          "every linear and norm weight once, the LM head in full, the embedding table not at all; × bytes per element")
def check_decode_weight_bytes(decode_weight_bytes: Callable) -> None:
    """``decode_weight_bytes(config, dtype)`` within 0.5 % of the reference (tied and untied embeddings)."""
    from .metrics import decode_weight_bytes as reference

    for name, config in CONFIGS.items():
        for dtype in (torch.float16, torch.float32, torch.bfloat16):
            got = decode_weight_bytes(config, dtype)
            expected = reference(config, dtype)
            params = config.num_parameters()
            assert _close(got, expected, rel=5e-3), (
                f"{name} ({params / 1e6:.0f}M parameters, tie_word_embeddings={config.tie_word_embeddings}) in "
                f"{dtype}: decode_weight_bytes returned {got!r}, expected ≈ {expected:,} bytes "
                f"({expected / 1e9:.3f} GB, 0.5 % tolerance). Count what one decode step reads: an embedding "
                "lookup reads one row (negligible), the LM head its whole matrix (shared storage when tied).")
    _passed("1.1")


@exercise("1.2", "minillm.metrics.percentile", "percentile with linear interpolation",
          "sort, then interpolate between the values at floor and ceil of q/100 × (n − 1)")
def check_percentile(percentile: Callable) -> None:
    """``percentile(values, q)`` against the reference on hand-made and random inputs."""
    from .metrics import percentile as reference

    rng = random.Random(0)
    cases = [([7.0], 50), ([7.0], 0), ([1, 2, 3, 4], 50), ([3, 1, 2], 0), ([3, 1, 2], 100), ([10, 20], 25),
             ([0.1] * 9 + [3.0], 50), ([0.1] * 9 + [3.0], 90), (list(range(1, 11)), 90), ([5, 5, 5, 1], 75)]
    cases += [([rng.lognormvariate(-2, 1) for _ in range(n)], q) for n in (2, 7, 100) for q in (1, 50, 99, 99.9)]
    for values, q in cases:
        given = list(values)
        got = percentile(given, q)
        expected = reference(values, q)
        shown = values if len(values) <= 10 else f"{len(values)} values"
        assert _close(got, expected, rel=1e-9, abs_=1e-12), (
            f"percentile({shown}, q={q}) returned {got!r}, expected {expected!r}. "
            "Sort the values, then interpolate linearly at fractional index q/100 × (n − 1).")
        assert given == values, f"percentile must not modify its input: {values} became {given}"
    _passed("1.2")


@exercise("1.3", "minillm.metrics.goodput", "goodput under a latency SLO",
          "count the requests with ttft_s <= ttft_slo_s and tpot_s <= tpot_slo_s, divide by duration_s")
def check_goodput(goodput: Callable) -> None:
    """``goodput(requests, duration_s, ttft_slo_s=, tpot_slo_s=)`` on requests just inside/outside each limit."""
    from .metrics import goodput as reference

    def req(ttft, tpot):
        return SimpleNamespace(ttft_s=ttft, tpot_s=tpot)

    fast, slow_first, slow_rest = req(0.05, 0.02), req(0.5, 0.02), req(0.05, 0.5)
    cases = [
        ("all good", [fast] * 4, 2.0, {}),
        ("slow TTFT and slow TPOT are both bad", [fast, slow_first, slow_rest, fast], 1.0, {}),
        ("exactly at the limits counts as good", [req(0.2, 0.1)], 1.0, {}),
        ("a one-token request (TPOT 0) is judged on TTFT", [req(0.1, 0.0), req(0.3, 0.0)], 1.0, {}),
        ("no requests", [], 5.0, {}),
        ("custom SLOs", [fast, slow_first, slow_rest], 0.5, {"ttft_slo_s": 1.0, "tpot_slo_s": 1.0}),
        ("custom SLOs, strict", [fast, slow_first, slow_rest], 0.5, {"ttft_slo_s": 0.01, "tpot_slo_s": 1.0}),
    ]
    for name, requests, duration, slo in cases:
        got = goodput(requests, duration, **slo)
        expected = reference(requests, duration, **slo)
        listed = [(r.ttft_s, r.tpot_s) for r in requests]
        assert _close(got, expected), (
            f"{name}: goodput(requests with (ttft_s, tpot_s) = {listed}, duration_s={duration}"
            f"{''.join(f', {k}={v}' for k, v in slo.items())}) returned {got!r}, expected {expected!r} "
            "requests/s (good requests ÷ duration; a request must meet both limits, equality included).")
    _passed("1.3")


@exercise("1.4", "minillm.metrics.cost_per_million_tokens", "dollars per million tokens",
          "tokens per hour = tokens_per_s × 3600; price per token = dollars_per_hour / tokens per hour")
def check_cost_per_million_tokens(cost_per_million_tokens: Callable) -> None:
    """``cost_per_million_tokens($/h, tok/s)``: the $2/h at 100 tok/s ≈ $5.56 example and others."""
    from .metrics import cost_per_million_tokens as reference

    for dollars, tps in [(2.0, 100.0), (0.0, 50.0), (3.5, 1000.0), (40.0, 2500.0), (1.0, 0.5)]:
        got = cost_per_million_tokens(dollars, tps)
        expected = reference(dollars, tps)
        assert _close(got, expected), (
            f"cost_per_million_tokens({dollars} $/h, {tps} tok/s) returned {got!r}, expected ${expected:.4f} "
            "per 1M tokens.")
    _passed("1.4")


def check_roofline_prediction(predicted: float, measured: float, *, what: str = "decode tokens/s",
                              device: str = "cpu", upper: float = 1.25, lower: float = 0.1) -> None:
    """A "predict, then measure" check: the roofline bound ``predicted`` against the ``measured`` rate.

    A bound cannot be beaten: ``measured`` may exceed ``predicted`` by at most ``upper`` − 1 (25 %: bandwidth and
    speed are measured at different moments, on a machine that may be shared).  On CPU the engine should also
    reach ``lower`` (10 %) of it; a quiet CPU gives 40–70 %.  On a GPU a small model at batch 1 is bound by
    kernel-launch overhead (~5 µs × hundreds of kernels per step), far below the bandwidth bound, so no lower
    limit applies there.
    """
    assert predicted > 0 and measured > 0, f"need positive rates, got predicted={predicted}, measured={measured}"
    ratio = measured / predicted
    assert ratio <= upper, (
        f"measured {what} {measured:.4g} beats the predicted bound {predicted:.4g} by {ratio - 1:.0%} "
        f"(allowed {upper - 1:.0%}): the prediction counts more bytes than the step reads, or the bandwidth "
        "measurement is too low.")
    if str(device).startswith("cpu"):
        assert ratio >= lower, (
            f"measured {what} {measured:.4g} is only {ratio:.0%} of the predicted bound {predicted:.4g} "
            f"(expected at least {lower:.0%} on CPU): the prediction counts too few bytes, or the machine is busy.")
    print(f"✓ prediction holds: measured {what} = {ratio:.0%} of the roofline bound")


# --------------------------------------------------------------------------------------------- notebook 02
@exercise("2.1", "minillm.kv_cache.kv_bytes_per_token", "KV-cache bytes per token",
          "K and V, for every layer and every KV head, head_dim elements of the dtype's size")
def check_kv_bytes_per_token(kv_bytes_per_token: Callable) -> None:
    """``kv_bytes_per_token(config, dtype)`` exactly, for MHA, GQA and MQA models in three dtypes."""
    from .kv_cache import kv_bytes_per_token as reference

    got = kv_bytes_per_token(LLAMA2_7B, torch.float16)
    assert got == 512 * 1024, (
        f"Llama-2-7B in float16 (32 layers, 32 KV heads, head_dim 128) should need 2 × 32 × 32 × 128 × 2 = "
        f"524,288 bytes (512 KiB) per token; kv_bytes_per_token returned {got!r}.")
    for name, config in CONFIGS.items():
        for dtype in (torch.float16, torch.float32, torch.bfloat16):
            got = kv_bytes_per_token(config, dtype)
            expected = reference(config, dtype)
            assert got == expected, (
                f"{name} (layers={config.num_layers}, H_q={config.num_heads}, H_kv={config.num_kv_heads}, "
                f"head_dim={config.head_dim}) in {dtype}: kv_bytes_per_token returned {got!r}, expected "
                f"{expected:,} bytes. The cache stores K and V per *KV* head, not per query head.")
    _passed("2.1")


def _kv_cache_script(config: ModelConfig, batch: int) -> list[tuple[torch.Tensor, list[int]]]:
    """A prefill then decode steps for ``batch`` rows: [(positions [B, L], layers written)] as the engine runs."""
    L = 5
    steps = [(torch.arange(L).expand(batch, L), list(range(config.num_layers)))]  # prefill, right-padded rows
    last = torch.tensor([L - 1 - (b % 3) for b in range(batch)])  # rows of different lengths
    for _ in range(3):
        last = last + 1
        steps.append((last[:, None].clone(), list(range(config.num_layers))))
    steps.append((last[:, None] + 1, [1]))  # one layer only: the others must stay untouched
    return steps


@exercise("2.2", "minillm.kv_cache.KVCache.update", "write K/V into the cache",
          "store k, v [B, H_kv, L, D] at slots positions[b] of self.k[layer] / self.v[layer]; "
          "return the filled slots [:, :, :self._used] and self._mask")
def check_kv_cache_update(cache_class: type) -> None:
    """A ``KVCache`` subclass with the student's ``update`` against the library's, on prefill and decode steps.

    After every call the returned K, V and mask, and the whole cache contents, must equal the reference's.
    """
    from .kv_cache import KVCache as Reference

    config = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 3):
        kw = {"dtype": torch.float32, "device": "cpu"}
        mine, ref = cache_class(config, batch, 16, **kw), Reference(config, batch, 16, **kw)
        for step, (positions, layers) in enumerate(_kv_cache_script(config, batch)):
            where = (f"batch {batch}, step {step} ({'prefill' if step == 0 else 'decode'}, positions "
                     f"{positions.tolist()})")
            mine.begin(positions)
            ref.begin(positions)
            shape = (batch, config.num_kv_heads, positions.shape[1], config.head_dim)
            for layer in layers:
                k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
                out = mine.update(layer, k.clone(), v.clone())
                expected = ref.update(layer, k, v)
                assert isinstance(out, tuple) and len(out) == 3, (
                    f"{where}: update must return (K, V, mask); got {type(out).__name__}")
                for name, got, exp in zip(("K", "V"), out[:2], expected[:2], strict=True):
                    assert isinstance(got, torch.Tensor) and got.shape == exp.shape, (
                        f"{where}, layer {layer}: returned {name} has shape "
                        f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}, "
                        f"expected {tuple(exp.shape)} = [B, H_kv, slots used so far, D].")
                    assert torch.equal(got, exp), (
                        f"{where}, layer {layer}: returned {name} differs from the reference at "
                        f"{(got != exp).nonzero()[:3].tolist()} (index [b, head, slot, d]).")
                mask, exp_mask = out[2], expected[2]
                assert (mask is None) == (exp_mask is None) and (mask is None or torch.equal(mask, exp_mask)), (
                    f"{where}: the returned mask should be self._mask as begin() set it.")
            for name in ("k", "v"):
                got, exp = getattr(mine, name), getattr(ref, name)
                if not torch.equal(got, exp):
                    bad = (got != exp).nonzero()[0].tolist()
                    raise AssertionError(
                        f"{where}: after update, cache.{name} differs from the reference first at "
                        f"[layer, b, head, slot, d] = {bad}: each row's new K/V belong at the slots given by its "
                        "own positions, in the given layer only.")
    _passed("2.2")


def check_cached_logits(cached: torch.Tensor, recomputed: torch.Tensor) -> None:
    """Exactness: logits from cached decoding equal a full recomputation within the dtype's tolerance.

    ``cached``, ``recomputed``: [n, V] logits for the same n positions.  Tolerances are
    ``torch.testing.assert_close``'s defaults for the dtype, loosened 10× for fp32 (30 layers of summation
    order differences between a one-token step and a full forward).
    """
    assert cached.shape == recomputed.shape, f"shapes differ: {tuple(cached.shape)} vs {tuple(recomputed.shape)}"
    tol = {"rtol": 1.3e-5, "atol": 1e-4} if cached.dtype == torch.float32 else {}
    torch.testing.assert_close(cached, recomputed, **tol,
                               msg=lambda m: f"cached decoding diverged from recomputation: {m}")
    print(f"✓ cached logits match recomputation at {cached.shape[0]} positions (max |Δ| = "
          f"{(cached - recomputed).abs().max().item():.2e})")


def check_prediction_bytes(predicted: float, measured: float, *, tolerance: float = 0.05,
                           what: str = "KV cache bytes") -> None:
    """A "predict, then measure" check for memory: ``measured`` within ``tolerance`` (5 %) of ``predicted``."""
    assert predicted > 0, f"the prediction must be positive, got {predicted}"
    err = abs(measured - predicted) / predicted
    assert err <= tolerance, (
        f"predicted {what} {predicted / 2**20:,.1f} MiB but the allocation grew memory by {measured / 2**20:,.1f} "
        f"MiB ({err:.1%} off, tolerance {tolerance:.0%}).")
    print(f"✓ prediction holds: {what} within {err:.1%} of the measurement")


# --------------------------------------------------------------------------------------------- notebook 03
@exercise("3.1", "minillm.attention_variants.kv_bytes_gqa", "KV bytes per token for any number of K/V heads",
          "exercise 2.1's count with the num_kv_heads argument as H_kv and bytes_per_elem as the element size")
def check_kv_bytes_gqa(kv_bytes_gqa: Callable) -> None:
    """``kv_bytes_gqa(config, num_kv_heads, bytes_per_elem)`` for every H_kv dividing H_q, four element sizes."""
    from .attention_variants import kv_bytes_gqa as reference

    got = kv_bytes_gqa(LLAMA2_7B, 8, 2)
    assert _close(got, 128 * 1024), (
        f"Llama-2-7B's shape (32 layers, head_dim 128) with 8 K/V heads in fp16: kv_bytes_gqa returned {got!r}, "
        "expected 131,072 bytes (128 KiB) per token — a quarter of the 512 KiB its 32 K/V heads need.")
    for name, config in CONFIGS.items():
        for h in [d for d in range(1, config.num_heads + 1) if config.num_heads % d == 0]:
            for size in (2, 4, 1, 0.5):
                got, expected = kv_bytes_gqa(config, h, size), reference(config, h, size)
                assert _close(got, expected), (
                    f"{name} (layers={config.num_layers}, H_q={config.num_heads}, its own H_kv="
                    f"{config.num_kv_heads}, head_dim={config.head_dim}) with num_kv_heads={h}, bytes_per_elem="
                    f"{size}: kv_bytes_gqa returned {got!r}, expected {expected:,g} bytes. Count the heads you are "
                    "asked about (the argument, not config.num_kv_heads) and the element size given.")
    _passed("3.1")


def _largest_new_tensor(fn: Callable, *args, **kwargs) -> tuple[object, int, str]:
    """Run ``fn(*args, **kwargs)``; return its result, the bytes of the largest tensor storage that any operation
    inside it created (storage of the inputs and views of them excluded), and that operation's name.

    Uses PyTorch's dispatch-mode hook, which sees every ATen operation, those inside library calls included
    (``torch.matmul`` broadcasting an operand materialises the broadcast copy: it shows up here).
    """
    try:  # private but long-stable PyTorch modules (1.13+); if a future release moves them, skip the watch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
    except ImportError:
        return fn(*args, **kwargs), 0, ""

    inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    largest = [0, ""]

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            out = func(*a, **(kw or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    if t.untyped_storage().nbytes() > largest[0]:
                        largest[:] = [t.untyped_storage().nbytes(), str(func)]
            return out

    with Watch():
        result = fn(*args, **kwargs)
    return result, largest[0], largest[1]


def _lengths_mask(lengths: list[int], L: int, S: int) -> torch.Tensor:
    """[B, 1, L, S] bool: row b's queries see its first lengths[b] keys (a batch of different lengths)."""
    return (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :].expand(-1, 1, L, S)


@exercise("3.2", "minillm.attention.grouped_attention", "grouped-query attention by broadcasting",
          "G = H_q // H_kv; view q as [B, H_kv, G·L, D] (consecutive query heads share a K/V head), scores "
          "(q @ kᵀ) in fp32 × scale viewed as [B, H_kv, G, L, S], -inf where causal or mask forbid "
          "(mask[:, :, None]), softmax, cast to v's dtype, @ v, view back to [B, H_q, L, D]")
def check_grouped_attention(grouped_attention: Callable) -> None:
    """``grouped_attention(q, k, v, mask, causal=, scale=)`` against the library's on MHA, GQA and MQA shapes,
    decode and (chunked) causal prefill, masks of different lengths; then that it makes no copy of K or V for
    the query heads: no tensor as large as K repeated G times may be created."""
    from .attention import grouped_attention as reference

    g = torch.Generator().manual_seed(0)
    cases = [  # name, (B, H_q, H_kv, L, S, D), mask lengths or None, causal, scale
        ("multi-head decode (H_kv = H_q)", (2, 4, 4, 1, 9, 8), None, False, None),
        ("grouped-query prefill, causal, L = S", (1, 6, 2, 7, 7, 8), None, True, None),
        ("grouped-query chunked prefill, causal, L < S (the queries are the last L positions)",
         (2, 6, 3, 3, 10, 4), None, True, None),
        ("multi-query (H_kv = 1) with a padding mask [B, 1, L, S]", (2, 4, 1, 3, 6, 8), [6, 4], False, None),
        ("grouped-query decode over rows of different lengths, mask [B, 1, 1, S]", (3, 8, 2, 1, 12, 16),
         [12, 5, 1], False, None),
        ("causal and a mask together, scale given", (2, 9, 3, 4, 8, 8), [8, 6], True, 0.05),
    ]
    for name, (B, Hq, Hkv, L, S, D), lengths, causal, scale in cases:
        q = torch.randn(B, Hq, L, D, generator=g)
        k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
        mask = None if lengths is None else _lengths_mask(lengths, L, S)
        got = grouped_attention(q.clone(), k.clone(), v.clone(), mask, causal=causal, scale=scale)
        expected = reference(q, k, v, mask, causal=causal, scale=scale)
        where = (f"{name}: q {tuple(q.shape)}, k/v {tuple(k.shape)}, causal={causal}, scale={scale}"
                 + ("" if lengths is None else f", mask lengths {lengths}"))
        assert isinstance(got, torch.Tensor) and got.shape == expected.shape, (
            f"{where}: returned {tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}, "
            f"expected a tensor of shape {tuple(expected.shape)} = [B, H_q, L, D].")
        torch.testing.assert_close(got, expected, msg=lambda m, where=where: (
            f"{where}: the output differs from the expected one. Query head h uses K/V head h // G (consecutive "
            f"heads share, as transformers' repeat_kv); causal query i sees keys j ≤ S − L + i. {m}"))
    for Hkv in (2, 1):  # no copies: K repeated for every query head is G times the size of K
        B, Hq, S, D = 2, 8, 64, 16
        q = torch.randn(B, Hq, 1, D, generator=g)
        k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
        mask = _lengths_mask([64, 40], 1, S)
        _, nbytes, op = _largest_new_tensor(grouped_attention, q, k, v, mask)
        repeated = B * Hq * S * D * k.element_size()
        assert nbytes < repeated, (
            f"decode with H_q={Hq}, H_kv={Hkv}, S={S}, D={D}: grouped_attention created a tensor of {nbytes:,} bytes "
            f"(in {op}), the size of K or V repeated for all {Hq} query heads; expected nothing that large (the "
            f"scores are {B * Hq * S * 4:,} bytes). Share each K/V head by viewing q as [B, H_kv, G·L, D] and "
            "multiplying by kᵀ directly: repeat_interleave copies K/V, and so does torch.matmul when it broadcasts "
            "an operand over an extra group dimension.")
    _passed("3.2")


# --------------------------------------------------------------------------------------------- notebook 04
def _softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q kᵀ · scale) v in fp64, the textbook formula: q [..., M, D], k/v [..., N, D] -> [..., M, D] fp32."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    return (s.softmax(-1) @ v.double()).float()


@exercise("4.1", "minillm.attention.merge_attention_partials", "merge partial softmax results",
          "M = the largest m over the splits; weight each split by exp(m − M) (0 for an empty split); divide the "
          "weighted sum of o by the weighted sum of den")
def check_merge_attention_partials(merge_attention_partials: Callable) -> None:
    """``merge_attention_partials(m, den, o)`` of splits from ``attention_partial`` equals softmax attention over
    all keys: two halves, one split, empty splits first and in the middle, uneven splits, scores whose exp overflows."""
    from .attention import attention_partial

    g = torch.Generator().manual_seed(0)
    cases = [  # name, split edges over N = 40 keys, scale
        ("two halves", [0, 20, 40], 0.25),
        ("a single split (nothing to merge)", [0, 40], 0.25),
        ("uneven splits, the last holds one key", [0, 30, 39, 40], 0.25),
        ("an empty split in the middle (m = -inf, den = 0, o = 0)", [0, 10, 10, 40], 0.25),
        ("the first split empty", [0, 0, 25, 40], 0.25),
        ("large scores: exp(score) overflows fp32 unless rescaled by the max", [0, 13, 27, 40], 40.0),
    ]
    for name, edges, scale in cases:
        q = torch.randn(2, 3, 16, generator=g)  # 2 sequences × 3 query heads of one group, D = 16
        k, v = torch.randn(2, 40, 16, generator=g), torch.randn(2, 40, 16, generator=g)
        parts = [attention_partial(q, k[:, a:b], v[:, a:b], scale=scale) for a, b in zip(edges[:-1], edges[1:],
                                                                                            strict=True)]
        m = torch.stack([p[0] for p in parts], dim=-1)  # (2, 3, P)
        den = torch.stack([p[1] for p in parts], dim=-1)  # (2, 3, P)
        o = torch.stack([p[2] for p in parts], dim=-2)  # (2, 3, P, 16)
        got = merge_attention_partials(m.clone(), den.clone(), o.clone())
        expected = _softmax_attention(q, k, v, scale)
        where = (f"{name}: {len(parts)} splits of {[b - a for a, b in zip(edges[:-1], edges[1:], strict=True)]} "
                 f"keys, m {tuple(m.shape)}, den {tuple(den.shape)}, o {tuple(o.shape)}")
        assert isinstance(got, torch.Tensor) and got.shape == expected.shape, (
            f"{where}: returned {tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}, "
            f"expected shape {tuple(expected.shape)} (the split axis merged away).")
        assert torch.isfinite(got).all(), (
            f"{where}: the result has inf/NaN at {(~torch.isfinite(got)).nonzero()[:3].tolist()}; expected finite "
            "values. Subtract the largest max M before exponentiating (exp(m − M) ≤ 1), and give empty splits "
            "(m = -inf) weight exp(-inf) = 0.")
        torch.testing.assert_close(got.float(), expected, msg=lambda msg, where=where: (
            f"{where}: the merged output differs from softmax attention over all the keys. Each split's den and o "
            f"were summed under its own max m_p: rescale them by exp(m_p − M) to a common max before adding. {msg}"))
    _passed("4.1")


@exercise("4.2", "minillm.attention.flash_tile_step", "one tile of FlashAttention's online softmax",
          "this tile's scores in fp32; each row's new max; rescale den and acc by exp(old max − new max), then add "
          "the tile's exp(score − new max), summed (den) and multiplied by v_tile (acc)")
def check_flash_tile_step(flash_tile_step: Callable) -> None:
    """``flash_tile_step`` from the empty state equals ``attention_partial`` of the first tile; folded over all
    tiles (sizes 1 to all keys, ragged, growing scores, GQA-shaped leading dims) the state matches the library's
    step after every tile and acc / den equals softmax attention."""
    from .attention import attention_partial
    from .attention import flash_tile_step as reference

    g = torch.Generator().manual_seed(0)
    cases = [  # name, q shape [..., M, D], N keys, tile size, scale, key growth
        ("one tile holding every key", (2, 4, 16), 40, 40, 0.25, False),
        ("tiles of 16 keys, the last one ragged (8)", (2, 4, 16), 40, 16, 0.25, False),
        ("one key per tile", (1, 3, 8), 12, 1, 0.35, False),
        ("scores growing tile after tile (the max keeps rising; exp overflows without it)", (2, 4, 16), 48, 16,
         1.0, True),
        ("GQA: q viewed as [B, H_kv, G·L, D] against k [B, H_kv, N, D]", (1, 2, 6, 8), 24, 10, 8**-0.5, False),
    ]
    for name, q_shape, N, block, scale, growing in cases:
        q = torch.randn(q_shape, generator=g)
        lead, D = q_shape[:-2], q_shape[-1]
        k, v = torch.randn(*lead, N, D, generator=g), torch.randn(*lead, N, D, generator=g)
        if growing:
            k = k * torch.linspace(0.1, 30, N)[:, None]
        where = f"{name}: q {tuple(q.shape)}, k/v {tuple(k.shape)}, tile size {block}, scale {scale:.3g}"
        mine = (torch.full(q_shape[:-1], float("-inf")), torch.zeros(q_shape[:-1]), torch.zeros(q_shape))
        ref = tuple(t.clone() for t in mine)
        for t, start in enumerate(range(0, N, block)):
            kt, vt = k[..., start : start + block, :], v[..., start : start + block, :]
            out = flash_tile_step(*(x.clone() for x in mine), q.clone(), kt.clone(), vt.clone(), scale)
            ref = reference(*ref, q, kt, vt, scale)
            if t == 0:  # from the empty state, one step is exactly this tile's partial softmax
                ref = attention_partial(q, kt, vt, scale=scale)
            assert isinstance(out, tuple) and len(out) == 3, (
                f"{where}: flash_tile_step returned {type(out).__name__}, expected the new state as a tuple "
                "(m, den, acc).")
            for label, got, exp in zip(("m (running max)", "den (running sum of exp)", "acc (unnormalised output)"),
                                       out, ref, strict=True):
                assert isinstance(got, torch.Tensor) and got.shape == exp.shape, (
                    f"{where}, after tile {t}: returned {label} of shape "
                    f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}, expected "
                    f"{tuple(exp.shape)}.")
                step = f"{where}, after tile {t} (keys {start}..{min(N, start + block) - 1})"
                torch.testing.assert_close(got.float(), exp, msg=lambda msg, step=step, label=label: (
                    f"{step}: {label} differs "
                    "from the expected state. When the max rises from m to m_new, everything summed so far was "
                    f"relative to m: multiply den and acc by exp(m − m_new) before adding this tile. {msg}"))
            mine = out
        torch.testing.assert_close((mine[2] / mine[1][..., None]).float(), _softmax_attention(q, k, v, scale),
                                   msg=lambda msg, where=where: f"{where}: acc / den after the last tile differs "
                                   f"from softmax attention over all keys. {msg}")
    _passed("4.2")


# --------------------------------------------------------------------------------------------- notebook 05
def _allocator_state(a) -> dict:
    """What a BlockAllocator's observable state is: ref counts, free-list order, LRU order, cache entries."""
    return {"ref counts": [a.ref_count(b) for b in range(a.num_blocks)], "free list": list(a._free),
            "evictable (LRU order)": a.evictable_blocks(), "cache entries": sorted(a.cached_blocks())}


def _compare_allocators(mine, ref, where: str, hint: str) -> None:
    got, expected = _allocator_state(mine), _allocator_state(ref)
    for key in expected:
        assert got[key] == expected[key], (
            f"{where}: {key} is {got[key]}, expected {expected[key]}. {hint}")


@exercise("5.1", "minillm.paged.BlockAllocator.free", "free a block: reference counts",
          "self._ref[block_id] -= 1; at zero, a cached block (self.is_cached) goes to the end of self._evictable "
          "(self._evictable[block_id] = None), any other block to the end of self._free")
def check_block_free(allocator_class: type) -> None:
    """A ``BlockAllocator`` subclass with the student's ``free`` against the library's, on a scripted story
    (shared blocks, cached blocks, LRU order, reuse) and on random operation sequences; every observable state
    (ref counts, free-list and LRU order, cache entries) must match after every operation."""
    from .paged import BlockAllocator as Reference
    from .paged import hash_block_tokens

    mine, ref = allocator_class(4, 2), Reference(4, 2)
    shared = "a shared block survives until its last owner frees it; only the last free releases it"
    story = [  # (description, operation, hint if the states then differ)
        ("allocate() twice", lambda a: [a.allocate(), a.allocate()], ""),
        ("fork([0, 1]): both blocks get a second owner", lambda a: a.fork([0, 1]), ""),
        ("free(0) while block 0 has 2 owners", lambda a: a.free(0), shared + "."),
        ("free(0) again: its last owner", lambda a: a.free(0),
         "with no owner left an uncached block goes to the end of the free list (self._free.append)."),
        ("register(1, ...): block 1 becomes a prefix-cache entry",
         lambda a: a.register(1, hash_block_tokens(None, [5, 6]), [5, 6], None), ""),
        ("free(1) while block 1 has 2 owners", lambda a: a.free(1), shared + "."),
        ("free(1) again: the last owner of a cached block", lambda a: a.free(1),
         "a prefix-cache entry keeps its K/V for later hits: it joins the LRU pool (self._evictable[block_id] = "
         "None), not the free list."),
        ("a prefix hit revives block 1 (incref), then free(1)", lambda a: (a.incref(1), a.free(1)),
         "the cached block goes back to the LRU pool, at its end (most recently released)."),
        ("allocate() four times: the free list first, then the LRU block is evicted",
         lambda a: [a.allocate() for _ in range(4)], "free() must put blocks where allocate() looks for them."),
        ("register(2) and (3) as cache entries, then free(3), free(2), free(0), free(1)",
         lambda a: (a.register(2, hash_block_tokens(None, [1, 2]), [1, 2], None),
                    a.register(3, hash_block_tokens(None, [3, 4]), [3, 4], None),
                    a.free(3), a.free(2), a.free(0), a.free(1)),
         "cached blocks enter the LRU pool in the order they are released (least recently released first); "
         "uncached ones the free list."),
    ]
    for i, (what, op, hint) in enumerate(story):
        got, expected = op(mine), op(ref)
        where = f"step {i + 1} of the story, {what}"
        assert got == expected, f"{where}: returned {got!r}, expected {expected!r}. {hint}"
        _compare_allocators(mine, ref, where, hint)
    try:
        mine.free(0)
    except RuntimeError:
        pass
    else:
        raise AssertionError("free(0) of a block whose reference count is 0 must raise RuntimeError (a double free), "
                             "expected the check kept before the fence to do it")
    rng = random.Random(0)  # random operation sequences, the same on both allocators
    for trial in range(20):
        mine, ref = allocator_class(6, 2), Reference(6, 2)
        held: list[int] = []
        log: list[str] = []
        for _ in range(60):
            r = rng.random()
            if r < 0.35 and mine.num_free:
                b, b_ref = mine.allocate(), ref.allocate()
                assert b == b_ref, (f"random run {trial} after {log[-6:]}: allocate() returned block {b}, expected "
                                    f"{b_ref}: freed blocks must join the free list / LRU pool at the end")
                held.append(b)
                log.append(f"allocate() -> {b}")
            elif r < 0.5 and held:
                b = rng.choice(held)
                mine.incref(b), ref.incref(b)
                held.append(b)
                log.append(f"incref({b})")
            elif r < 0.6 and held:
                b = rng.choice(held)
                tokens = [rng.randrange(100), rng.randrange(100)]
                h = hash_block_tokens(None, tokens)
                mine.register(b, h, tokens, None), ref.register(b, h, tokens, None)
                log.append(f"register({b})")
            elif held:
                b = held.pop(rng.randrange(len(held)))
                mine.free(b), ref.free(b)
                log.append(f"free({b})")
            _compare_allocators(mine, ref, f"random run {trial}, after {log[-6:]}",
                                "Lower the count; release only at zero: cached -> end of the LRU pool, else -> end "
                                "of the free list.")
    _passed("5.1")


def _manager_state(m, seq_ids) -> dict:
    state = {f"block table of {s!r}": m.block_table(s) for s in seq_ids if s in m}
    state.update({f"tokens of {s!r}": m.sequence(s).token_ids for s in seq_ids if s in m})
    state["ref counts"] = [m.device.ref_count(b) for b in range(m.device.num_blocks)]
    state["free blocks"] = m.device.num_free
    return state


@exercise("5.2", "minillm.block_manager.BlockManager.append_slots", "grow a sequence: blocks on demand, copy-on-write",
          "copy-on-write first: when self._needs_copy(table), put a block from self.device.allocate() in the "
          "table's last place, free the shared one, record BlockCopy(shared, new, CopyKind.COPY_ON_WRITE); then "
          "give each token a new block only when the last one is full, and append it to table.token_ids")
def check_append_slots(manager_class: type) -> None:
    """A ``BlockManager`` subclass with the student's ``append_slots`` against the library's: decode appends one
    token at a time, multi-token appends across block boundaries, forks (parallel sampling) whose first write
    copies the shared partial block, and random operation sequences.  Returned copies, block tables, tokens,
    ref counts and free blocks must match after every call."""
    from .block_manager import BlockManager as Reference

    def run(script, num_blocks=12, bs=4, caching=True):
        mine = manager_class(num_blocks, bs, enable_prefix_caching=caching)
        ref = Reference(num_blocks, bs, enable_prefix_caching=caching)
        ids = set()
        for what, op, hint in script:
            got, expected = op(mine), op(ref)
            ids |= {s for s in ("p", "c", "d", "q") if s in ref}
            assert got == expected, f"{what}: returned {got!r}, expected {expected!r}. {hint}"
            g, e = _manager_state(mine, ids), _manager_state(ref, ids)
            for key in e:
                assert g.get(key) == e[key], f"{what}: {key} is {g.get(key)}, expected {e[key]}. {hint}"

    jit = "a new block only when the last one is full (len(table.token_ids) % block_size == 0), before appending"
    cow = ("the last block is partial and shared (ref count > 1): copy-on-write — allocate a new block, put it "
           "in the table's place of the shared one, free the shared one, and return "
           "[BlockCopy(shared, new, CopyKind.COPY_ON_WRITE)]")
    run([
        ("allocate('p', 5 prompt tokens) with block_size 4", lambda m: m.allocate("p", [1, 2, 3, 4, 5]), ""),
        *[(f"append_slots('p', [{t}]) (decode token {t - 5})", lambda m, t=t: m.append_slots("p", [t]), jit)
          for t in range(6, 12)],
        ("append_slots('p', []) (nothing to add)", lambda m: m.append_slots("p", []),
         "no tokens, no blocks and no copies"),
        ("append_slots('p', 9 tokens at once)", lambda m: m.append_slots("p", list(range(20, 29))), jit),
    ])
    run([
        ("allocate('p', 6 prompt tokens) with block_size 4", lambda m: m.allocate("p", [1, 2, 3, 4, 5, 6]), ""),
        ("mark_computed('p', 6), fork('p' -> 'c') (parallel sampling, n = 2)",
         lambda m: (m.mark_computed("p", 6), m.fork("p", "c")), ""),
        ("append_slots('c', [7]): the child's first token goes into the shared partial block",
         lambda m: m.append_slots("c", [7]), cow),
        ("append_slots('p', [8]): the parent is now the last block's only owner",
         lambda m: m.append_slots("p", [8]), "a block with one owner is written in place: no copy"),
        ("append_slots('c', [9, 10, 11]): across a block boundary", lambda m: m.append_slots("c", [9, 10, 11]), jit),
        ("mark_computed('p', 7), fork('p' -> 'd'), append_slots('d', [12, 13])",
         lambda m: (m.mark_computed("p", 7), m.fork("p", "d"), m.append_slots("d", [12, 13])), cow),
        ("free('p'), free('c'), free('d')", lambda m: (m.free("p"), m.free("c"), m.free("d")), ""),
    ])
    run([
        ("allocate('p', 8 prompt tokens: two full blocks)", lambda m: m.allocate("p", list(range(1, 9))), ""),
        ("mark_computed('p', 8), fork('p' -> 'c')", lambda m: (m.mark_computed("p", 8), m.fork("p", "c")), ""),
        ("append_slots('c', [9]): the shared blocks are full", lambda m: m.append_slots("c", [9]),
         "full shared blocks are never written again: the child just gets a new block, no copy"),
    ])
    rng = random.Random(0)
    for trial in range(15):
        prompt = list(range(1, rng.randint(1, 9) + 1))
        script = [(f"random run {trial}: allocate('p', {len(prompt)} tokens)",
                   lambda m, p=prompt: m.allocate("p", p), "")]
        names = ["p"]
        for k in range(12):
            seq = rng.choice(names)
            if rng.random() < 0.2 and len(names) < 4:
                child = "cdq"[len(names) - 1]
                names.append(child)
                script.append((f"random run {trial}: mark_computed + fork({seq!r} -> {child!r})",
                               lambda m, s=seq, c=child: (m.mark_computed(s, m.num_tokens(s)), m.fork(s, c)), ""))
            else:
                toks = [rng.randrange(1, 50) for _ in range(rng.choice([1, 1, 1, 2, 5]))]
                script.append((f"random run {trial}, call {k}: append_slots({seq!r}, {toks})",
                               lambda m, s=seq, t=toks: m.append_slots(s, t), f"{jit}; {cow}"))
        run(script, num_blocks=100)
    _passed("5.2")


@exercise("5.3", "minillm.paged.slot_mapping", "slot mapping from a block table",
          "position p: block_ids[p // block_size] * block_size + p % block_size, for p in range(start, end)")
def check_slot_mapping(slot_mapping: Callable) -> None:
    """``slot_mapping(block_ids, start, end, block_size)`` against the library's on hand-made and random tables."""
    from .paged import slot_mapping as reference

    rng = random.Random(0)
    cases = [([7, 2, 9], 0, 12, 4), ([7, 2, 9], 3, 6, 4), ([7, 2, 9], 5, 5, 4), ([7, 2, 9], 11, 12, 4),
             ([3], 0, 16, 16), ([5, 0, 4, 1], 0, 4, 1), ([0, 1, 2], 0, 40, 16)]
    cases += [(rng.sample(range(64), n), s, e, bs) for n, bs in ((5, 16), (9, 4), (3, 2))
              for s, e in [sorted(rng.sample(range(n * bs + 1), 2))]]
    for block_ids, start, end, bs in cases:
        got, expected = slot_mapping(list(block_ids), start, end, bs), reference(block_ids, start, end, bs)
        assert list(got) == expected, (
            f"slot_mapping(block_ids={block_ids}, start={start}, end={end}, block_size={bs}) returned {got!r}, "
            f"expected {expected}: position p lives in physical block block_ids[p // block_size], at offset "
            "p % block_size, and a block is block_size slots wide.")
    _passed("5.3")


def check_prediction(predicted: float, measured: float, *, what: str, tolerance: float = 0.1) -> None:
    """A "predict, then measure" check: ``measured`` within ``tolerance`` (relative, default 10 %) of ``predicted``."""
    assert predicted > 0, f"the prediction of {what} must be positive, got {predicted}"
    err = abs(measured - predicted) / predicted
    assert err <= tolerance, (
        f"predicted {what} {predicted:,.4g}, measured {measured:,.4g} ({err:.1%} off, tolerance {tolerance:.0%}): "
        "recheck the formula behind the prediction.")
    print(f"✓ prediction holds: {what} within {err:.1%} of the measurement")


# --------------------------------------------------------------------------------------------- notebook 06
@exercise("6.1", "minillm.slot_model.batch_slots", "one step of static or continuous batching",
          "retire: slots whose request has remaining 0 become None; admit: pop waiting requests into the empty "
          "slots, lowest index first — every step if continuous, only when all slots are empty if static")
def check_batch_slots(batch_slots: Callable) -> None:
    """``batch_slots(slots, remaining, waiting, policy)`` on hand-made steps (retire, admit order, a static batch
    still running, an empty queue), then whole timelines of ``slot_timeline`` with the student's step."""
    from .slot_model import batch_slots as reference
    from .slot_model import slot_timeline

    cases = [
        ("two requests finished, two waiting", [0, 1, 2], [0, 3, 0, 5, 2], [3, 4], "continuous"),
        ("more empty slots than waiting requests", [None, None, None], [4], [0], "continuous"),
        ("nothing finished: nobody joins", [0, 1], [2, 1, 7], [2], "continuous"),
        ("empty queue", [0, None, 1], [0, 0], [], "continuous"),
        ("the earliest waiting request takes the lowest free slot", [None, 0, None, 1], [5, 0, 3, 3, 3], [4, 2, 3],
         "continuous"),
        ("static: one request of the batch still runs", [0, 1, 2], [0, 4, 0, 6], [3], "static"),
        ("static: the whole batch finished", [0, 1], [0, 0, 3, 3, 3], [2, 3, 4], "static"),
        ("static: the first step", [None, None], [3, 1, 2], [0, 1, 2], "static"),
    ]
    for name, slots, remaining, waiting, policy in cases:
        args = (list(slots), list(remaining), list(waiting))
        got, expected = batch_slots(*args, policy), reference(list(slots), list(remaining), list(waiting), policy)
        call = f"{name}: batch_slots(slots={slots}, remaining={remaining}, waiting={waiting}, policy={policy!r})"
        assert isinstance(got, tuple) and len(got) == 2, f"{call} must return (slots, waiting), got {got!r}"
        assert list(got[0]) == expected[0] and list(got[1]) == expected[1], (
            f"{call} returned {got!r}, expected {expected!r}. Retire first (remaining 0 -> None), then admit "
            "from the front of the queue into empty slots in index order; static admits only into an all-empty "
            "batch.")
        assert args == (slots, remaining, waiting), f"{call} modified its arguments: {args}"
    rng = random.Random(0)
    for _ in range(10):
        lens = [rng.choice([rng.randint(1, 4), rng.randint(10, 20)]) for _ in range(rng.randint(1, 14))]
        for policy in ("continuous", "static"):
            k = rng.randint(1, 4)
            got, expected = slot_timeline(lens, k, policy, step=batch_slots), slot_timeline(lens, k, policy)
            if got != expected:
                i = next(i for i in range(len(got) + 1) if got[i : i + 1] != expected[i : i + 1])
                raise AssertionError(
                    f"slot_timeline({lens}, num_slots={k}, policy={policy!r}) with your step ran {len(got)} steps, "
                    f"expected {len(expected)}; first difference at step {i}: your slots {got[i : i + 1]}, expected "
                    f"{expected[i : i + 1]}.")
    _passed("6.1")


@exercise("6.2", "minillm.scheduler.prefill_chunk_len", "the chunked-prefill budget",
          "as many tokens as the budget leaves; without chunked_prefill a prompt that does not fit whole gets 0 — "
          "unless it is longer than max_num_batched_tokens and the budget is untouched (== max_num_batched_tokens)")
def check_prefill_chunk_len(prefill_chunk_len: Callable) -> None:
    """``prefill_chunk_len(remaining, budget, max_num_batched_tokens, chunked_prefill)`` on every combination of
    small sizes, chunked and not."""
    from .scheduler import prefill_chunk_len as reference

    for max_tokens in (1, 8, 16):
        for chunked in (True, False):
            for budget in range(max_tokens + 1):
                for remaining in range(1, 2 * max_tokens + 3):
                    got = prefill_chunk_len(remaining, budget, max_tokens, chunked)
                    expected = reference(remaining, budget, max_tokens, chunked)
                    if got == expected:
                        continue
                    if chunked:
                        why = "with chunked prefill a sequence takes as many tokens as the budget leaves"
                    elif remaining <= budget:
                        why = "it fits the budget left, so it runs whole"
                    elif remaining <= max_tokens:
                        why = ("without chunked prefill a prompt runs whole or waits; it fits a whole step, so it "
                               "waits for a step with enough budget")
                    elif budget == max_tokens:
                        why = ("it is longer than a whole step's budget, so unsplit it could never run: from a "
                               "fresh budget it is split anyway")
                    else:
                        why = "an over-long sequence is split only from a fresh budget; this one is partly spent"
                    raise AssertionError(
                        f"prefill_chunk_len(remaining={remaining}, budget={budget}, max_num_batched_tokens="
                        f"{max_tokens}, chunked_prefill={chunked}) returned {got!r}, expected {expected}: {why}.")
    _passed("6.2")
