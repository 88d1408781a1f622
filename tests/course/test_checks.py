"""Every exercise's checker: the stub fails it with its own NotImplementedError, the solution passes it, a
plausible wrong answer fails it with an AssertionError that says what went wrong."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch

from minillm.course import checks
from minillm.course.checks import EXERCISES, Exercise
from minillm.kv.contiguous import KVCache

ROOT = Path(__file__).resolve().parents[2]


def _load_build():
    """course/build.py as module ``course_build`` (registered first: its dataclasses look themselves up)."""
    if "course_build" not in sys.modules:
        spec = importlib.util.spec_from_file_location("course_build", ROOT / "course" / "build.py")
        sys.modules["course_build"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["course_build"]


build = _load_build()


def rendered(ex: Exercise, student: bool):
    """Execute the cell the build renders for ``ex`` (as a notebook would) and return what it defines."""
    namespace = dict(vars(importlib.import_module(ex.module)))  # the module's imports, as the notebook has them
    exec(compile(build.render_exercise(ex, student=student), f"<exercise {ex.number}>", "exec"), namespace)
    parts = ex.qualname.split(".")
    return namespace[f"My{parts[0]}"] if len(parts) == 2 else namespace[parts[0]]


# --- wrong answers a student might plausibly write; each must fail its checker with AssertionError ---------------
def _wrong_linear_cost(M, K, N, dtype, *, weight_dtype=None, bias=False):
    from minillm.perf.hardware import dtype_bytes
    from minillm.perf.roofline import Cost

    a, w = dtype_bytes(dtype), dtype_bytes(dtype if weight_dtype is None else weight_dtype)
    flops = M * K * N  # one FLOP per multiply-add instead of two
    weights, acts = K * N * w, (M * K + M * N) * a
    return Cost(flops, weights + acts, {"weights": weights, "activations": acts}, {"linear": flops})


def _wrong_ridge_point(spec, dtype):
    return spec.memory_bandwidth / spec.peak(dtype)  # upside down: bytes per FLOP


def _wrong_attainable_flops(spec, intensity, dtype):
    return intensity * spec.memory_bandwidth  # forgot the compute roof


def _wrong_mbu(bytes_per_step, steps_per_s, bandwidth):
    bw = getattr(bandwidth, "memory_bandwidth", bandwidth)
    return 100 * bytes_per_step * steps_per_s / bw  # a percentage, not a fraction


def _wrong_decode_weight_bytes(config, dtype=torch.float16):
    return config.num_parameters() * dtype.itemsize  # counts the (untied) embedding table


def _wrong_percentile(values, q):
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]  # nearest rank, no interpolation


def _wrong_goodput(requests, duration_s, *, ttft_slo_s=0.2, tpot_slo_s=0.1):
    return sum(1 for r in requests if r.ttft_s < ttft_slo_s and r.tpot_s < tpot_slo_s) / duration_s  # strict <


def _wrong_cost(dollars_per_hour, tokens_per_s):
    return dollars_per_hour / tokens_per_s * 1_000_000  # forgot seconds → hours


def _wrong_kv_bytes(config, dtype=torch.float16):
    return 2 * config.num_layers * config.num_heads * config.head_dim * dtype.itemsize  # H_q


class _WrongKVCache(KVCache):
    """Writes every row at row 0's positions: right for one sequence, wrong for a batch of different lengths."""

    def update(self, layer, k, v):
        pos = self._positions
        start = int(pos[0, 0])
        self.k[layer][:, :, start : start + k.shape[2]] = k
        self.v[layer][:, :, start : start + v.shape[2]] = v
        return self.k[layer][:, :, : self._used], self.v[layer][:, :, : self._used], self._mask


WRONG = {"1.1": _wrong_decode_weight_bytes, "1.2": _wrong_percentile, "1.3": _wrong_goodput, "1.4": _wrong_cost,
         "2.1": _wrong_kv_bytes, "2.2": _WrongKVCache}
WRONG.update({"0.1": _wrong_linear_cost, "0.2": _wrong_ridge_point, "0.3": _wrong_attainable_flops,
              "0.4": _wrong_mbu})  # notebook 00


def _wrong_kv_bytes_gqa(config, num_kv_heads, bytes_per_elem=2):
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * bytes_per_elem  # the model's H_kv


def _wrong_grouped_attention(q, k, v, mask=None, *, causal=False, scale=None):
    from minillm.kernels.reference import grouped_attention

    G = q.shape[1] // k.shape[1]  # right values, but K/V copied for every query head: G× the bytes
    return grouped_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), mask, causal=causal,
                             scale=scale)


def _wrong_merge(m, den, o):
    return o.sum(-2) / den.sum(-1)[..., None]  # adds splits summed under different maxima


