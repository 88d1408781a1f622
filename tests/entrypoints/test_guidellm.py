"""guidellm, the vLLM project's load generator, against the live server: its default request shape (streamed chat
completions with ``stream_options.continuous_usage_stats``, ``max_completion_tokens``, ``ignore_eos``) must
complete every request.  guidellm runs as its own process, as a user runs it; its tokenizer (for the synthetic
prompts' lengths) is the default model's, saved to a local directory — nothing comes from a model hub."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")
if importlib.util.find_spec("guidellm") is None:
    pytest.skip("guidellm is not installed (it is in the dev extra: pip install -e '.[dev]')", allow_module_level=True)
from test_openai_server import MODEL, LiveServer, tiny_hf_model  # noqa: E402

from minillm import EngineConfig, LLMEngine, ModelConfig  # noqa: E402
from minillm.entrypoints.openai.server import build_app  # noqa: E402
from minillm.models.loader import build_model, load_tokenizer  # noqa: E402


@pytest.mark.slow  # guidellm's own start-up (imports, worker processes) dominates
def test_guidellm_streaming_benchmark_completes_every_request(tmp_path):
    import torch

    tokenizer = load_tokenizer(None)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    hf = tiny_hf_model()
    model = build_model(ModelConfig.from_hf(hf.config), hf.state_dict(), dtype=torch.float32, device="cpu")
    server = LiveServer(build_app(LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=4))))
    try:
        cmd = [sys.executable, "-m", "guidellm", "run", "--backend", f"kind=openai_http,target={server.url}",
               "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=8",
               "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
               "--tokenizer", f"kind=hf_auto,model={tmp_path / 'tokenizer'}",
               "--output", f"kind=json,path={tmp_path / 'out.json'}", "--disable-console-interactive"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    finally:
        server.stop()
    bench = json.loads((tmp_path / "out.json").read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    assert totals == {"successful": 8, "errored": 0, "incomplete": 0, "total": 8}, totals
    done = bench["requests"]["successful"]
    assert all(json.loads(q["request_args"])["body"]["model"] == MODEL for q in done)  # discovered via /v1/models
    assert all(json.loads(q["request_args"])["body"]["stream_options"]["continuous_usage_stats"] for q in done)
    assert [q["output_tokens"] for q in done] == [16] * 8  # read from the usage the server streamed
