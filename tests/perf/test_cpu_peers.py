"""``bench cpu-peers`` on the tiny shape: every (format, peer) gets a row with the roofline fields, peers that are
not installed or that die are reported, never fatal.  Nothing here asserts a speed."""

from __future__ import annotations

import json
import sys

import pytest

from minillm.perf.bench.cpu_peers import bench_cpu_peers, weight_bytes
from minillm.perf.bench.llamacpp import LlamaCppPeer, PeerDied, describe_exit


@pytest.fixture(scope="module")
def payload(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cpu-peers")
    return bench_cpu_peers(shapes=("tiny",), formats=("fp32", "q4_1", "q4_0"), prompt_lens=(8, 24), threads=1,
                           repeats=1, n_tokens=4, models_dir=tmp / "models", out=tmp / "peers.json",
                           probe_bytes=8 << 20, matmul_n=128)


def test_writes_one_json_with_the_machine_the_probes_and_a_row_per_format_and_peer(payload):
    saved = json.loads(open(payload["path"]).read())
    assert saved["benchmark"] == "cpu-peers" and saved["cpu"]["model"] and isinstance(saved["cpu"]["flags"], list)
    assert saved["read_bandwidth_gb_s"] > 0 and saved["matmul_peak_gflop_s"]["float32"] > 0
    passes = saved["read_passes_gb_s"]  # three timed passes per probe turn: the best is the roof, the median beside it
    assert len(passes) >= 3 and len(passes) % 3 == 0 and saved["read_bandwidth_gb_s"] == max(passes)
    assert min(passes) <= saved["read_bandwidth_median_gb_s"] <= max(passes)
    assert saved["neighbour"] == {"kind": "none"}
    peers = {(r["format"], r["peer"]) for r in saved["rows"]}
    assert peers == {("fp32", "minillm"), ("fp32", "transformers"), ("q4_1", "minillm"), ("q4_1", "llama.cpp"),
                     ("q4_0", "minillm"), ("q4_0", "llama.cpp")}


def test_rows_that_ran_carry_decode_and_prefill_in_roofline_units(payload):
    ran = [r for r in payload["rows"] if r["status"] == "ok"]
    assert {(r["format"], r["peer"]) for r in ran} >= {("fp32", "minillm"), ("fp32", "transformers"),
                                                       ("q4_1", "minillm"), ("q4_0", "minillm")}
    for r in ran:
        assert r["decode_tok_s"] > 0 and r["decode_gb_s"] > 0
        assert 0 < r["decode_pct_read"] <= r["decode_pct_read_median"]
        assert [p["prompt_len"] for p in r["prefill"]] == [8, 24]
        assert all(p["tok_s"] > 0 and p["gflop_s"] > 0 and p["pct_matmul_peak"] > 0 for p in r["prefill"])
    ratio = next(q for q in payload["ratios"] if q["peer"] == "transformers")
    assert ratio["decode"] > 0 and set(ratio["prefill"]) == {"8", "24"}


def test_a_peer_that_cannot_run_is_reported_with_its_reason(payload):
    rows = {(r["format"], r["peer"]): r for r in payload["rows"]}
    llama = rows[("q4_1", "llama.cpp")]
    if llama["status"] != "ok":  # llama-cpp-python is optional
        assert llama["status"] in ("skipped", "failed") and llama["reason"]


def test_quantized_formats_read_fewer_bytes_per_step_than_floats():
    from minillm.models.synthetic import synthetic_config

    c = synthetic_config("llama-3.2-1b")
    fp32, q8, q4_1, q4_0 = (weight_bytes(c, f) for f in ("fp32", "q8_0", "q4_1", "q4_0"))
    assert fp32 > q8 > q4_1 > q4_0
    assert fp32 == pytest.approx(4 * c.num_parameters(include_embeddings=False) + 4 * c.vocab_size * c.hidden_size,
                                 rel=1e-6)  # tied: the head reads the embedding table once


def test_a_worker_killed_by_sigill_is_reported_not_fatal(tmp_path):
    die = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"
    peer = LlamaCppPeer(tmp_path / "x.gguf", threads=1, n_ctx=64, command=(sys.executable, "-c", die))
    with pytest.raises(PeerDied, match="SIGILL.*GGML_NATIVE"):
        peer.load()
    assert describe_exit(3, "a\nb\nTraceback: boom") == "exited with status 3: a | b | Traceback: boom"


def test_rejects_unknown_formats_and_shapes(tmp_path):
    with pytest.raises(ValueError, match="q5_k"):
        bench_cpu_peers(shapes=("tiny",), formats=("q5_k",), models_dir=tmp_path, save=False)
    with pytest.raises(ValueError, match="shape must be one of"):
        bench_cpu_peers(shapes=("llama-9",), models_dir=tmp_path, save=False)
    with pytest.raises(ValueError, match="--neighbour must be one of none, copy, compute, got 'stream'"):
        bench_cpu_peers(shapes=("tiny",), neighbour="stream", models_dir=tmp_path, save=False)
    assert not any(tmp_path.iterdir())  # refused before making a checkpoint


FAKE_LLAMA_CPP = '''
"""A stand-in for llama-cpp-python with the calls the worker makes: each eval sleeps 1 ms per token."""
import ctypes, time
__version__ = "0.0-fake"
_logits = (ctypes.c_float * 8)(*[0, 0, 0, 5, 0, 0, 0, 0])
def llama_get_logits_ith(ctx, i):
    return _logits
class Llama:
    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, verbose):
        open(model_path).close()  # the file must exist
        self.ctx, self.n_tokens = object(), 0
    def n_vocab(self):
        return 8
    def reset(self):
        self.n_tokens = 0
    def eval(self, tokens):
        time.sleep(0.001 * len(tokens))
        self.n_tokens += len(tokens)
'''


@pytest.fixture
def fake_llama_cpp(tmp_path, monkeypatch):
    """``FAKE_LLAMA_CPP`` importable here and in the worker processes; returns an (empty) GGUF path it accepts."""
    (tmp_path / "fake" / "llama_cpp").mkdir(parents=True)
    (tmp_path / "fake" / "llama_cpp" / "__init__.py").write_text(FAKE_LLAMA_CPP)
    (tmp_path / "m.gguf").write_bytes(b"")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    return tmp_path / "m.gguf"


def test_the_llamacpp_worker_answers_decode_and_prefill_over_its_pipe(fake_llama_cpp, tmp_path):
    peer = LlamaCppPeer(fake_llama_cpp, threads=1, n_ctx=64)
    peer.load()
    try:
        assert peer.version == "0.0-fake"
        assert 0 < peer.decode([1, 2, 3], 5) <= 1000  # 5 steps of >= 1 ms each
        assert 0 < peer.prefill(list(range(20))) <= 1000
    finally:
        peer.close()
    assert peer.proc is None
    with pytest.raises(PeerDied, match="status 1.*FileNotFoundError"):  # its error, not a hang
        LlamaCppPeer(tmp_path / "missing.gguf", threads=1, n_ctx=64).load()


def test_bench_quant_runs_its_llama_cpp_row_through_the_worker(fake_llama_cpp, tmp_path):
    from minillm.perf.bench.quant import _llama_cpp_row

    row = _llama_cpp_row(fake_llama_cpp, [1, 2, 3], 4, repeats=3)
    assert row["scheme"] == "llama.cpp Q4_1" and 0 < row["decode_b1_tok_s"] <= 1000
    assert "error" in _llama_cpp_row(tmp_path / "missing.gguf", [1, 2, 3], 4, repeats=1)


def test_each_peer_counts_the_bytes_it_stores_which_for_a_gguf_s_own_blocks_are_the_plan(payload):
    from pathlib import Path

    from minillm.models.synthetic import synthetic_config
    from minillm.perf.bench.cpu_peers import MinillmPeer, gguf_path
    from minillm.perf.bench.llamacpp import gguf_weight_bytes

    models, c = Path(payload["models_dir"]) / "tiny", synthetic_config("tiny")
    for fmt in ("q4_1", "q4_0"):
        peer = MinillmPeer(models, "tiny", fmt)
        peer.load()
        assert peer.weight_bytes() == weight_bytes(c, fmt) == gguf_weight_bytes(gguf_path(models, "tiny", fmt))
        peer.close()
    rows = {(r["format"], r["peer"]): r for r in payload["rows"]}
    assert rows[("q4_0", "minillm")]["decode_bytes_per_token"] < rows[("q4_1", "minillm")]["decode_bytes_per_token"]


def test_a_q4_k_m_model_needs_llama_cpp_s_quantizer_and_says_so_before_writing_anything(tmp_path, monkeypatch):
    from minillm.models import synthetic
    from minillm.models.synthetic import make_model

    monkeypatch.setattr(synthetic, "llama_cpp_unavailable", lambda: "llama-cpp-python is not installed")
    with pytest.raises(ValueError, match="q4_k_m is written by llama.cpp's quantizer, but llama-cpp-python is not"):
        make_model("tiny", tmp_path / "m", gguf=("q4_k_m",))
    assert not (tmp_path / "m").exists()


def test_without_llama_cpp_a_q4_k_m_row_says_why_and_the_other_formats_run(tmp_path, monkeypatch):
    from minillm.models import synthetic

    monkeypatch.setattr(synthetic, "llama_cpp_unavailable", lambda: "llama-cpp-python is not installed")
    got = bench_cpu_peers(shapes=("tiny",), formats=("q4_0", "q4_k_m"), prompt_lens=(8,), threads=1, repeats=1,
                          n_tokens=4, models_dir=tmp_path, save=False, probe_bytes=8 << 20, matmul_n=64)
    rows = {(r["format"], r["peer"]): r for r in got["rows"]}
    assert rows[("q4_0", "minillm")]["status"] == "ok"
    for peer in ("minillm", "llama.cpp"):
        r = rows[("q4_k_m", peer)]
        assert r["status"] == "skipped" and "tiny-Q4_K_M.gguf" in r["reason"] and "llama-cpp-python" in r["reason"]
