"""eval long-context: perplexity through the engine per eviction policy on a tiny random Llama — full cache equals
perf.perplexity's, eviction happens during the chunked prompt and bounds the blocks, the CLI's JSON (no timing
asserted)."""

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import ModelConfig
from minillm.entrypoints.cli import main
from minillm.models.loader import build_model
from minillm.perf.long_context import kept_tokens, long_context_eval, run_policy
from minillm.perf.perplexity import perplexity

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
W, K, BS = 32, 4, 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    return build_model(ModelConfig.from_hf(hf.config), hf.state_dict(), dtype=torch.float32, device="cpu",
                       kernels="torch")


def text(n, seed=1):
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed))


def test_full_cache_perplexity_equals_the_plain_forward(model):
    ids = text(100)
    row = run_policy(model, ids, window_tokens=None, block_size=BS, chunk_tokens=8, decode_tokens=4)
    want = perplexity(model, ids, window=100, stride=100)  # the text fits one window: one causal forward
    assert row.num_tokens == 100 and row.policy == "full"
    assert row.nll == pytest.approx(want.nll, rel=1e-4)
    assert row.blocks_held == -(-(100 + 3) // BS)  # every position's block, held to the end


def test_a_window_longer_than_the_text_changes_nothing(model):
    ids = text(40)
    full = run_policy(model, ids, window_tokens=None, block_size=BS, chunk_tokens=8, decode_tokens=4)
    wide = run_policy(model, ids, window_tokens=64, block_size=BS, chunk_tokens=8, decode_tokens=4)
    assert wide.nll == pytest.approx(full.nll, rel=1e-5) and wide.blocks_held == full.blocks_held


def test_eviction_happens_during_the_prompt_and_bounds_the_blocks(model):
    ids = text(200)
    rows = {r.policy: r for r in long_context_eval(model, ids, window_tokens=W, sink_tokens=K, block_size=BS,
                                                   chunk_tokens=8, decode_tokens=4)}
    full, window, sinks = rows["full"], rows["window"], rows["sinks"]
    bound = -(-W // BS) + 1  # the window's blocks and one being filled
    assert window.blocks_after_prompt <= bound < full.blocks_after_prompt  # freed while the prompt was read
    assert window.blocks_held <= bound and sinks.blocks_held <= bound + 1  # + the sink block
    assert full.blocks_held == -(-(200 + 3) // BS)
    assert window.kv_bytes_held < full.kv_bytes_held
    # the evicted keys are gone from later tokens' attention: a different (finite) perplexity
    assert window.nll != pytest.approx(full.nll, rel=1e-4) and sinks.nll != pytest.approx(window.nll, rel=1e-4)
    per_token = full.kv_bytes_read_per_token / (200 + 3)
    assert window.kv_bytes_read_per_token == W * per_token and sinks.kv_bytes_read_per_token == (W + K) * per_token


def test_kept_tokens():
    assert kept_tokens(9, None) == 10 and kept_tokens(9, 16, 4) == 10  # inside the window: every key
    assert kept_tokens(100, 16) == 16 and kept_tokens(100, 16, 4) == 20 and kept_tokens(17, 16, 4) == 18


def test_bad_settings_raise(model):
    with pytest.raises(ValueError, match="sink_tokens"):
        long_context_eval(model, text(20), window_tokens=4, sink_tokens=4)
    with pytest.raises(ValueError, match="policy"):
        long_context_eval(model, text(20), window_tokens=8, policies=("lru",))
    with pytest.raises(ValueError, match="heavy_tokens"):
        long_context_eval(model, text(20), window_tokens=8, heavy_tokens=0, policies=("h2o",))


def test_cli_writes_json(tmp_path, model, monkeypatch, capsys):
    import minillm.models.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: model)
    monkeypatch.setattr(loader, "load_tokenizer", lambda *a, **k: None)
    monkeypatch.setattr("minillm.perf.perplexity.heldout_token_ids", lambda tok, split, n: text(n))
    out = tmp_path / "lc.json"
    assert main(["eval", "long-context", "--max-tokens", "120", "--window-tokens", "32", "--sink-tokens", "4",
                 "--block-size", "4", "--decode-tokens", "4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["full", "window", "sinks", "h2o"] and rows[0]["num_tokens"] == 120
    assert rows[3]["heavy_tokens"] == 1024  # the CLI's default budget
    assert "policy" in capsys.readouterr().out


def test_cli_runs_only_the_policies_asked_for(tmp_path, model, monkeypatch, capsys):
    import minillm.models.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: model)
    monkeypatch.setattr(loader, "load_tokenizer", lambda *a, **k: None)
    monkeypatch.setattr("minillm.perf.perplexity.heldout_token_ids", lambda tok, split, n: text(n))
    out = tmp_path / "lc.json"
    base = ["eval", "long-context", "--max-tokens", "60", "--window-tokens", "16", "--block-size", "4",
            "--decode-tokens", "2", "--json", str(out)]
    assert main(base + ["--policies", "sinks, full"]) == 0
    assert [r["policy"] for r in json.loads(out.read_text())["rows"]] == ["sinks", "full"]
    capsys.readouterr()
    assert main(base + ["--policies", "full,lru"]) == 2
    err = capsys.readouterr().err
    assert "--policies 'full,lru'" in err and "full, window, sinks, h2o" in err


def test_the_engine_runs_a_given_policy_class(model):
    from minillm.kv.eviction import KVEvictionPolicy

    class KeepAll(KVEvictionPolicy):  # a rule that never frees: the blocks of the full cache, whatever the window
        def freeable_blocks(self, num_computed, block_size):
            return range(0)

    ids = text(120)
    kept = run_policy(model, ids, window_tokens=W, block_size=BS, chunk_tokens=8, decode_tokens=4, policy_class=KeepAll)
    evicted = run_policy(model, ids, window_tokens=W, block_size=BS, chunk_tokens=8, decode_tokens=4)
    assert kept.blocks_held == -(-(120 + 3) // BS) > evicted.blocks_held
    assert kept.nll == pytest.approx(evicted.nll, rel=1e-5)  # the kernels mask by the window either way


def test_h2o_row_holds_sinks_window_and_heavy_blocks_and_reads_only_those(model):
    ids = text(200)
    full, h2o = long_context_eval(model, ids, window_tokens=W, sink_tokens=K, heavy_tokens=16, block_size=BS,
                                  chunk_tokens=8, decode_tokens=4, policies=("full", "h2o"))
    bound = 1 + 16 // BS + W // BS + 2  # sink block, heavy blocks, the window's span and one being filled
    assert h2o.policy == "h2o" and h2o.heavy_tokens == 16
    assert h2o.blocks_held <= bound < full.blocks_held and h2o.blocks_after_prompt <= bound
    assert h2o.nll != pytest.approx(full.nll, rel=1e-4) and math.isfinite(h2o.nll)
    per_token = full.kv_bytes_read_per_token / (200 + 3)
    assert h2o.kv_bytes_read_per_token <= bound * BS * per_token < full.kv_bytes_read_per_token
