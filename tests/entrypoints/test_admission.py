"""SLO-aware admission: the TTFT estimator (a pure function of observed steps and the queue) and the queue count."""

from types import SimpleNamespace

import pytest
import torch

from minillm import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from minillm.entrypoints.openai.admission import TTFTEstimator, queued_prefill_tokens, steps_to_seat


def steps(est: TTFTEstimator, n: int, tokens: int, seconds: float) -> TTFTEstimator:
    for _ in range(n):
        est = est.observe(tokens, seconds)
    return est


def test_before_any_step_everything_is_admitted_and_nothing_is_estimated():
    est = TTFTEstimator()
    assert est.tokens_per_s is None and est.estimate_s(10_000, 100) is None
    assert est.admits(0.001, tokens_ahead=10_000, prompt_tokens=100)


def test_an_idle_queue_admits_even_a_prompt_over_the_budget():
    est = steps(TTFTEstimator(), 5, tokens=100, seconds=0.1)  # 1,000 prefill tokens/s
    assert est.estimate_s(0, 5_000) > 1.0  # its own prefill alone is 5 s
    assert est.admits(1.0, tokens_ahead=0, prompt_tokens=5_000)


def test_estimate_is_step_time_plus_queued_and_own_tokens_over_the_prefill_rate():
    est = steps(TTFTEstimator(), 3, tokens=200, seconds=0.1)  # 2,000 tokens/s, 0.1 s steps
    assert est.tokens_per_s == pytest.approx(2_000)
    assert est.estimate_s(1_000, 200) == pytest.approx(0.1 + 1_200 / 2_000)


def test_sheds_when_the_queued_prefill_work_exceeds_the_budget():
    est = steps(TTFTEstimator(), 5, tokens=100, seconds=0.1)  # 1,000 tokens/s
    assert est.admits(1.0, tokens_ahead=500, prompt_tokens=100)  # 0.1 + 0.6 s
    assert not est.admits(1.0, tokens_ahead=2_000, prompt_tokens=100)  # 0.1 + 2.1 s
    assert est.retry_after_s(1.0, 2_000, 100) == 2  # 1.2 s over the budget, rounded up
    assert est.retry_after_s(1.0, 500, 100) == 1  # never 0: a client retrying at once would only be shed again


def test_adapts_when_the_prefill_throughput_drops_and_recovers():
    fast = steps(TTFTEstimator(), 10, tokens=100, seconds=0.1)  # 1,000 tokens/s
    assert fast.admits(1.0, 500, 50)
    slow = steps(fast, 20, tokens=100, seconds=1.0)  # the host got 10x slower: 100 tokens/s
    assert slow.tokens_per_s == pytest.approx(100, rel=0.05)
    assert not slow.admits(1.0, 500, 50)
    recovered = steps(slow, 20, tokens=100, seconds=0.1)
    assert recovered.tokens_per_s == pytest.approx(1_000, rel=0.1)
    assert recovered.admits(1.0, 500, 50)


def test_one_slow_step_moves_the_estimate_by_alpha_not_all_the_way():
    est = steps(TTFTEstimator(alpha=0.2), 10, tokens=100, seconds=0.1)
    once = est.observe(100, 1.0)
    assert est.tokens_per_s > once.tokens_per_s > 100 * 2  # far from the one step's 100 tokens/s


def test_decode_only_steps_move_the_step_time_but_not_the_prefill_rate():
    est = steps(TTFTEstimator(), 5, tokens=100, seconds=0.1)
    decoding = steps(est, 20, tokens=0, seconds=0.3)
    assert decoding.tokens_per_s == est.tokens_per_s
    assert decoding.step_s == pytest.approx(0.3, rel=0.02)
    assert decoding.estimate_s(100, 0) > est.estimate_s(100, 0)


def test_observe_returns_a_new_estimator_and_leaves_the_old_one_unchanged():
    est = TTFTEstimator()
    after = est.observe(100, 0.1)
    assert est.prefill_steps == 0 and after.prefill_steps == 1 and after.steps == 1


@pytest.mark.parametrize("kw", [{"alpha": 0}, {"alpha": 1.5}, {"alpha": "0.2"}])
def test_rejects_an_alpha_outside_zero_to_one(kw):
    with pytest.raises(ValueError, match="alpha"):
        TTFTEstimator(**kw)


def test_rejects_negative_observations():
    with pytest.raises(ValueError):
        TTFTEstimator().observe(-1, 0.1)
    with pytest.raises(ValueError):
        TTFTEstimator().observe(10, -0.1)


# ---- the queue's prefill work -------------------------------------------------------------------------------------
def seq(num_tokens: int, num_computed: int):
    return SimpleNamespace(num_tokens=num_tokens, num_computed=num_computed)


