"""The command line: streaming generation with metrics, interactive chat, clear errors; flags generated from the
config dataclasses."""

import dataclasses
import subprocess
import sys

import pytest

from minillm.config import POLICIES, EngineConfig, ParallelConfig, SpeculativeConfig
from minillm.entrypoints import cli
from minillm.entrypoints.arg_utils import engine_kwargs, field_docs
from minillm.sampling.params import SamplingParams


def run(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, input=stdin,
                          timeout=300)


@pytest.mark.slow
def test_generate_streams_text_then_prints_ttft_tpot_and_mbu():
    r = run("generate", "The capital of France is", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "TTFT" in r.stderr and "TPOT" in r.stderr and "tok/s" in r.stderr and "MBU" in r.stderr


def test_the_mbu_line_counts_the_weights_as_the_model_stores_them(monkeypatch, capsys):
    """An int4 model's decode reads its packed bytes, not the fp32 weights its activations' dtype would give."""
    import io
    import re
    import types

    import torch

    from minillm.models.loader import load_model
    from minillm.outputs import RequestMetrics
    from minillm.perf import machine
    from minillm.perf.bench.quant import weight_bytes_per_step
    from minillm.perf.roofline import decode_step_cost

    monkeypatch.setattr(machine, "machine_spec", lambda device, quick=True: types.SimpleNamespace(
        memory_bandwidth=100e9))
    m = RequestMetrics(prompt_tokens=10, start_s=0.0)
    for i in range(11):  # the first token at 0.1 s, then one every 0.1 s: 10 decode tok/s
        m.record_token(0.1 * (i + 1))
    m.finish_s = 1.1
    reports = {}
    for quant in (None, "int4"):
        model = load_model(None, dtype="float32", device="cpu", quantization=quant)
        out = io.StringIO()
        cli._print_metrics(types.SimpleNamespace(model=model), m, out=out)
        step = decode_step_cost(model.config, batch=1, kv_len=15, dtype=torch.float32)
        want = (step.bytes - step.breakdown["weights"] + weight_bytes_per_step(model)) * m.decode_tokens_per_s
        got = float(re.search(r"([\d.]+) GB/s = MBU", out.getvalue()).group(1)) * 1e9
        assert abs(got - want) <= 0.06e9, (quant, out.getvalue())
        reports[quant] = got
    assert reports["int4"] < reports[None] / 4  # ~5.6x fewer bytes than fp32


@pytest.mark.slow
def test_chat_answers_and_exits():
    r = run("chat", "--max-tokens", "12", stdin="What is the capital of France?\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "assistant>" in r.stdout and "Paris" in r.stdout


@pytest.mark.slow
def test_bad_sampling_value_is_a_clear_error():
    r = run("generate", "hi", "--temperature", "-1")
    assert r.returncode == 2
    assert "temperature must be" in r.stderr


# ---- flags generated from the config dataclasses ------------------------------------------------------------------
# one non-default value per EngineConfig field (kv_cache_bytes excluded: it may not join num_kv_blocks)
ENGINE_ARGV = {
    "policy": ("--policy", "static"), "block_size": ("--block-size", "32"), "num_kv_blocks": ("--num-kv-blocks", "64"),
    "max_num_seqs": ("--max-num-seqs", "4"), "max_num_batched_tokens": ("--max-num-batched-tokens", "256"),
    "enable_prefix_caching": ("--no-enable-prefix-caching",), "chunked_prefill": ("--no-chunked-prefill",),
    "preemption": ("--preemption", "swap"), "num_host_blocks": ("--num-host-blocks", "8"),
    "dynamic_window_s": ("--dynamic-window-s", "0.5"), "pad_batches": ("--no-pad-batches",),
    "max_model_len": ("--max-model-len", "1024"), "return_logits": ("--return-logits",),
    "enforce_eager": ("--enforce-eager",), "kv_cache_dtype": ("--kv-cache-dtype", "int8"),
    "speculative_config": ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'),
    "parallel_config": ("--tensor-parallel-size", "2"),
    "gpu_memory_utilization": ("--gpu-memory-utilization", "0.5"),
}
ENGINE_EXPECTED = EngineConfig(
    policy="static", block_size=32, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256,
    enable_prefix_caching=False, chunked_prefill=False, preemption="swap", num_host_blocks=8, dynamic_window_s=0.5,
    pad_batches=False, max_model_len=1024, return_logits=True, enforce_eager=True, kv_cache_dtype="int8",
    speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3),
    parallel_config=ParallelConfig(tensor_parallel_size=2), gpu_memory_utilization=0.5)


def parse(*argv):
    return cli.build_parser().parse_args(list(argv))


def help_text(*argv, capsys) -> str:
    with pytest.raises(SystemExit):
        parse(*argv, "--help")
    return " ".join(capsys.readouterr().out.split())


def test_every_engine_and_parallel_field_has_a_serve_flag(capsys):
    text = help_text("serve", capsys=capsys)
    names = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "parallel_config"]
    names += [f.name for f in dataclasses.fields(ParallelConfig)]  # flattened: --tensor-parallel-size
    for name in names:
        assert f"--{name.replace('_', '-')} " in text, name


