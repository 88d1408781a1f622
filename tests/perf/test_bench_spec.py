"""bench spec: the prediction formula, the configurations, batch prompts, and the whole benchmark end to end at a
tiny size (a random 2-layer Llama with the default model's tokenizer) — batch 1 and continuous batching side by side,
greedy speculation identical to plain decode, the transformers peer measured on the same prompts, and a failing
peer reported as an error row instead of stopping the run."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm.models.loader import load_tokenizer
from minillm.perf.bench.spec import (
    PASSAGE,
    PROMPTS,
    _configs,
    batch_prompts,
    bench_spec,
    hf_generate_rates,
    predicted_tokens_per_call,
    projected_speedup,
    stats_since,
)
from minillm.spec.proposer import SpecStats


@pytest.mark.parametrize("alpha, gamma", [(0.0, 3), (0.5, 1), (0.6, 4), (0.9, 7), (1.0, 4)])
def test_predicted_tokens_per_call_is_the_geometric_sum(alpha, gamma):
    assert predicted_tokens_per_call(alpha, gamma) == pytest.approx(sum(alpha**i for i in range(gamma + 1)))


def test_configs_put_plain_first_then_each_proposer_at_each_gamma():
    configs = _configs(3, (2, 4), ("ngram", "quantized"))
    assert [(name, g) for name, g, _ in configs] == [("plain", 0), ("ngram", 2), ("ngram", 4),
                                                      ("quantized(int4)", 2), ("quantized(int4)", 4)]
    assert configs[0][2] is None and configs[2][2]["num_speculative_tokens"] == 4
    with pytest.raises(ValueError, match="unknown proposers"):
        _configs(3, (2,), ("medusa",))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A random 2-layer Llama with the default model's vocabulary, saved with its tokenizer (chat template)."""
    torch.manual_seed(0)
    tokenizer = load_tokenizer(None)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    path = tmp_path_factory.mktemp("tiny-llama-spec")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_batch_prompts_differ_from_each_other_but_keep_the_task(tiny_checkpoint):
    from minillm.llm import LLM

    llm = LLM(str(tiny_checkpoint), device="cpu")
    prompts = batch_prompts(llm, "copy: repeat", 4)
    assert len({tuple(p) for p in prompts}) == 4
    assert all("Repeat the following text" in llm.tokenizer.decode(p) for p in prompts)


def test_bench_runs_batch_1_and_8_beside_plain_and_the_transformers_peer(tiny_checkpoint, tmp_path, monkeypatch):
    import minillm.perf.bench.decode as decode

    monkeypatch.setattr(decode, "RESULTS_DIR", tmp_path)
    rows = bench_spec(str(tiny_checkpoint), device="cpu", gammas=(2,), n_tokens=6, repeats=1,
                      proposers=("ngram",), batch_sizes=(1, 8), hf=True)
    ours = [r for r in rows if not r["peer"]]
    assert {(r["prompt"], r["batch"], r["proposer"]) for r in ours} == {
        (kind, b, name) for kind in PROMPTS for b in (1, 8) for name in ("plain", "ngram")}
    assert all(r["same_tokens_as_plain"] for r in ours), "greedy speculation must reproduce plain decoding"
    assert all(r["tok_s"] > 0 for r in ours)
    for r in ours:
        if r["proposer"] == "ngram" and r["tokens_per_call"]:
            assert 1.0 <= r["tokens_per_call"] <= 3.0  # 1 .. γ + 1 tokens per target call
        if r["proposer"] == "ngram" and r["verify_steps"]:  # steps without a proposal only lower tokens per call
            assert r["tokens_per_call"] <= r["tokens_per_verify"] <= 3.0
            assert r["verify_ms"] > 0 and r["projected_speedup"] > 0 and r["skipped_steps"] >= 0
    peer = [r for r in rows if r["peer"]]
    assert {(r["prompt"], r["proposer"]) for r in peer} == {
        (kind, name) for kind in PROMPTS for name in ("hf plain", "hf prompt_lookup")}
    assert all("error" not in r and r["tok_s"] > 0 for r in peer), peer
    assert all(r["same_tokens_as_plain"] for r in peer if r["proposer"] == "hf prompt_lookup")
    saved = json.loads((tmp_path / "spec-cpu.json").read_text())
    assert saved["batch_sizes"] == [1, 8] and len(saved["rows"]) == len(rows) and "machine" in saved