def _wrong_flash_tile_step(m, den, acc, q, k_tile, v_tile, scale):
    s = (q.float() @ k_tile.float().transpose(-1, -2)) * scale
    m_new = torch.maximum(m, s.amax(-1))
    p = torch.exp(s - m_new[..., None])
    return m_new, den * torch.exp(m - m_new) + p.sum(-1), acc + p @ v_tile.float()  # acc not rescaled


WRONG.update({"3.1": _wrong_kv_bytes_gqa, "3.2": _wrong_grouped_attention, "4.1": _wrong_merge,
              "4.2": _wrong_flash_tile_step})  # notebooks 03 and 04


from minillm.kv.block_allocator import BlockAllocator  # noqa: E402
from minillm.kv.block_manager import BlockManager  # noqa: E402  (notebooks 05 and 06)


class _WrongBlockAllocator(BlockAllocator):
    """Sends every released block to the free list: a cached prefix is forgotten as soon as nobody uses it."""

    def free(self, block_id):
        self._check(block_id)
        if self._ref[block_id] == 0:
            raise RuntimeError(f"double free of block {block_id}")
        self._ref[block_id] -= 1
        if self._ref[block_id] == 0:
            self._free.append(block_id)


class _WrongBlockManager(BlockManager):
    """Appends without copy-on-write: a forked child writes into the partial block its parent still reads."""

    def append_slots(self, seq_id, token_ids):
        table = self._table(seq_id)
        for token in token_ids:
            if len(table.token_ids) % self.block_size == 0:
                table.block_ids.append(self.device.allocate())
            table.token_ids.append(token)
        return []


