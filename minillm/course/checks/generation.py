"""Checkers of notebook 01: prefill and decode."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from types import SimpleNamespace

import torch

from minillm.course.checks.registry import CONFIGS, _close, _passed, exercise
from minillm.course.checks.roofline import prediction_checker


@exercise("1.1", "minillm.perf.metrics.decode_weight_bytes", "weight bytes read per decode step",
          "every linear and norm weight once, the LM head in full, the embedding table not at all; × bytes per element")
def check_decode_weight_bytes(decode_weight_bytes: Callable) -> None:
    """``decode_weight_bytes(config, dtype)`` within 0.5 % of the reference (tied and untied embeddings)."""
    def reference(config, dtype):  # the checker's own count, from the config's shapes
        c, size = config, torch.empty(0, dtype=dtype).element_size()
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
        layer += 2 * c.hidden_size  # two RMSNorm weights
        return size * (c.num_layers * layer + c.hidden_size + c.vocab_size * c.hidden_size)

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


@exercise("1.2", "minillm.perf.metrics.percentile", "percentile with linear interpolation",
          "sort, then interpolate between the values at floor and ceil of q/100 × (n − 1)")
def check_percentile(percentile: Callable) -> None:
    """``percentile(values, q)`` against the reference on hand-made and random inputs."""
    def reference(values, q):
        xs = sorted(values)
        pos = q / 100 * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

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


@exercise("1.3", "minillm.perf.metrics.goodput", "goodput under a latency SLO",
          "count the requests with ttft_s <= ttft_slo_s and tpot_s <= tpot_slo_s, divide by duration_s")
def check_goodput(goodput: Callable) -> None:
    """``goodput(requests, duration_s, ttft_slo_s=, tpot_slo_s=)`` on requests just inside/outside each limit."""
    def reference(requests, duration, ttft_slo_s=0.2, tpot_slo_s=0.1):
        return sum(r.ttft_s <= ttft_slo_s and r.tpot_s <= tpot_slo_s for r in requests) / duration

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


@exercise("1.4", "minillm.perf.metrics.cost_per_million_tokens", "dollars per million tokens",
          "tokens per hour = tokens_per_s × 3600; price per token = dollars_per_hour / tokens per hour")
def check_cost_per_million_tokens(cost_per_million_tokens: Callable) -> None:
    """``cost_per_million_tokens($/h, tok/s)``: the $2/h at 100 tok/s ≈ $5.56 example and others."""
    def reference(dollars, tps):
        return dollars / (tps * 3600) * 1e6

    for dollars, tps in [(2.0, 100.0), (0.0, 50.0), (3.5, 1000.0), (40.0, 2500.0), (1.0, 0.5)]:
        got = cost_per_million_tokens(dollars, tps)
        expected = reference(dollars, tps)
        assert _close(got, expected), (
            f"cost_per_million_tokens({dollars} $/h, {tps} tok/s) returned {got!r}, expected ${expected:.4f} "
            "per 1M tokens.")
    _passed("1.4")


def check_roofline_prediction(predicted: float, measured: float, *, what: str = "decode tokens/s",
                              device: str = "cpu", upper: float = 1.25, see: str = "") -> float:
    """Place a measured rate against the roofline bound ``predicted`` and say honestly what the gap means.

    A bound cannot be beaten: ``measured`` may exceed ``predicted`` by ``upper`` − 1 (25 %: bandwidth and speed are
    measured at different moments, on a machine that may be shared); past that a ⚠ line says the roof was probably
    measured on a busy machine, or the cost model counts the wrong bytes — printed, not raised: noise must not fail
    a notebook.  Below the bound nothing passes or fails: the verdict reports the fraction reached
    (≥ 80 % bandwidth bound, 50–80 % mostly so, < 50 % overhead dominates; ``see`` points at the explanation).
    On a GPU a small model at batch 1 pays ~5 µs of launch overhead for each of hundreds of kernels per step.
    Returns the fraction of the bound reached.
    """
    from minillm.course.checks.roofline import beyond_bound_note, gap_verdict

    assert predicted > 0 and measured > 0, f"need positive rates, got predicted={predicted}, measured={measured}"
    ratio = measured / predicted
    if ratio > upper:
        print(beyond_bound_note(what, f"{measured:.4g}", f"the predicted bound {predicted:.4g}", ratio - 1).strip())
    why = gap_verdict(ratio)
    if ratio < 0.5 and str(device).startswith("cuda"):
        why += " (kernel launches: hundreds per step at ~5 µs each)"
    print(f"measured {what} at {ratio:.0%} of the roofline bound: {why}" + (f" — {see}" if see else ""))
    return ratio


def _tiny_model(seed: int):
    """A 2-layer random Llama (vocab 64, GQA 4 → 2 heads) with lively logits, fp32 on CPU."""
    from minillm.config import ModelConfig
    from minillm.models.llama import Transformer

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=40)
    model = Transformer(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.set_kernels("torch")


@torch.inference_mode()
def _reference_generation(model, prompt: list[int], params, eos: frozenset[int]) -> tuple[list[int], str]:
    """The checker's own loop, one request at a time, full forward every step: (tokens, finish reason)."""
    from minillm.sampling.sampler import make_generator, sample

    gen, out = make_generator(params), []
    while True:
        ids = torch.tensor([prompt + out])
        logits = model(ids, torch.arange(ids.shape[1])[None])[:, -1].float()  # (1, V): the last token's
        token = sample(logits, [params], [gen])[0]
        out.append(token)
        if token in eos and not params.ignore_eos:
            return out, "stop"
        if len(out) >= params.max_tokens or len(prompt) + len(out) >= model.config.max_position_embeddings:
            return out, "length"


