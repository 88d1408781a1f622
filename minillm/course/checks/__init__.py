"""Exercise checkers, shared by the course notebooks and the test suite: one module per notebook.

``EXERCISES`` (``registry.py``) maps each exercise number to the fenced function it targets, its title, hint and
checker; importing this package registers every notebook's exercises.  Exercise N.0 of each notebook is the
student's prediction (``minillm.course.predictions``), set against the measurement by ``judge_prediction``.
"""

from minillm.course.checks.attention_kernels import (
    check_decode_partial_program,
    check_flash_tile_step,
    check_merge_attention_partials,
    check_prediction_attention,
    check_prediction_launch,
)
from minillm.course.checks.attention_variants import (
    check_freeable_blocks,
    check_grouped_attention,
    check_kv_bytes_gqa,
    check_pool_kv_weight,
    check_prediction_mqa,
)
from minillm.course.checks.batching import (
    check_admit,
    check_batch_slots,
    check_prediction_batching,
    check_prefill_chunk_len,
)
from minillm.course.checks.generation import (
    check_apply_rope,
    check_decode_weight_bytes,
    check_generation_loop,
    check_percentile,
    check_prediction_decode,
    check_rms_norm,
    check_roofline_prediction,
    check_top_k_top_p_mask,
)
from minillm.course.checks.kv_cache import (
    check_cached_attention,
    check_cached_logits,
    check_kv_bytes_per_token,
    check_kv_cache_update,
    check_prediction_bytes,
    check_prediction_step,
)
from minillm.course.checks.paged import (
    check_append_slots,
    check_block_free,
    check_paged_decode_attention,
    check_paged_partial_program,
    check_prediction,
    check_prediction_paged,
    check_slot_mapping,
)
from minillm.course.checks.quantization import (
    check_int4_gemv_program,
    check_int4_linear_ref,
    check_prediction_int4,
    check_quantize,
    check_quantize_int4,
)
from minillm.course.checks.registry import CONFIGS, EXERCISES, LLAMA2_7B, SMOLLM2_135M, TINY_MQA, Exercise, exercise
from minillm.course.checks.roofline import (
    Verdict,
    check_attainable_flops,
    check_linear_cost,
    check_mbu,
    check_prediction_gemv,
    check_read_bandwidth,
    judge_prediction,
)
from minillm.course.checks.scaling import check_gpipe_schedule, check_layer_comm_time, check_shard_linear
from minillm.course.checks.serving import (
    check_arrival_times,
    check_parse_stream,
    check_prediction_server,
    check_serving_knobs,
    check_sse_stream,
    check_token_mask,
)
from minillm.course.checks.smoothquant import check_fold_into_norm, check_smoothing_factors
from minillm.course.checks.speculative import check_ngram_lookup, check_rejection_sample, check_truncate

__all__ = ["CONFIGS", "EXERCISES", "Exercise", "LLAMA2_7B", "SMOLLM2_135M", "TINY_MQA", "Verdict", "check_admit",
           "check_append_slots", "check_attainable_flops", "check_batch_slots", "check_block_free",
           "check_cached_logits", "check_decode_partial_program",
           "check_decode_weight_bytes", "check_flash_tile_step", "check_generation_loop",
           "check_grouped_attention", "check_kv_bytes_gqa", "check_kv_bytes_per_token", "check_kv_cache_update",
           "check_linear_cost", "check_mbu", "check_merge_attention_partials", "check_paged_decode_attention",
           "check_percentile", "check_prediction", "check_prediction_attention", "check_prediction_batching",
           "check_prediction_bytes", "check_prediction_decode", "check_prediction_gemv", "check_prediction_mqa",
           "check_prediction_paged", "check_prediction_step", "check_prefill_chunk_len",
           "check_roofline_prediction", "check_slot_mapping", "exercise", "judge_prediction"]
__all__ += ["check_cached_attention", "check_pool_kv_weight", "check_read_bandwidth"]  # 02, 03, 00
__all__ += ["check_prediction_launch"]  # notebook 04, launch overhead
__all__ += ["check_int4_linear_ref", "check_prediction_int4", "check_quantize", "check_quantize_int4"]  # notebook 07
__all__ += ["check_fold_into_norm", "check_smoothing_factors"]  # notebook 07, activation quantization
__all__ += ["check_ngram_lookup", "check_rejection_sample", "check_truncate"]  # notebook 08
__all__ += ["check_arrival_times", "check_parse_stream", "check_prediction_server", "check_sse_stream",
            "check_token_mask"]  # 09
__all__ += ["check_serving_knobs"]  # notebook 09, the goodput challenge
__all__ += ["check_gpipe_schedule", "check_layer_comm_time", "check_shard_linear"]  # notebook 10
__all__ += ["check_apply_rope", "check_rms_norm", "check_top_k_top_p_mask"]  # notebook 01
__all__ += ["check_paged_partial_program"]  # notebook 05, the Triton kernel
__all__ += ["check_int4_gemv_program"]  # notebook 07, the Triton GEMV
__all__ += ["check_freeable_blocks"]  # notebook 03, KV eviction