def _wrong_slot_mapping(block_ids, start, end, block_size):
    return [block_ids[p // block_size] + p % block_size for p in range(start, end)]  # block id not × block_size


def _wrong_batch_slots(slots, remaining, waiting, policy="continuous"):
    slots = [r if r is not None and remaining[r] > 0 else None for r in slots]
    waiting = list(waiting)
    for i, r in enumerate(slots):  # admits into any free slot, whatever the policy: static becomes continuous
        if r is None and waiting:
            slots[i] = waiting.pop(0)
    return slots, waiting


def _wrong_prefill_chunk_len(remaining, budget, max_num_batched_tokens, chunked_prefill=True):
    n = min(remaining, budget)
    return n if chunked_prefill or n == remaining else 0  # an over-long re-prefill would never run unchunked


WRONG.update({"5.1": _WrongBlockAllocator, "5.2": _WrongBlockManager, "5.3": _wrong_slot_mapping,
              "6.1": _wrong_batch_slots, "6.2": _wrong_prefill_chunk_len})  # notebooks 05 and 06
def _wrong_arrival_times(n, rate, burstiness=1.0, seed=0):
    import random

    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):  # gamma scale 1 / rate: right for Poisson, but a mean gap of burstiness / rate otherwise
        t += rng.gammavariate(burstiness, 1.0 / rate) if rate != float("inf") else 0.0
        times.append(t)
    return times


def _wrong_parse_stream(sent_s, lines, end_s):
    from minillm.perf.bench.serve import RequestResult

    times = [t for t, line in lines if line.startswith("data:") and "[DONE]" not in line]  # every chunk a token
    if not times:
        return RequestResult(200, latency_s=end_s - sent_s, error="no text in the response")
    ttft, n = times[0] - sent_s, len(times)
    itl = [b - a for a, b in zip(times, times[1:], strict=False)]
    return RequestResult(200, ttft_s=ttft, latency_s=end_s - sent_s, output_tokens=n,
                         tpot_s=(end_s - sent_s - ttft) / max(n - 1, 1), itl_s=itl)


WRONG.update({"9.1": _wrong_arrival_times, "9.2": _wrong_parse_stream})  # notebook 09
WRONG.update(__import__("test_checks_scaling").WRONG_10)  # notebook 10 (tests/course/test_checks_scaling.py)
from test_checks_speculative import WRONG_08  # noqa: E402  (notebook 08's wrong answers live beside its tests)

WRONG.update(WRONG_08)


def _wrong_quantize(x, spec):
    from minillm.quant.formats import Quantized, quantize

    ok = quantize(x, spec)  # right scales, codes without the zero point
    return Quantized(torch.clamp(torch.round(x.float() / _expand(ok.scale, x, spec)), spec.qmin, spec.qmax)
                     .to(ok.q.dtype), ok.scale, torch.zeros_like(ok.zero_point), spec)


def _expand(v, x, spec):
    return v.repeat_interleave(spec.group_size, -1) if spec.granularity.value == "group" else v


def _wrong_quantize_int4(w, group_size=32, scale_dtype=torch.float16):
    from minillm.quant.weight import Int4Weight, quantize_int4

    ok = quantize_int4(w, group_size, scale_dtype)  # nibbles swapped: byte j = q[j] << 4 | q[j + 16]
    return Int4Weight((ok.packed << 4) | (ok.packed >> 4), ok.scales, ok.mins, group_size)


def _wrong_int4_linear(x, w4, bias=None):
    N, K = w4.shape  # forgets the group minimum m: w = d · q
    b = w4.packed.view(N, K // 32, 16)
    q = torch.cat([b & 0x0F, b >> 4], dim=-1).view(N, K // w4.group_size, w4.group_size).float()
    return torch.nn.functional.linear(x, (q * w4.scales.float().unsqueeze(-1)).view(N, K).to(x.dtype), bias)


WRONG.update({"7.1": _wrong_quantize, "7.2": _wrong_quantize_int4, "7.3": _wrong_int4_linear})  # notebook 07

NUMBERS = sorted(EXERCISES)


def test_registry_names_its_checkers_and_targets():
    assert NUMBERS, "no exercises registered"
    for number, ex in EXERCISES.items():
        assert ex.check.__name__.startswith("check_") and ex.check.exercise == number
        assert re.fullmatch(r"\d+\.\d+", number)
        assert ex.stub_message.startswith(f"Exercise {number}: ")
        assert ex.reference() is not None


@pytest.mark.parametrize("number", NUMBERS)
def test_each_exercise_has_exactly_one_fence(number):
    ex = EXERCISES[number]
    lines = build.function_source(ex).split("\n")
    begin, end = build.split_fence(lines, ex.target)
    assert end > begin + 1, "the fenced region is empty"


@pytest.mark.parametrize("number", NUMBERS)
def test_stub_raises_its_exercise_and_checker_propagates_it(number):
    ex = EXERCISES[number]
    stub = rendered(ex, student=True)
    with pytest.raises(NotImplementedError, match=rf"^Exercise {re.escape(number)}: "):
        ex.check(stub)


@pytest.mark.parametrize("number", NUMBERS)
def test_stub_keeps_signature_and_docstring(number):
    ex = EXERCISES[number]
    stub, reference = rendered(ex, student=True), ex.reference()
    if inspect.isclass(stub):  # a method exercise: the reference is the method, the stub its class
        stub = getattr(stub, ex.qualname.split(".")[1])
    assert str(inspect.signature(stub)) == str(inspect.signature(reference))
    assert inspect.getdoc(stub) == inspect.getdoc(reference)
    source = build.render_exercise(ex, student=True)
    assert "### BEGIN SOLUTION" not in source and "### END SOLUTION" not in source
    assert source.count('raise NotImplementedError("Exercise') == 1


@pytest.mark.parametrize("number", NUMBERS)
def test_solution_cell_passes_its_checker(number, capsys):
    ex = EXERCISES[number]
    ex.check(rendered(ex, student=False))
    assert f"✓ Exercise {number} passed" in capsys.readouterr().out


@pytest.mark.parametrize("number", NUMBERS)
def test_library_reference_passes_its_checker(number, capsys):
    ex = EXERCISES[number]
    ex.check(ex.answer())
    assert f"✓ Exercise {number} passed" in capsys.readouterr().out


@pytest.mark.parametrize("number", NUMBERS)
def test_wrong_answer_fails_with_a_helpful_assertion(number, capsys):
    ex = EXERCISES[number]
    assert number in WRONG, f"add a plausible wrong answer for exercise {number} to WRONG"
    with pytest.raises(AssertionError) as info:
        ex.check(WRONG[number])
    message = str(info.value)
    assert "expected" in message or "differs" in message, message
    assert "passed" not in capsys.readouterr().out


def test_stub_message_survives_unchanged_through_a_checker():
    ex = EXERCISES["2.1"]
    with pytest.raises(NotImplementedError) as info:
        ex.check(rendered(ex, student=True))
    assert str(info.value) == ex.stub_message


def test_roofline_prediction_is_a_bound_with_a_floor_on_cpu(capsys):
    checks.check_roofline_prediction(100.0, 60.0, device="cpu")
    assert "✓" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="beats the predicted bound"):
        checks.check_roofline_prediction(100.0, 130.0, device="cpu")
    with pytest.raises(AssertionError, match="only 5%"):
        checks.check_roofline_prediction(100.0, 5.0, device="cpu")
    checks.check_roofline_prediction(100.0, 5.0, device="cuda")  # launch-bound GPUs have no floor


def test_prediction_bytes_tolerance():
    checks.check_prediction_bytes(100e6, 103e6)
    with pytest.raises(AssertionError, match="tolerance 5%"):
        checks.check_prediction_bytes(100e6, 150e6)


def test_cached_logits_check_catches_a_divergence():
    a = torch.randn(4, 50)
    checks.check_cached_logits(a, a.clone())
    b = a.clone()
    b[2, 7] += 0.5
    with pytest.raises(AssertionError, match="cached decoding diverged"):
        checks.check_cached_logits(a, b)
