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


def _wrong_attainable_flops(spec, intensity, dtype):
    values = list(intensity) if hasattr(intensity, "__len__") else [intensity]
    roof = [float(i) * spec.memory_bandwidth for i in values]  # forgot the compute roof
    return roof if hasattr(intensity, "__len__") else roof[0]


def _wrong_read_bandwidth(buffer, *, repeats=5, reduce=torch.sum):
    import time

    if repeats < 1 or buffer.numel() == 0:
        raise ValueError("bad argument")
    reduce(buffer)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        reduce(buffer)
        times.append(time.perf_counter() - t0)
    return buffer.nbytes / (sum(times) / len(times))  # the mean pass: a neighbour's burst counts against the roof


def _wrong_mbu(bytes_per_step, steps_per_s, bandwidth):
    bw = getattr(bandwidth, "memory_bandwidth", bandwidth)
    return 100 * bytes_per_step * steps_per_s / bw  # a percentage, not a fraction


def _wrong_decode_weight_bytes(config, dtype=torch.float16):
    return config.num_parameters() * dtype.itemsize  # counts the (untied) embedding table


def _wrong_percentile(values, q):
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]  # nearest rank, no interpolation


def _wrong_rms_norm(x, weight, eps):
    xf = x.float()  # eps outside the square root: invisible on unit-scale rows, wrong where mean(x²) ~ eps
    return weight * (xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + eps)).to(x.dtype)


def _wrong_apply_rope(x, cos, sin):
    even, odd = x[..., 0::2], x[..., 1::2]  # interleaved pairs (x_0, x_1): the GPT-J layout, not Llama's
    c, s = cos[..., : x.shape[-1] // 2], sin[..., : x.shape[-1] // 2]
    return torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)


def _wrong_top_k_top_p_mask(logits, k, p):
    if 0 < k < logits.shape[-1]:  # top-p over the unfiltered distribution: top-k's mass is not renormalised
        probs = logits.softmax(-1)
        logits = logits.masked_fill(logits < logits.topk(k, -1).values[..., -1:], float("-inf"))
    else:
        probs = logits.softmax(-1)
    if p >= 1.0:
        return logits
    sp, order = probs.sort(-1, descending=True, stable=True)
    keep = (sp.cumsum(-1) - sp) < p
    keep[..., 0] = True
    return logits.masked_fill(~torch.zeros_like(keep).scatter_(-1, order, keep), float("-inf"))


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


WRONG = {"1.1": _wrong_decode_weight_bytes, "1.2": _wrong_percentile, "1.3": _wrong_rms_norm, "1.4": _wrong_apply_rope,
         "1.6": _wrong_top_k_top_p_mask,
         "2.1": _wrong_kv_bytes, "2.2": _WrongKVCache}
WRONG.update({"0.1": _wrong_linear_cost, "0.2": _wrong_attainable_flops, "0.3": _wrong_read_bandwidth,
              "0.4": _wrong_mbu})  # notebook 00


def _wrong_cached_attention(q, k, v, positions, *, scale):
    L, S = q.shape[2], k.shape[2]
    causal = torch.ones(L, S, dtype=torch.bool).tril(S - L)  # every row's queries taken as the last L slots
    G = q.shape[1] // k.shape[1]
    s = (q.float() @ k.repeat_interleave(G, 1).float().transpose(-1, -2)) * scale
    p = s.masked_fill(~causal, float("-inf")).softmax(-1)
    return (p @ v.repeat_interleave(G, 1).float()).to(q.dtype)


def _wrong_pool_kv_weight(weight, num_heads, num_kv_heads, new_kv_heads, head_dim):
    if new_kv_heads < 1 or num_kv_heads % new_kv_heads:
        raise ValueError("bad head count")
    q, k, v = weight.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim])
    r, rest = num_kv_heads // new_kv_heads, weight.shape[1:]

    def pool(x):  # heads j, j + new, j + 2·new, … averaged: strided groups, not consecutive ones
        return x.reshape(r, new_kv_heads, head_dim, *rest).float().mean(0).reshape(-1, *rest).to(weight.dtype)

    return torch.cat([q, pool(k), pool(v)])


WRONG.update({"2.3": _wrong_cached_attention, "3.3": _wrong_pool_kv_weight})


def _wrong_kv_bytes_gqa(config, num_kv_heads, bytes_per_elem=2):
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * bytes_per_elem  # the model's H_kv


SOLVED_GROUPED_ATTENTION = EXERCISES["3.2"].answer()  # a copy: the library's own is hidden while a checker runs


def _wrong_grouped_attention(q, k, v, mask=None, *, causal=False, scale=None):
    grouped_attention = SOLVED_GROUPED_ATTENTION

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


