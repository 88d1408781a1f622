"""The course's open challenges: settings a student tunes, checked for validity only and then measured.

Notebook 09's "goodput under an SLO": ``serving_knobs`` returns the engine options (a dict of ``EngineConfig``
fields, ``CHALLENGE_KNOBS``) the student picks for a seeded Poisson trace; the notebook replays the trace with the
engine's defaults and with those options and reports the goodput each reached.  The checker
(``minillm.course.checks.serving.check_serving_knobs``) fails only an invalid configuration — a low goodput is a
result to explain, not a wrong answer.
"""

from __future__ import annotations

__all__ = ["CHALLENGE_KNOBS", "serving_knobs"]

# EngineConfig fields the challenge may set: how requests are batched and scheduled, the KV budget, the runner.
# Not the model, its dtype or its processes (tensor / pipeline parallel): those change what is being served.
CHALLENGE_KNOBS = ("policy", "max_num_seqs", "max_num_batched_tokens", "chunked_prefill", "enable_prefix_caching",
                   "preemption", "num_kv_blocks", "block_size", "dynamic_window_s", "pad_batches", "enforce_eager",
                   "kv_cache_dtype", "speculative_config")


def serving_knobs() -> dict:
    """Notebook 09: the engine options (a dict of ``EngineConfig`` fields among ``CHALLENGE_KNOBS``; the others keep
    the engine's defaults) under which the notebook's seeded trace gets the most requests served within the SLO."""
    ### BEGIN SOLUTION
    # A small CPU turns compute bound at a few sequences: a smaller batch keeps each step (TPOT) short, and a
    # modest token budget splits long prompts so a prefill never stalls the running decodes for long.
    return {"max_num_seqs": 8, "max_num_batched_tokens": 256, "chunked_prefill": True, "policy": "continuous"}
    ### END SOLUTION
