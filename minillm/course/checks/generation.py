"""Checkers of notebook 01: prefill and decode."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

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


def _hf_llama(seed: int, **overrides):
    """A small random transformers ``LlamaForCausalLM`` (fp32, GQA 4 → 2 heads) and minillm's model built from
    its weights with the reference kernels ("torch"): the pair the model-level checks compare."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from minillm.config import ModelConfig
    from minillm.models.loader import build_model

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, **overrides})
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a norm that forgets its weight is seen
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    ours = build_model(ModelConfig.from_hf(cfg), hf.state_dict(), dtype=torch.float32, device="cpu",
                       kernels="torch")
    return hf, ours


@torch.inference_mode()
def _logits_with(ours, hf, swap: dict[str, Callable], where: str, hint: str) -> None:
    """minillm's forward with the ops in ``swap`` replaced by the student's equals transformers' logits (fp32)."""
    import dataclasses

    ops = dataclasses.replace(ours.kernel_ops(), **swap)
    ours.kernel_ops = lambda: ops  # this instance only: every layer then calls the student's function
    ids = torch.randint(0, hf.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(11)[None].expand(2, -1) + torch.tensor([[0], [37]])  # the second row starts at 37
    got = ours(ids, positions)
    expected = hf(input_ids=ids, position_ids=positions).logits
    torch.testing.assert_close(got.float(), expected, rtol=1e-4, atol=1e-4, msg=lambda m: (
        f"{where}: minillm's logits with your function inside every layer differ from transformers' "
        f"LlamaForCausalLM logits (2 sequences of 11 tokens, the second at positions 37..47). {hint} {m}"))


@exercise("1.3", "minillm.kernels.select.torch_rms_norm", "RMSNorm",
          "mean of squares over the last axis in fp32, eps inside the square root, round to x's dtype, then "
          "multiply by the weight")
def check_rms_norm(rms_norm: Callable) -> None:
    """``rms_norm(x, weight, eps)`` against transformers' ``LlamaRMSNorm`` module on fp32, bf16 and fp16 rows
    (tiny activations where eps matters, rows of one element, 1-D and 3-D inputs), then minillm's model with it
    as every norm (the fused residual add included) against transformers' logits."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    cases = [  # name, x shape, dtype, x scale, eps
        ("fp32 rows", (3, 5, 64), torch.float32, 1.0, 1e-5),
        ("tiny activations: eps is comparable to mean(x²)", (4, 32), torch.float32, 1e-3, 1e-5),
        ("one vector", (48,), torch.float32, 3.0, 1e-6),
        ("rows of one element", (5, 1), torch.float32, 2.0, 1e-5),
        ("bf16 storage: fp32 statistics, rounded before the weight", (2, 7, 64), torch.bfloat16, 1.0, 1e-5),
        ("fp16 storage, large activations (x² overflows fp16)", (3, 64), torch.float16, 300.0, 1e-5),
    ]
    for name, shape, dtype, scale, eps in cases:
        K = shape[-1]
        x = (torch.randn(shape, generator=gen) * scale).to(dtype)
        norm = LlamaRMSNorm(K, eps=eps).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(K, generator=gen) + 0.5)
            expected = norm(x.clone())
        got = rms_norm(x.clone(), norm.weight.detach().clone(), eps)
        where = f"{name}: x {tuple(shape)} {dtype}, eps {eps}"
        assert isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == expected.dtype, (
            f"{where}: returned {tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__} "
            f"{getattr(got, 'dtype', '')}, expected shape {tuple(expected.shape)} in {expected.dtype}.")
        tol = {} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
        torch.testing.assert_close(got, expected, **tol, msg=lambda m, where=where: (
            f"{where}: differs from transformers' LlamaRMSNorm. x / sqrt(mean(x²) + eps) * weight, the mean over "
            f"the last axis, computed in fp32; eps inside the square root. {m}"))
    hf, ours = _hf_llama(gen.initial_seed() % 1000)

    def add_rms_norm(x, residual, weight, eps):
        r = x + residual
        return rms_norm(r, weight, eps), r

    _logits_with(ours, hf, {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm}, "the model",
                 "Every norm of the model is yours here (two per layer and the final one).")
    _passed("1.3")


@exercise("1.4", "minillm.layers.rotary.apply_rope", "rotary position embeddings (RoPE)",
          "rotate half: pair x_i with x_{i+D/2}, i < D/2 (not neighbours x_0, x_1), and rotate each pair by "
          "the angle whose cos and sin are given")
def check_apply_rope(apply_rope: Callable) -> None:
    """``apply_rope(x [B, L, H, D], cos, sin [B, L, 1, D])`` against transformers' ``apply_rotary_pos_emb`` with
    the cos/sin of its own ``LlamaRotaryEmbedding`` (positions that do not start at 0, several heads, D = 8 and
    64, a llama3-scaled table), the relative-position property q·k, then minillm's model with it in every layer
    against transformers' logits."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    cases = [  # name, (B, L, H, D), first position, rope_scaling
        ("positions 0..5, one head", (1, 6, 1, 8), 0, None),
        ("two rows, positions from 100, 5 heads, D = 64", (2, 4, 5, 64), 100, None),
        ("a llama3-scaled frequency table", (1, 3, 2, 16), 3000, {"rope_type": "llama3", "factor": 8.0,
         "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 512}),
    ]
    for name, (B, L, H, D), start, scaling in cases:
        cfg = LlamaConfig(hidden_size=H * D, num_attention_heads=H, head_dim=D, max_position_embeddings=8192,
                          rope_scaling=scaling)
        positions = torch.arange(start, start + L)[None].expand(B, -1) + torch.arange(B)[:, None] * 7
        x = torch.randn(B, L, H, D, generator=gen)
        cos, sin = LlamaRotaryEmbedding(cfg)(x, positions)  # [B, L, D]
        expected, _ = apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)  # [B, H, L, D]
        got = apply_rope(x.clone(), cos[:, :, None].clone(), sin[:, :, None].clone())
        where = f"{name}: x {tuple(x.shape)} = [B, L, H, D], positions {positions[0].tolist()}"
        assert isinstance(got, torch.Tensor) and got.shape == x.shape, (
            f"{where}: returned {tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}, "
            f"expected shape {tuple(x.shape)}.")
        torch.testing.assert_close(got, expected.transpose(1, 2), msg=lambda m, where=where: (
            f"{where}: differs from transformers' apply_rotary_pos_emb. Pair x_i with x_(i+D/2) (rotate half): "
            f"out_i = x_i·cos − x_(i+D/2)·sin, out_(i+D/2) = x_(i+D/2)·cos + x_i·sin. {m}"))
    # q·k after rotation depends on the positions' difference only: (7, 3) and (107, 103) score the same
    cfg = LlamaConfig(hidden_size=32, num_attention_heads=1, head_dim=32)
    q, k = torch.randn(1, 1, 1, 32, generator=gen), torch.randn(1, 1, 1, 32, generator=gen)
    scores = []
    for pq, pk in [(7, 3), (107, 103)]:
        cq, sq = LlamaRotaryEmbedding(cfg)(q[:, :, 0], torch.tensor([[pq]]))
        ck, sk = LlamaRotaryEmbedding(cfg)(k[:, :, 0], torch.tensor([[pk]]))
        scores.append(float((apply_rope(q, cq[:, :, None], sq[:, :, None]) *
                             apply_rope(k, ck[:, :, None], sk[:, :, None])).sum()))
    assert abs(scores[0] - scores[1]) <= 1e-3 * max(1.0, abs(scores[0])), (
        f"q·k after your rotation at positions (7, 3) is {scores[0]:.5f} and at (107, 103) {scores[1]:.5f}, "
        "expected the same score: a rotation by angles proportional to the position keeps only their difference.")
    hf, ours = _hf_llama(gen.initial_seed() % 1000)
    _logits_with(ours, hf, {"rope": apply_rope}, "the model", "RoPE here is yours, on q and k of every layer.")
    _passed("1.4")


def _expected_keep(logits: list[float], k: int, p: float) -> list[bool]:
    """The checker's own top-k then top-p keep set for one row of logits (plain Python, ties by lower index)."""
    V = len(logits)
    order = sorted(range(V), key=lambda i: (-logits[i], i))
    kept = order[:k] if 0 < k < V else order
    kept = [i for i in kept if logits[i] != float("-inf")] or kept[:1]
    if p < 1.0:
        top = max(logits[i] for i in kept)
        weights = [math.exp(logits[i] - top) for i in kept]
        total, mass, nucleus = sum(weights), 0.0, []
        for i, w in zip(kept, weights, strict=True):
            if nucleus and mass >= p:
                break
            nucleus.append(i)
            mass += w / total
        kept = nucleus
    keep = set(kept)
    return [i in keep for i in range(V)]


@exercise("1.6", "minillm.sampling.sampler.top_k_top_p_mask", "top-k and top-p (nucleus) filtering",
          "sort each row once, descending and stable; keep the first k; over the softmax of those, keep a token "
          "while the mass before it is < p; -inf everything else, the kept logits untouched")
def check_top_k_top_p_mask(top_k_top_p_mask: Callable) -> None:
    """``top_k_top_p_mask(logits, k, p)``: the exact kept set on hand-made rows (ties at the k-th value and inside
    the nucleus, top-p over the distribution top-k renormalised, k and p off, logits already -inf, a batch of rows
    of different shapes), the kept logits unchanged; then the engine's sampler (``sampling.sampler.sample``) runs
    with your filter and a seeded sample of its tokens must follow the target distribution restricted to the kept
    set and renormalised (Pearson's chi-square at 1e-5)."""
    from minillm.course.checks.speculative import _chi_square_failure
    from minillm.sampling import sampler
    from minillm.sampling.params import SamplingParams

    log = math.log
    four = [log(0.4), log(0.3), log(0.2), log(0.1)]
    cases = [  # name, logits rows, k, p
        ("top-k alone", [[2.0, 1.0, 3.0, 0.5, 0.0]], 2, 1.0),
        ("a tie at the k-th value: the lower index wins", [[2.0, 1.0, 3.0, 1.0, 0.0]], 3, 1.0),
        ("k = 0 and p = 1: filtering off", [[2.0, 1.0, 3.0, 1.0, 0.0]], 0, 1.0),
        ("k ≥ V: top-k off", [[2.0, 1.0, 3.0]], 5, 1.0),
        ("top-p alone: the token that crosses p is kept", [[log(0.1), log(0.4), log(0.2), log(0.3)]], 0, 0.5),
        ("top-p so small only the most likely token survives", [four], 0, 0.01),
        ("top-p over what top-k kept, renormalised (0.4 / 0.7 ≥ 0.5: one token)", [four], 2, 0.5),
        ("top-k first, then top-p (0.4 + 0.3 over 0.9 ≥ 0.75: two tokens; p first would keep three)", [four], 3,
         0.75),
        ("equal probabilities inside the nucleus: lower indices first", [[0.0, 0.0, 0.0, 0.0]], 0, 0.3),
        ("logits already -inf stay out", [[1.0, float("-inf"), 0.5, float("-inf"), 0.2]], 4, 1.0),
        ("a batch of rows, each filtered on its own", [[0.1, 2.0, 0.3, 1.0], [5.0, -1.0, 4.9, 0.0],
                                                       [0.0, 0.0, 0.0, 0.0]], 2, 0.9),
    ]
    for name, rows, k, p in cases:
        logits = torch.tensor(rows)
        got = top_k_top_p_mask(logits.clone(), k, p)
        where = f"{name}: top_k_top_p_mask(logits={[[round(v, 3) for v in r] for r in rows]}, k={k}, p={p})"
        assert isinstance(got, torch.Tensor) and got.shape == logits.shape, (
            f"{where}: returned {tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}, "
            f"expected shape {tuple(logits.shape)}.")
        for r, row in enumerate(rows):
            keep = _expected_keep(row, k, p)
            mask = got[r] != float("-inf")
            kept = [i for i, x in enumerate(keep) if x]
            assert mask.tolist() == keep, (
                f"{where}, row {r}: kept tokens {mask.nonzero().flatten().tolist()}, expected {kept}. Top-k keeps "
                "exactly k (ties: lower index), top-p then keeps a token while the mass before it, in the "
                "renormalised top-k distribution, is < p.")
            assert torch.equal(got[r][mask], logits[r][mask]), (
                f"{where}, row {r}: the kept logits changed to {got[r][mask].tolist()}, expected them untouched "
                f"{logits[r][mask].tolist()}: softmax renormalises the kept set by itself.")
    # the engine's sampler with the student's filter: a seeded sample must follow the filtered distribution
    logits = torch.tensor([[1.2, 0.3, 2.0, -0.5, 1.9, 0.0, 2.0, -2.0, 0.8, 1.0]])
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.8, seed=1234)
    scaled = [x / params.temperature for x in logits[0].tolist()]
    keep = _expected_keep(scaled, params.top_k, params.top_p)
    weights = [math.exp(x) if kept else 0.0 for x, kept in zip(scaled, keep, strict=True)]
    target = [w / sum(weights) for w in weights]
    n = 3000
    generator = torch.Generator().manual_seed(params.seed)
    library = sampler.top_k_top_p_mask
    sampler.top_k_top_p_mask = top_k_top_p_mask  # the engine's probabilities() now filters with yours
    try:
        tokens = sampler.sample(logits.expand(n, -1).contiguous(), [params] * n, [generator] * n)
    finally:
        sampler.top_k_top_p_mask = library
    counts = [tokens.count(t) for t in range(logits.shape[1])]
    why = _chi_square_failure(counts, target)
    assert why is None, (
        f"{n} tokens sampled by the engine's sampler with your filter (temperature {params.temperature}, top_k "
        f"{params.top_k}, top_p {params.top_p}): counts {counts}, expected about "
        f"{[round(t * n) for t in target]} (the distribution restricted to the kept set, renormalised): {why}.")
    _passed("1.6")


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