from minillm.kv.eviction import KVEvictionPolicy  # noqa: E402  (notebook 03, KV eviction)


class _WrongEvictionPolicy(KVEvictionPolicy):
    """Off by one at the window's start: frees the block whose last slot the next query still sees."""

    def freeable_blocks(self, num_computed, block_size):
        first = -(-self.sink_tokens // block_size)
        return range(first, max(first, (num_computed - self.window_tokens + 2) // block_size))


class _SinkBlockEvictionPolicy(KVEvictionPolicy):
    """Rounds the sinks down to whole blocks: frees the block that holds the last sinks."""

    def freeable_blocks(self, num_computed, block_size):
        first = self.sink_tokens // block_size
        return range(first, max(first, (num_computed - self.window_tokens + 1) // block_size))


def test_eviction_rule_check_names_the_kept_position(capsys):
    with pytest.raises(AssertionError, match="still inside the window"):
        checks.check_freeable_blocks(_WrongEvictionPolicy)
    with pytest.raises(AssertionError, match="sink position"):
        checks.check_freeable_blocks(_SinkBlockEvictionPolicy)


WRONG["3.4"] = _WrongEvictionPolicy


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
WRONG.update(__import__("test_checks_serving").WRONG_09)  # 9.3 (tests/course/test_checks_serving.py)
WRONG.update(__import__("test_checks_constrained").WRONG_09_CD)  # 9.5 (test_checks_constrained.py)
WRONG.update(__import__("test_checks_scaling").WRONG_10)  # notebook 10 (tests/course/test_checks_scaling.py)
from test_checks_speculative import WRONG_08  # noqa: E402  (notebook 08's wrong answers live beside its tests)

WRONG.update(WRONG_08)


# copies of the solutions made outside any check (while a checker runs, the library's own functions are hidden)
SOLVED_QUANTIZE, SOLVED_QUANTIZE_INT4 = EXERCISES["7.1"].answer(), EXERCISES["7.2"].answer()


def _wrong_quantize(x, spec):
    from minillm.quant.formats import Quantized

    ok = SOLVED_QUANTIZE(x, spec)  # a copy (the library's is hidden): right scales, no zero point
    return Quantized(torch.clamp(torch.round(x.float() / _expand(ok.scale, x, spec)), spec.qmin, spec.qmax)
                     .to(ok.q.dtype), ok.scale, torch.zeros_like(ok.zero_point), spec)


def _expand(v, x, spec):
    return v.repeat_interleave(spec.group_size, -1) if spec.granularity.value == "group" else v


def _wrong_quantize_int4(w, group_size=32, scale_dtype=torch.float16):
    from minillm.quant.weight import Int4Weight

    ok = SOLVED_QUANTIZE_INT4(w, group_size, scale_dtype)  # copy; swapped: q[j] << 4 | q[j+16]
    return Int4Weight((ok.packed << 4) | (ok.packed >> 4), ok.scales, ok.mins, group_size)


def _wrong_int4_linear(x, w4, bias=None):
    N, K = w4.shape  # forgets the group minimum m: w = d · q
    b = w4.packed.view(N, K // 32, 16)
    q = torch.cat([b & 0x0F, b >> 4], dim=-1).view(N, K // w4.group_size, w4.group_size).float()
    return torch.nn.functional.linear(x, (q * w4.scales.float().unsqueeze(-1)).view(N, K).to(x.dtype), bias)


WRONG.update({"7.1": _wrong_quantize, "7.2": _wrong_quantize_int4, "7.3": _wrong_int4_linear})  # notebook 07
WRONG.update(__import__("test_checks_smoothquant").WRONG_07_SMOOTH)  # 7.4, 7.5 (test_checks_smoothquant.py)


# --- the exercises students write in full (1.5, 4.3, 5.4, 6.3) and the predictions (N.0) -----------------------
def _wrong_stream_naive(model, prompts, params, eos_ids=()):
    from minillm.engine.simple import _append, _right_pad, _start
    from minillm.sampling.sampler import sample

    seqs = _start(model, prompts, params)
    eos, max_len = frozenset(eos_ids), model.config.max_position_embeddings
    while active := [i for i, s in enumerate(seqs) if not s.done]:
        ids, positions, _ = _right_pad([seqs[i].prompt + seqs[i].output for i in active], model.device)
        logits = model.compute_logits(model.hidden_states(ids, positions)[:, -1]).float()  # padding, not the last
        tokens = sample(logits, [seqs[i].params for i in active], [seqs[i].generator for i in active])
        for i, t in zip(active, tokens, strict=True):
            yield _append(seqs[i], t, eos, max_len, i)
    return seqs


def _wrong_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    from minillm.kernels.reference import decode_attention

    def gather(cache):  # reads every table entry, padding included, and attends to whole blocks
        return cache[block_tables.long()].flatten(1, 2).transpose(1, 2)

    full = torch.full_like(seq_lens, block_tables.shape[1] * k_cache.shape[1])
    return decode_attention(q, gather(k_cache), gather(v_cache), full, scale=scale)


from minillm.engine.scheduler import Scheduler  # noqa: E402


class _WrongScheduler(Scheduler):
    """Admits whoever fits, skipping a blocked head of the queue: a long prompt can starve behind short ones."""

    def _admit(self, out, budget, now):
        for seq in list(self.waiting):
            if budget <= 0:
                return
            if self._num_seq_slots() + seq.seq_slots > self.config.max_num_seqs:
                return
            if not self.block_manager.can_allocate(seq.token_ids):
                continue
            if not self.config.chunked_prefill and budget < min(seq.num_tokens, self.config.max_num_batched_tokens):
                continue
            hits = self.block_manager.allocate(seq.seq_id, seq.token_ids)
            self.waiting.remove(seq)
            self._start_running(seq, hits, now)
            budget -= self._schedule_chunk(seq, out, budget)


def _no_prediction(*numbers):
    return None  # the stub's cell run with the line deleted and nothing written


WRONG.update({"1.5": _wrong_stream_naive, "5.4": _wrong_paged_attention, "6.3": _WrongScheduler})
WRONG.update({n: _no_prediction for n in EXERCISES if n.endswith(".0")})
WRONG["4.4"] = _no_prediction  # notebook 04's second prediction: the launch overhead
if importlib.util.find_spec("triton") is not None:  # conftest set TRITON_INTERPRET=1 on machines without CUDA
    import triton.language as tl  # noqa: E402

    def _wrong_decode_partial_program(Q, K, V, SeqLens, Mp, Lp, Op, sqb, sqh, skb, skh, skn, svb, svh, svn,
                                      H_kv, D, GROUP, split_size, num_splits, qk_scale,
                                      BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                                      DOT_PRECISION: tl.constexpr):
        """The tile loop without the rescale of acc when the max rises (right only for one tile per split)."""
        pid, split = tl.program_id(0), tl.program_id(1)
        b, h_kv = pid // H_kv, pid % H_kv
        seq_len = tl.load(SeqLens + b).to(tl.int32)
        start = split * split_size
        end = tl.minimum(start + split_size, seq_len)
        offs_g, offs_d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
        heads = h_kv * GROUP + offs_g
        g_mask, d_mask = offs_g < GROUP, offs_d < D
        b64 = b.to(tl.int64)
        q = tl.load(Q + b64 * sqb + heads[:, None] * sqh + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :],
                    other=0.0)
        k_base, v_base = K + b64 * skb + h_kv * skh, V + b64 * svb + h_kv * svh
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start_n in range(start, end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(p, 1)
            v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=kv_mask, other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)  # acc not rescaled
            m_i = m_new
        row = (b64 * H_kv * GROUP + heads) * num_splits + split
        tl.store(Mp + row, m_i, mask=g_mask)
        tl.store(Lp + row, l_i, mask=g_mask)
        tl.store(Op + row[:, None] * D + offs_d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])

    WRONG["4.3"] = _wrong_decode_partial_program

    def _wrong_paged_partial_program():
        """The solution with one table entry per tile (a tile taken for one block): right while a tile stays inside
        one block, wrong once a tile spans several scattered blocks."""
        ex = EXERCISES["5.5"]
        right = "block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)"
        code = ex.code(student=False)
        assert right in code, "the 5.5 solution changed: update its wrong answer"
        return ex._run(code.replace(right, "block = tl.load(table + start_n // BLOCK_SIZE).to(tl.int64)"), "wrong")

    WRONG["5.5"] = _wrong_paged_partial_program()

    def _wrong_int4_gemv_program():
        """The solution with the nibbles swapped (weight j in the high nibble): the other common packing."""
        ex = EXERCISES["7.6"]
        right = "shift = ((ks % 32) // 16) * 4"
        code = ex.code(student=False)
        assert right in code, "the 7.6 solution changed: update its wrong answer"
        return ex._run(code.replace(right, "shift = (1 - (ks % 32) // 16) * 4"), "wrong")

    WRONG["7.6"] = _wrong_int4_gemv_program()

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
def test_library_reference_passes_its_checker(number, capsys, solution_copy):
    ex = EXERCISES[number]
    ex.check(solution_copy(ex))
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


def test_roofline_prediction_is_a_bound_and_reports_the_fraction_honestly(capsys):
    assert checks.check_roofline_prediction(100.0, 85.0, device="cpu") == pytest.approx(0.85)
    assert "at 85% of the roofline bound: bandwidth bound" in capsys.readouterr().out
    checks.check_roofline_prediction(100.0, 130.0, device="cpu")  # a roof measured low on a busy machine
    assert "⚠ measured decode tokens/s 130 beats the predicted bound 100 by 30%" in capsys.readouterr().out
    checks.check_roofline_prediction(100.0, 32.0, device="cpu")  # no band to pass: a verdict, never "✓ holds"
    out = capsys.readouterr().out
    assert "at 32% of the roofline bound: overhead dominates" in out and "✓" not in out
    checks.check_roofline_prediction(100.0, 5.0, device="cuda", see="§4")
    assert "kernel launches" in capsys.readouterr().out


def test_judge_prediction_computes_its_verdict_from_the_numbers(capsys):
    v = checks.judge_prediction(20.0, 14.0, bound=40.0, what="decode tokens/s", unit="tok/s", see="§5")
    assert (v.of_bound, round(v.of_prediction, 3)) == (0.35, 0.7)
    assert "1.4× too optimistic" in v.text and "35% of the roofline bound" in v.text
    assert "overhead dominates" in v.text and v.text.endswith("§5")
    v = checks.judge_prediction(30.0, 31.0, bound=40.0, what="x", unit="tok/s")
    assert "held: within 3%" in v.text and "mostly bandwidth bound; the other 22%" in v.text
    v = checks.judge_prediction(50.0, 34.0, bound=40.0, what="x")
    assert "beyond the roofline bound" in v.text and "85% of the roofline bound (40): bandwidth bound" in v.text
    v = checks.judge_prediction(12.0, 10.0, bound=6.0, what="step", unit="ms", lower_is_faster=True)
    assert "1.2× too pessimistic" in v.text and v.of_bound == pytest.approx(0.6)
    v = checks.judge_prediction(10.0, 60.0, bound=40.0, what="x")  # noise or a low roof: said, not raised
    assert "⚠ measured x 60 beats the roofline bound 40 by 50%" in v.text and "--remeasure" in v.text
    with pytest.raises(ValueError, match="write your prediction"):
        checks.judge_prediction(-3.0, 10.0, bound=40.0, what="x")
    v = checks.judge_prediction(None, 10.0, bound=40.0, what="x")  # not written yet: the measurement still placed
    assert "not written a prediction" in v.text and "25% of the roofline bound" in v.text and v.of_prediction is None


@pytest.mark.parametrize("number", [n for n in NUMBERS if n.endswith(".0")])
def test_prediction_checker_records_the_students_number(number, capsys):
    ex = EXERCISES[number]
    bound = ex.check.bound()
    assert ex.check(lambda *numbers: bound) == bound
    assert f"{bound:,.4g}" in capsys.readouterr().out
    for bad in (None, -1.0, float("nan"), "40", True):
        with pytest.raises(AssertionError, match="expected a positive number"):
            ex.check(lambda *numbers, bad=bad: bad)


@pytest.mark.parametrize("number", [n for n in NUMBERS if n.endswith(".0")])
def test_prediction_checker_accepts_only_a_number_near_the_bound(number):
    """A prediction off by more than the stated factor fails, and one that beats a ceiling (or undercuts a floor)
    by more than 5 % fails: no pre-filled number and no wild guess passes."""
    ex = EXERCISES[number]
    bound, kind, factor = ex.check.bound(), ex.check.kind, ex.check.factor
    for wrong in (bound * factor * 2, bound / factor / 2):
        with pytest.raises(AssertionError, match="expected between"):
            ex.check(lambda *numbers, wrong=wrong: wrong)
    if kind == "ceiling":
        with pytest.raises(AssertionError, match="nothing can beat it"):
            ex.check(lambda *numbers: bound * 1.2)
    if kind == "floor":
        with pytest.raises(AssertionError, match="nothing can undercut it"):
            ex.check(lambda *numbers: bound * 0.8)


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


@pytest.mark.parametrize("number", NUMBERS)
def test_checker_never_computes_its_expectation_with_the_fenced_target(number, monkeypatch, capsys):
    """With the library's solved symbol replaced by one that raises (as grading hides it), the solution still
    passes: every checker carries its own reference, so a student answer delegating to the library cannot."""
    ex = EXERCISES[number]
    solution = rendered(ex, student=False)

    def hidden(*args, **kwargs):
        raise AssertionError(f"the checker of exercise {number} called the library's solved {ex.target}")

    owner = importlib.import_module(ex.module)
    *path, name = ex.qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    monkeypatch.setattr(owner, name, hidden)
    ex.check(solution)
    assert f"✓ Exercise {number} passed" in capsys.readouterr().out