def test_serve_flags_parse_to_the_engine_config_built_directly():
    eviction = {"kv_eviction", "sink_tokens", "window_tokens", "heavy_tokens"}  # not with speculative_config: below
    assert set(ENGINE_ARGV) | {"kv_cache_bytes"} | eviction == {f.name for f in dataclasses.fields(EngineConfig)}
    a = parse("serve", *(arg for args in ENGINE_ARGV.values() for arg in args))
    assert EngineConfig(**engine_kwargs(a)) == ENGINE_EXPECTED
    a = parse("serve", "--kv-cache-bytes", "1000000", "--pipeline-parallel-size", "3")
    assert EngineConfig(**engine_kwargs(a)) == EngineConfig(kv_cache_bytes=1000000,
                                                           parallel_config={"pipeline_parallel_size": 3})
    a = parse("serve", "--kv-eviction", "sink", "--sink-tokens", "2", "--window-tokens", "64")
    assert EngineConfig(**engine_kwargs(a)) == EngineConfig(kv_eviction="sink", sink_tokens=2, window_tokens=64)
    a = parse("serve", "--kv-eviction", "h2o", "--window-tokens", "64", "--heavy-tokens", "32")
    assert EngineConfig(**engine_kwargs(a)) == EngineConfig(kv_eviction="h2o", window_tokens=64, heavy_tokens=32)


def test_flags_left_out_leave_the_configs_defaults():
    a = parse("serve")
    assert engine_kwargs(a) == {} and EngineConfig(**engine_kwargs(a)) == EngineConfig()
    assert (a.host, a.port, a.max_queue, a.shutdown_timeout, a.kernels) == ("127.0.0.1", 8000, 64, 10.0, "auto")


def test_generate_and_chat_take_the_engine_options_and_keep_their_sampling_defaults():
    g = parse("generate", "hi", "--max-num-seqs", "2", "--max-num-batched-tokens", "64")
    assert engine_kwargs(g) == {"max_num_seqs": 2, "max_num_batched_tokens": 64}
    assert cli._params(g) == SamplingParams(max_tokens=128, temperature=0.0)
    c = parse("chat", "--top-k", "5", "--stop", "\n", "--stop", "END", "--ignore-eos", "--seed", "7")
    assert cli._params(c) == SamplingParams(max_tokens=256, temperature=0.0, top_k=5, stop=("\n", "END"),
                                            ignore_eos=True, seed=7)


def test_kernels_compiled_is_accepted_by_every_model_command():
    assert parse("serve", "--kernels", "compiled").kernels == "compiled"
    assert parse("generate", "hi", "--kernels", "compiled").kernels == "compiled"
    assert parse("chat", "--kernels", "compiled").kernels == "compiled"
    assert parse("eval", "perplexity", "--kernels", "compiled").kernels == "compiled"


