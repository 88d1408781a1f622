"""``bench serve``'s trace replayed through the scheduler under several policies with the same step costs (no
model, no clock): the requests are the server's, the step costs the given ones, and the output names each
policy."""

import json

import pytest

from minillm.engine.inputs import chat_prompt_ids
from minillm.models.loader import load_config, load_tokenizer, resolve
from minillm.perf.bench.serve import make_trace
from minillm.perf.bench.serve_policy import (
    POLICIES,
    MeasuredStepTime,
    format_policies,
    main,
    replay_policies,
    slowest_first_token,
    trace_specs,
)
from minillm.perf.simulate import StepChunk


def test_measured_step_time_prices_decode_only_and_mixed_steps_apart():
    st = MeasuredStepTime(prefill_s_per_token=0.002, step_s=0.03, decode_step_s=0.02, decode_s_per_row=0.001)
    assert st([StepChunk(1, 10)] * 4) == pytest.approx(0.02 + 3 * 0.001)
    assert st([StepChunk(1, 10)] * 4 + [StepChunk(100, 0)]) == pytest.approx(0.03 + 104 * 0.002)
    with pytest.raises(ValueError, match="prefill_s_per_token"):
        MeasuredStepTime(prefill_s_per_token=-1.0)


def test_trace_specs_are_the_load_generators_requests_as_the_server_tokenizes_them():
    tok = load_tokenizer()
    specs = trace_specs(tok, 3, 2.0, 16, seed=1)
    trace = make_trace(3, 2.0, 16, 1)
    assert [s.arrival_s for s in specs] == [r.arrival_s for r in trace]
    assert [s.max_tokens for s in specs] == [16] * 3
    assert list(specs[0].prompt_token_ids) == chat_prompt_ids(tok, [{"role": "user", "content": trace[0].prompt}])


def test_policies_replay_the_same_requests_with_the_same_costs():
    specs = trace_specs(load_tokenizer(), 6, 4.0, 8)
    policies = {**POLICIES, "budget 64": {"max_num_batched_tokens": 64}}
    reports = replay_policies(specs, load_config(resolve(None)), MeasuredStepTime(), policies)
    assert set(reports) == {"minillm", "vllm-cpu", "budget 64"}
    for rep in reports.values():
        assert [r.prompt_tokens for r in rep.records] == [len(s.prompt_token_ids) for s in specs]
        assert rep.output_tokens == 6 * 8
    # a small budget splits prompts over more steps; vLLM's 2048 never splits these
    assert max(s.prefill_tokens for s in reports["budget 64"].step_log) <= 64
    assert reports["budget 64"].steps > reports["vllm-cpu"].steps
    worst = slowest_first_token(reports["minillm"])
    assert worst["ttft_s"] == max(r.ttft_s for r in reports["minillm"].records)
    assert worst["steps"] == len(worst["step_log"]) >= 1
    table = format_policies(reports, policies).splitlines()
    assert [line.split()[0] for line in table[1:]] == ["minillm", "vllm-cpu", "budget"]
    assert table[2].split()[1:3] == ["2048", "128"]


def test_main_saves_every_policys_step_log(tmp_path, capsys):
    assert main(["--num-prompts", "4", "--max-tokens", "4", "--request-rate", "8", "--budgets", "32",
                 "--prefill-tok-s", "1000", "--result-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("serve-policy-*.json")
    payload = json.loads(path.read_text())
    assert payload["step_time"]["prefill_s_per_token"] == pytest.approx(1e-3)
    assert set(payload["policies"]) == {"minillm", "vllm-cpu", "budget 32"}
    for run in payload["policies"].values():
        assert len(run["step_log"]) == run["steps"] and "slowest_first_token" in run
    assert "vllm-cpu" in capsys.readouterr().out
    assert main(["--prefill-tok-s", "0", "--no-save"]) == 2