@exercise("1.5", "minillm.engine.simple.stream_naive", "the generation loop: prefill, decode, sample",
          "one forward per step over the unfinished requests; each row's next token comes from its own last real "
          "position, not from the padding")
def check_generation_loop(stream_naive: Callable) -> None:
    """``stream_naive(model, prompts, params, eos_ids)`` on a small random model against the checker's own
    one-request-at-a-time loop: prompts of different lengths (padding), greedy and seeded sampling side by side,
    an EOS that stops one request early (and one that ignores it), max_tokens = 1, a request that reaches the
    context length; the yielded tokens, their order, and the returned states must match."""
    from minillm.sampling.params import SamplingParams

    model = _tiny_model(torch.seed() % 2**31)
    rng = random.Random()
    greedy = SamplingParams(max_tokens=6, temperature=0)
    first_token = _reference_generation(model, [5, 9, 2], greedy, frozenset())[0]
    cases = [
        ("one prompt, greedy", [[5, 9, 2]], [greedy], ()),
        ("prompts of different lengths (1, 7 and 3 tokens), greedy: rows are right-padded",
         [[3], [rng.randrange(64) for _ in range(7)], [11, 12, 13]], [greedy] * 3, ()),
        ("seeded sampling beside greedy, different lengths",
         [[1, 2, 3, 4, 5], [7, 8]], [SamplingParams(max_tokens=5, temperature=1.0, seed=rng.randrange(1000)),
                                     SamplingParams(max_tokens=7, temperature=0)], ()),
        ("an EOS token stops the first request; the second ignores it",
         [[5, 9, 2], [5, 9, 2]], [greedy, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)],
         (first_token[1],)),
        ("max_tokens = 1: only the prefill's token", [[4, 4, 4], [9]],
         [SamplingParams(max_tokens=1, temperature=0)] * 2, ()),
        ("a request that runs into the context length (40 positions)", [list(range(1, 37)), [2]],
         [SamplingParams(max_tokens=20, temperature=0)] * 2, ()),
    ]
    for name, prompts, params, eos in cases:
        loop = stream_naive(model, [list(p) for p in prompts], list(params), list(eos))
        yielded = []
        while True:
            try:
                yielded.append(next(loop))
            except StopIteration as done:
                states = done.value
                break
        where = f"{name}: prompts {prompts}, eos_ids {list(eos)}"
        expected = [_reference_generation(model, p, sp, frozenset(eos)) for p, sp in zip(prompts, params, strict=True)]
        assert isinstance(states, list) and len(states) == len(prompts), (
            f"{where}: the loop must end by returning the list of final SequenceStates (one per prompt), got "
            f"{type(states).__name__}")
        for r, (tokens, reason) in enumerate(expected):
            got = list(states[r].output)
            assert got == tokens, (
                f"{where}: request {r} generated {got}, expected {tokens}. Take each row's logits at its own last "
                "real token (shorter prompts are right-padded), sample with that request's params and generator, "
                "and stop a request as soon as _append says it is done.")
            assert states[r].finish_reason == reason, (
                f"{where}: request {r} finished with {states[r].finish_reason!r}, expected {reason!r}")
        streamed = {r: [t for u in yielded if u.request_id == str(r) for t in u.token_ids] for r in range(len(prompts))}
        assert all(streamed[r] == expected[r][0] for r in streamed), (
            f"{where}: the yielded StepOutputs carry {streamed}, expected each request's tokens in order "
            f"{ {r: e[0] for r, e in enumerate(expected)} }: yield every token as it is produced.")
    _passed("1.5")


check_prediction_decode = prediction_checker(
    "1.0", "prediction_decode", "minillm.course.predictions.predict_decode_tok_s",
    "decode tokens/s at batch 1", "tokens/s")