def test_queued_prefill_counts_waiting_and_unfinished_prompts_but_not_decodes():
    scheduler = SimpleNamespace(waiting=[seq(100, 0), seq(40, 0)],  # never run
                                running=[seq(300, 128),  # a prompt halfway through chunked prefill: 172 left
                                         seq(51, 50)])  # decoding: its newest token is decode work
    assert queued_prefill_tokens(scheduler) == 100 + 40 + 172


def test_a_full_batch_sheds_even_with_no_prefill_queued():
    est = steps(TTFTEstimator(), 5, tokens=100, seconds=0.1)  # 1,000 tokens/s, 0.1 s steps
    assert est.admits(1.0, tokens_ahead=0, prompt_tokens=100, steps_to_seat=0)
    assert not est.admits(1.0, tokens_ahead=0, prompt_tokens=100, steps_to_seat=20)  # 2 s of decode steps first
    assert est.estimate_s(0, 100, steps_to_seat=20) == pytest.approx(0.1 * 21 + 0.1)


def running_seq(output: int, max_tokens: int, prompt: int = 10, slots: int = 1):
    params = SamplingParams(max_tokens=max_tokens)
    return SimpleNamespace(output=[0] * output, num_tokens=prompt + output, seq_slots=slots,
                           request=SimpleNamespace(params=params))


def queue(running, waiting=0):
    return SimpleNamespace(running=running, waiting=[SimpleNamespace(seq_slots=1)] * waiting, swapped=[])


def test_a_free_seat_means_no_wait_for_one():
    assert steps_to_seat(queue([running_seq(0, 32)] * 3), max_num_seqs=4, max_model_len=2048) == 0
    assert steps_to_seat(queue([], waiting=3), max_num_seqs=4, max_model_len=2048) == 0


def test_a_full_batch_waits_for_the_sequence_nearest_its_max_tokens():
    batch = [running_seq(0, 32), running_seq(30, 32), running_seq(10, 32), running_seq(5, 8)]  # 32, 2, 22, 3 left
    assert steps_to_seat(queue(batch), max_num_seqs=4, max_model_len=2048) == 2
    assert steps_to_seat(queue(batch, waiting=1), max_num_seqs=4, max_model_len=2048) == 3  # one is ahead
    assert steps_to_seat(queue(batch, waiting=4), max_num_seqs=4, max_model_len=2048) == 2 + 32  # a second wave


def test_the_context_end_bounds_a_sequence_with_a_huge_max_tokens():
    batch = [running_seq(0, 10_000, prompt=2000)]
    assert steps_to_seat(queue(batch), max_num_seqs=1, max_model_len=2048) == 48


@pytest.fixture(scope="module")
def engine():
    from transformers import LlamaConfig, LlamaForCausalLM

    from minillm.models.loader import build_model

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=512)).eval()
    model = build_model(ModelConfig.from_hf(hf.config), hf.state_dict(), dtype=torch.float32, device="cpu")
    return LLMEngine(model, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64))


def test_queued_prefill_drains_as_the_engine_prefills_in_chunks(engine):
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request(list(range(1, 101)), params, "a")
    engine.add_request(list(range(1, 41)), params, "b")
    assert queued_prefill_tokens(engine.scheduler) == 140
    engine.step()  # a 64-token budget: the first 64 tokens of "a"
    assert queued_prefill_tokens(engine.scheduler) == 140 - 64
    while engine.has_unfinished_requests():
        engine.step()
    assert queued_prefill_tokens(engine.scheduler) == 0
    engine.pop_output("a"), engine.pop_output("b")


def test_time_already_waited_for_a_step_counts_against_the_budget():
    est = steps(TTFTEstimator(), 5, tokens=100, seconds=0.1)  # 1,000 tokens/s
    assert est.admits(1.0, tokens_ahead=500, prompt_tokens=100)  # 0.7 s from now
    assert not est.admits(1.0, tokens_ahead=500, prompt_tokens=100, waited_s=0.5)  # it arrived mid-step 0.5 s ago


def test_a_model_that_runs_slow_widens_the_margin_and_sheds_sooner():
    est = steps(TTFTEstimator(), 5, tokens=100, seconds=0.1)  # 1,000 tokens/s
    assert est.margin == 1.0 and est.admits(1.0, 700, 100)  # 0.9 s modelled
    for actual in (1.4, 1.6, 1.5, 1.3, 1.7):  # requests modelled at 1 s took ~1.5 s
        est = est.calibrate(1.0, actual)
    assert est.error == pytest.approx(1.5, abs=0.1) and est.margin > est.error
    assert est.model_s(700, 100) == pytest.approx(0.9) and est.estimate_s(700, 100) == pytest.approx(0.9 * est.margin)
    assert not est.admits(1.0, 700, 100)


def test_a_steady_accurate_model_keeps_the_margin_near_one():
    est = steps(TTFTEstimator(), 5, tokens=100, seconds=0.1)
    for _ in range(40):
        est = est.calibrate(1.0, 1.0)
    assert est.margin == pytest.approx(1.0, abs=0.01)
    assert est.calibrate(0.0, 1.0) == est  # a zero model teaches nothing