def test_a_peer_that_cannot_load_is_an_error_row(tmp_path):
    rows = hf_generate_rates(tmp_path / "missing", {"open-ended": [1, 2, 3]}, 4, (2,), 1, "cpu", torch.float32)
    assert len(rows) == 1 and "error" in rows[0] and rows[0]["proposer"] == "transformers"


def test_copy_prompts_cover_repeat_summarise_and_edit_code_beside_an_open_ended_one():
    assert {"copy: repeat", "copy: summarise", "copy: edit code", "open-ended"} == set(PROMPTS)
    assert PASSAGE in PROMPTS["copy: repeat"] and PASSAGE in PROMPTS["copy: summarise"]
    with pytest.raises(ValueError, match="unknown prompt kinds"):
        bench_spec("unused", prompt_kinds=("copy: poem",), hf=False, save=False)


def test_stats_since_subtracts_every_counter():
    before = SpecStats(verify_steps=2, draft_tokens=6, accepted_tokens=3, emitted_tokens=5, skipped_steps=1,
                       spec_steps=2, draft_s=0.5, verify_s=1.0, step_s=2.0)
    now = SpecStats(verify_steps=5, draft_tokens=15, accepted_tokens=9, emitted_tokens=14, skipped_steps=4,
                    spec_steps=5, draft_s=1.0, verify_s=2.5, step_s=4.0)
    d = stats_since(now, before)
    assert (d.verify_steps, d.draft_tokens, d.accepted_tokens, d.emitted_tokens, d.skipped_steps) == (3, 9, 6, 9, 3)
    assert d.tokens_per_call == pytest.approx((9 + 3) / (3 + 3)) and d.acceptance_rate == pytest.approx(6 / 9)
    # 3 steps: 0.5 s drafting, 1.5 s verifying, 2.0 s in all -> nothing else
    assert d.per_step_ms() == pytest.approx({"draft_ms": 500 / 3, "verify_ms": 500, "overhead_ms": 0.0,
                                             "step_ms": 2000 / 3})


def test_projected_speedup_weighs_verify_steps_and_plain_steps_by_their_time():
    # every call verifies, 4 tokens each, a step of 1 ms draft + 1.1 × 10 ms verify + 0 overhead: 4 × 10 / 12
    row = {"tokens_per_call": 4.0, "verify_steps": 8, "skipped_steps": 0, "draft_ms": 1.0, "overhead_ms": 0.0}
    assert projected_speedup(row, 10.0, 1.1) == pytest.approx(40 / 12)
    # half the calls plain (1 token, 10 ms), half verifying 3 tokens in 20 ms: 4 tokens in 30 ms vs 3 in 30 ms
    row = {"tokens_per_call": 2.0, "verify_steps": 5, "skipped_steps": 5, "draft_ms": 0.0, "overhead_ms": 0.0}
    assert projected_speedup(row, 10.0, 2.0) == pytest.approx(2.0 * 10 / 15)
    assert projected_speedup({"tokens_per_call": None}, 10.0, 1.1) is None


def test_nonsense_projection_inputs_and_a_later_snapshot_as_before_are_value_errors():
    row = {"verify_steps": 10, "skipped_steps": 0, "draft_ms": 0.0, "overhead_ms": 1.0, "tokens_per_call": 4.0}
    with pytest.raises(ValueError, match="plain_ms and verify_ratio must be > 0"):
        projected_speedup(row, 0.0, 1.1)
    with pytest.raises(ValueError, match="verify_ratio"):
        projected_speedup(row, 10.0, -1.0)
    early, late = SpecStats(verify_steps=1, emitted_tokens=2), SpecStats(verify_steps=3, emitted_tokens=7)
    with pytest.raises(ValueError, match="earlier snapshot"):
        stats_since(early, late)
