"""Checkers of notebook 02: the KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch

from minillm.config import ModelConfig
from minillm.course.checks.registry import CONFIGS, LLAMA2_7B, _passed, exercise
from minillm.course.checks.roofline import prediction_checker


@exercise("2.1", "minillm.kv.contiguous.kv_bytes_per_token", "KV-cache bytes per token",
          "K and V, for every layer and every KV head, head_dim elements of the dtype's size")
def check_kv_bytes_per_token(kv_bytes_per_token: Callable) -> None:
    """``kv_bytes_per_token(config, dtype)`` exactly, for MHA, GQA and MQA models in three dtypes."""
    def reference(config, dtype):  # K and V, per layer, per K/V head, head_dim elements
        size = torch.empty(0, dtype=dtype).element_size()
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * size

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


@exercise("2.2", "minillm.kv.contiguous.KVCache.update", "write K/V into the cache",
          "each row's new K/V go to the slots its own positions name, in this layer only; return what the "
          "attention needs to read, no more (begin() set what is used and the mask)")
def check_kv_cache_update(cache_class: type) -> None:
    """A ``KVCache`` subclass with the student's ``update`` against the library's, on prefill and decode steps.

    After every call the returned K, V and mask, and the whole cache contents, must equal the reference's.
    """
    from minillm.kv.contiguous import KVCache

    class Reference(KVCache):  # the library's cache with the checker's own update (never the fenced one)
        def update(self, layer, k, v):
            pos = self._positions
            for b in range(pos.shape[0]):  # row b's tokens go to its own slots, one row at a time
                self.k[layer][b, :, pos[b]] = k[b]
                self.v[layer][b, :, pos[b]] = v[b]
            return self.k[layer][:, :, : self._used], self.v[layer][:, :, : self._used], self._mask

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


def _reference_cached_attention(q, k, v, positions, scale):
    """The checker's own answer in fp64, one query at a time: position p reads slots 0..p of its row's K/V head."""
    B, Hq, L, D = q.shape
    G = Hq // k.shape[1]
    out = torch.empty(B, Hq, L, D, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            for i in range(L):
                p = int(positions[b, i])
                keys, values = k[b, h // G, : p + 1].double(), v[b, h // G, : p + 1].double()  # (p + 1, D)
                weights = ((keys @ q[b, h, i].double()) * scale).softmax(0)  # (p + 1,)
                out[b, h, i] = weights @ values
    return out


@exercise("2.3", "minillm.kv.contiguous.cached_attention", "attention of one step over the cache",
          "a query at position p sees slots 0..p of its own row, whatever the other slots hold (optional hints "
          "below the exercise)")
def check_cached_attention(cached_attention: Callable) -> None:
    """``cached_attention(q, k, v, positions, scale=)`` against a one-query-at-a-time fp64 reference: decode of
    one sequence and of rows of different lengths (stale slots past a short row's end hold large values that
    must not leak in), a prefill chunk after a cached prefix (the causal offset), a first chunk, chunks at
    different offsets in one batch; MHA, GQA and MQA heads; a bf16 case (output in q's dtype)."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs each run
    cases = [  # name, (H_q, H_kv, D), positions [B, L], dtype
        ("decode, one sequence, multi-head", (4, 4, 8), [[6]], torch.float32),
        ("decode, three rows of different lengths (grouped heads)", (6, 2, 8), [[8], [3], [0]], torch.float32),
        ("a prefill chunk of 4 tokens after 5 cached ones (the causal offset)", (4, 2, 8), [[5, 6, 7, 8]],
         torch.float32),
        ("the first chunk of two prompts, multi-query", (4, 1, 16), [[0, 1, 2, 3, 4]] * 2, torch.float32),
        ("chunks of 3 at different offsets in one batch", (6, 3, 4), [[2, 3, 4], [6, 7, 8]], torch.float32),
        ("decode and a chunk in bfloat16", (4, 2, 8), [[4, 5]], torch.bfloat16),
    ]
    for name, (Hq, Hkv, D), pos, dtype in cases:
        positions = torch.tensor(pos)
        B, L = positions.shape
        S = int(positions.max()) + 1
        q = torch.randn(B, Hq, L, D, generator=g)
        k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
        for b in range(B):  # slots past a row's last position: stale data from a longer row, never to be read
            k[b, :, int(positions[b].max()) + 1 :] = 30.0
            v[b, :, int(positions[b].max()) + 1 :] = 1e3
        scale = D**-0.5 if "offset" not in name else 0.3
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        got = cached_attention(q.clone(), k.clone(), v.clone(), positions.clone(), scale=scale)
        expected = _reference_cached_attention(q, k, v, positions, scale).to(dtype)
        where = (f"{name}: q {tuple(q.shape)}, k/v {tuple(k.shape)} ({dtype}), positions {pos}, scale {scale:.3g}")
        assert isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == dtype, (
            f"{where}: returned "
            f"{f'{tuple(got.shape)} {got.dtype}' if isinstance(got, torch.Tensor) else type(got).__name__}, "
            f"expected a {dtype} tensor of shape {tuple(expected.shape)} = [B, H_q, L, D].")
        # bf16: the probabilities may be rounded to bf16 before multiplying V (as the library does): outputs near
        # 0 then carry absolute errors of ~1e-3, beyond assert_close's bf16 atol of 1e-5
        tol = {"rtol": 1.6e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(got, expected, **tol, msg=lambda m, where=where: (
            f"{where}: the output differs from the expected one. The query at position p sees slots 0..p of its "
            f"own row (not the last L slots of the cache: rows end at different places); query head h reads K/V "
            f"head h // (H_q / H_kv); the scores are multiplied by scale. {m}"))
    _passed("2.3")


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


check_prediction_step = prediction_checker(
    "2.0", "prediction_step", "minillm.course.predictions.predict_decode_step_ms",
    "the decode step over the longest cache", "ms", kind="floor")