@pytest.mark.parametrize("argv, allowed", [
    (("serve", "--policy", "fifo"), POLICIES),
    (("generate", "hi", "--kernels", "cuda"), ("auto", "torch", "native", "triton", "compiled")),
    (("serve", "--kv-cache-dtype", "int4"), ("auto", "int8", "fp8")),
])
def test_a_bad_choice_is_refused_by_argparse_naming_the_allowed_values(argv, allowed, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"invalid choice: {argv[-1]!r}" in err and all(repr(v) in err for v in allowed)


def test_help_text_comes_from_the_field_docs(capsys):
    text = help_text("serve", capsys=capsys)
    assert "admits and retires requests every step" in text  # EngineConfig.policy's doc
    assert " ".join(field_docs(ParallelConfig)["tensor_parallel_size"].replace("``", "").split()[:6]) in text
    assert "Nucleus sampling" in help_text("generate", "x", capsys=capsys)  # SamplingParams.top_p's doc


def test_a_replica_gets_every_model_engine_and_server_option_given():
    argv = ["serve", "/models/smol", "--replicas", "2", "--port", "9000", "--routing", "round_robin",
            "--dtype", "float32", "--kernels", "compiled", "--api-key", "k", "--ttft-slo-ms", "500",
            "--allowed-hosts", "api.example",
            *(arg for args in ENGINE_ARGV.values() for arg in args)]
    replica_argv = cli._replica_args(parse(*argv))
    assert replica_argv[0] == "/models/smol"
    assert not {"--replicas", "--port", "--routing", "--host"} & set(replica_argv)
    replica = parse("serve", *replica_argv)
    assert EngineConfig(**engine_kwargs(replica)) == ENGINE_EXPECTED
    assert (replica.dtype, replica.kernels, replica.ttft_slo_ms) == ("float32", "compiled", 500)
    assert (replica.max_queue, replica.shutdown_timeout) == (64, 10.0)
    assert "k" not in replica_argv and replica.api_key is None  # the key travels in the environment, not argv
    assert replica.allowed_hosts is None  # the front checks Host; replicas see the front's loopback requests
    assert cli.api_key(replica, environ={"MINILLM_API_KEY": "k"}) == "k"


def test_the_api_key_comes_from_the_flag_the_file_or_the_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert cli.api_key(parse("serve", "--api-key", "flag"), environ={"MINILLM_API_KEY": "env"}) == "flag"
    assert cli.api_key(parse("serve", "--api-key-file", str(key_file)), environ={}) == "from-file"
    assert cli.api_key(parse("serve"), environ={"MINILLM_API_KEY": "env"}) == "env"
    assert cli.api_key(parse("serve"), environ={}) is None
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="api-key-file .* is empty"):
        cli.api_key(parse("serve", "--api-key-file", str(key_file)), environ={})


def test_a_bad_speculative_config_is_refused_as_not_json(capsys):
    with pytest.raises(SystemExit):
        parse("serve", "--speculative-config", "ngram")
    assert "not valid JSON" in capsys.readouterr().err


def test_make_model_writes_the_shape_it_is_asked_for(tmp_path, capsys):
    import json

    assert cli.main(["make-model", "--shape", "tiny", "--out", str(tmp_path), "--gguf", "Q8_0",
                     "--dtype", "float32", "--seed", "1"]) == 0
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 2
    assert (tmp_path / "tiny-Q8_0.gguf").is_file()
    assert "tiny-Q8_0.gguf" in capsys.readouterr().out


@pytest.mark.parametrize("argv, named", [
    (["make-model", "--shape", "tiny"], "--out"),
    (["make-model", "--shape", "tiny", "--out", "x", "--gguf", "q5_k"], "q5_k"),
    (["bench", "cpu-peers", "--formats", "int3"], "int3"),
    (["bench", "cpu-peers", "--prompt-lens", "128,lots"], "--prompt-lens"),
    (["bench", "cpu-peers", "--neighbour", "stream"], "stream"),
])
def test_make_model_and_cpu_peers_name_a_bad_value(argv, named, capsys):
    assert cli.main(argv) == 2
    assert named in capsys.readouterr().err
