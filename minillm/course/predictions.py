"""The student's predictions: one number per notebook, written before the measurement (exercise N.0).

Each function returns the student's own estimate from what the notebook has shown by then — the roofline bound or
the model's value is passed in; use it, scale it, or ignore it.  The solutions hold the course's estimate and its
reasoning.  The notebook records the number (``checks.check_prediction_*``), measures, then sets the three numbers
side by side with ``checks.judge_prediction``: an honest verdict, never a pass on a wide band.
"""

from __future__ import annotations

__all__ = ["predict_attention_gb_s", "predict_continuous_speedup", "predict_decode_step_ms", "predict_decode_tok_s",
           "predict_eager_step_ms", "predict_gemv_gb_s", "predict_int4_tok_s", "predict_mqa_speedup",
           "predict_paged_sequences", "predict_server_tok_s"]


def predict_gemv_gb_s(roof_gb_s: float) -> float:
    """Notebook 00: the GB/s a batch-1 pass of ``F.linear`` over one decode step's weight matrices will stream,
    given this machine's bandwidth roof (the best of its read and GEMV probes, GB/s)."""
    ### BEGIN SOLUTION
    return 0.7 * roof_gb_s  # 120 separate calls, each with a fixed cost, and F.linear is not the best GEMV here
    ### END SOLUTION


def predict_decode_tok_s(bound_tok_s: float) -> float:
    """Notebook 01: decode tokens/s of the engine at batch 1, given the roofline bound (bandwidth ÷ weight bytes)."""
    ### BEGIN SOLUTION
    return 0.5 * bound_tok_s  # every step also pays Python, sampling and a few hundred small ops
    ### END SOLUTION


def predict_decode_step_ms(bound_ms: float) -> float:
    """Notebook 02: milliseconds of one batch-1 decode step over the longest cache measured, given the roofline
    bound ((weight bytes + cached K/V bytes) ÷ bandwidth)."""
    ### BEGIN SOLUTION
    return 1.5 * bound_ms  # the bytes set the floor; attention over a long cache adds a few non-streaming ops
    ### END SOLUTION


def predict_mqa_speedup(bound_ratio: float) -> float:
    """Notebook 03: how many times faster a decode step of the multi-query model (H_kv = 1) is than the
    multi-head one (H_kv = H_q), given the ratio of their bandwidth bounds."""
    ### BEGIN SOLUTION
    return 1 + 0.5 * (bound_ratio - 1)  # fixed per-step costs and compute-bound grouped attention eat half the gain
    ### END SOLUTION


def predict_attention_gb_s(roof_gb_s: float) -> float:
    """Notebook 04: the GB/s of K/V that decode attention (the engine's kernel, the biggest batch and longest
    context benchmarked) will read, given this machine's bandwidth roof."""
    ### BEGIN SOLUTION
    return 0.4 * roof_gb_s  # short rows per head: each (sequence, head) streams only S × D elements at a time
    ### END SOLUTION


def predict_eager_step_ms(floor_ms: float, num_layers: int) -> float:
    """Notebook 04: milliseconds of one batch-1 decode step of the engine run eagerly (every layer's ops launched
    one by one from Python), given the bytes floor (one step's bytes ÷ this machine's bandwidth, ms) and the
    model's number of decoder layers."""
    ### BEGIN SOLUTION
    return floor_ms + num_layers * 50 * 0.01  # ~50 small ops per layer, ~10 µs of dispatch each on a CPU
    ### END SOLUTION


def predict_paged_sequences(budget_tokens: int, mean_len: float, block_size: int) -> float:
    """Notebook 05: how many of the trace's requests fit a paged KV cache of ``budget_tokens`` slots at once, in
    blocks of ``block_size`` tokens, when a request's final length averages ``mean_len`` tokens."""
    ### BEGIN SOLUTION
    return budget_tokens / (mean_len + (block_size - 1) / 2)  # each sequence wastes half a block on average
    ### END SOLUTION


def predict_continuous_speedup(step_ratio: float) -> float:
    """Notebook 06: measured throughput of continuous ÷ static batching on the trace, given the ratio of their
    step counts from your slot model (the speedup if every step cost the same)."""
    ### BEGIN SOLUTION
    return 1 + 0.6 * (step_ratio - 1)  # both prefill every prompt once, and a fuller batch makes each step dearer
    ### END SOLUTION


def predict_int4_tok_s(bound_tok_s: float) -> float:
    """Notebook 07: batch-1 decode tokens/s of the int4 (Q4_1) model, given its roofline bound (bandwidth ÷ its
    weight bytes per token)."""
    ### BEGIN SOLUTION
    return 0.3 * bound_tok_s  # every weight is unpacked and converted, and the per-token fixed cost stays
    ### END SOLUTION


def predict_server_tok_s(capacity_tok_s: float, offered_tok_s: float) -> float:
    """Notebook 09: output tokens/s the server delivers at the overload rate, given the engine's capacity measured
    offline and the load offered (rate × tokens per answer)."""
    ### BEGIN SOLUTION
    return 0.8 * min(capacity_tok_s, offered_tok_s)  # batches are rarely full; HTTP and streaming share the CPU
    ### END SOLUTION
