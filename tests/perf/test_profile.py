"""minillm.perf.profile: the decode profile reports ops and a time split that adds up, and leaves the LLM as it was."""

import pytest

from minillm.perf.profile import profile_decode


@pytest.fixture(scope="module")
def llm():
    from minillm import LLM

    return LLM(dtype="float32", device="cpu")


@pytest.mark.parametrize("path", ["engine", "cached"])
def test_profile_decode_counts_ops_per_decode_token_and_splits_the_time_that_it_measured(llm, path):
    report = profile_decode(llm, path, n_tokens=4, prompt_len=8, repeats=1, top=5)
    assert report.n_tokens == 3  # the first token carries the prefill and is left out
    assert report.aten_ops_per_token >= 1  # (the fused CPU decode step runs every layer in one native call)
    assert len(report.top_ops) == 5 and all(name.startswith("aten::") for name, _ in report.top_ops)
    assert report.split_ms["forward"] > 0
    assert sum(report.split_ms.values()) == pytest.approx(report.ms_per_token)
    assert report.tokens_per_s == pytest.approx(1e3 / report.ms_per_token)
    assert "ATen ops/token" in report.format()


def test_profile_decode_leaves_no_timing_wrappers_behind(llm):
    profile_decode(llm, "engine", n_tokens=2, prompt_len=4, repeats=1)
    eng = llm.engine
    for obj, name in [(llm.model, "hidden_states"), (eng, "step"), (eng.runner, "run"),
                      (eng.scheduler, "schedule"), (eng, "_postprocess")]:
        assert name not in vars(obj)


def test_profile_decode_rejects_an_unknown_path_and_too_few_tokens(llm):
    with pytest.raises(ValueError, match="path"):
        profile_decode(llm, "naive")
    with pytest.raises(ValueError, match="n_tokens"):
        profile_decode(llm, "engine", n_tokens=1)
