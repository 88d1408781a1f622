"""Prefill/decode disaggregation on the virtual clock: K/V bytes from the config, the link's cost added exactly once,
no request lost, decode instances free of prefill interference, bad splits refused, runs reproducible."""

import dataclasses
import math

import pytest

from minillm import EngineConfig, ModelConfig
from minillm.perf.disagg import (
    KV_LINKS,
    PDSplit,
    Workload,
    best_split,
    colocated,
    disaggregated,
    kv_transfer_bytes,
    llama3_8b_config,
    max_rate_at_slo,
    sweep,
    transfer_seconds,
)
from minillm.perf.hardware import get_spec
from minillm.perf.simulate import RooflineStepTime, StepChunk, llama2_7b_config, simulate
from minillm.perf.tp_cost import Link
from minillm.perf.workloads import RequestSpec, random_corpus

SMALL = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                    num_kv_heads=2, head_dim=32, max_position_embeddings=4096)
STEP = RooflineStepTime(SMALL, get_spec("H100-SXM"), "bfloat16", overhead_s=1e-3)
ENGINE = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, num_kv_blocks=400)
INSTANT = Link("instant", math.inf, 0.0, "test: no transfer cost")
CORPUS = random_corpus(SMALL.vocab_size, n=8192, seed=0)


def one_request(prompt_len: int = 700, max_tokens: int = 20) -> list[RequestSpec]:
    return [RequestSpec(0.0, tuple(CORPUS[:prompt_len]), max_tokens)]


def test_kv_transfer_bytes_are_tokens_times_two_times_layers_kv_heads_head_dim_and_dtype_bytes():
    assert kv_transfer_bytes(llama2_7b_config(), 1000) == 1000 * 2 * 32 * 32 * 128 * 2  # MHA: 0.5 MiB a token
    assert kv_transfer_bytes(llama3_8b_config(), 1000) == 1000 * 2 * 32 * 8 * 128 * 2  # GQA: a quarter of it
    assert kv_transfer_bytes(SMALL, 10, "float32") == 10 * 2 * 4 * 2 * 32 * 4
    assert transfer_seconds(2e9, Link("x", 50e9, 1e-5, "test")) == pytest.approx(1e-5 + 0.04, rel=1e-12)


def test_with_an_instant_link_one_requests_ttft_is_the_colocated_prefill_plus_the_links_latency():
    trace = one_request()
    colo = colocated(trace, SMALL, ENGINE, STEP, 2).records[0]
    for latency in (0.0, 2e-3):
        link = dataclasses.replace(INSTANT, latency_s=latency)
        dis = disaggregated(trace, SMALL, ENGINE, STEP, PDSplit(2, 1, 1, link)).records[0]
        assert dis.ttft_s == pytest.approx(colo.ttft_s + latency, rel=1e-12, abs=1e-15)
        # the decode instance's steps are the colocated decodes: same TPOT, the end later by the latency only
        assert dis.tpot_s == pytest.approx(colo.tpot_s, rel=1e-12)
        assert dis.e2e_s == pytest.approx(colo.e2e_s + latency, rel=1e-12)


def test_a_slow_link_raises_ttft_by_exactly_the_bytes_over_the_bandwidth():
    trace = one_request(prompt_len=900)
    fast = disaggregated(trace, SMALL, ENGINE, STEP, PDSplit(2, 1, 1, INSTANT)).records[0]
    slow_link = Link("slow", 1e8, 0.0, "test")
    slow = disaggregated(trace, SMALL, ENGINE, STEP, PDSplit(2, 1, 1, slow_link)).records[0]
    nbytes = 900 * 2 * SMALL.num_layers * SMALL.num_kv_heads * SMALL.head_dim * 2  # bf16
    assert slow.ttft_s - fast.ttft_s == pytest.approx(nbytes / 1e8, rel=1e-9)
    assert slow.tpot_s == pytest.approx(fast.tpot_s, rel=1e-12)


def test_the_decode_instance_starts_from_the_transferred_cache_instead_of_prefilling_again():
    trace = one_request(prompt_len=700)
    rec = disaggregated(trace, SMALL, ENGINE, STEP, PDSplit(2, 1, 1, INSTANT)).records[0]
    # its first step there writes the first output token's K/V over the 700 transferred ones: one decode
    assert rec.itl_s[0] == pytest.approx(STEP([StepChunk(1, 700, True)]), rel=1e-12)


def mixed_trace(n: int, seed: int = 0) -> list[RequestSpec]:
    wl = Workload("mixed", (16, 600), (1, 40), 1.0, 0.1)
    return wl.trace(n, 200.0, CORPUS, seed)


@pytest.mark.parametrize("split", [PDSplit(4, 1, 3, KV_LINKS["PCIe"]), PDSplit(4, 3, 1, KV_LINKS["NVLink"])],
                         ids=lambda s: s.label)
def test_every_request_finishes_with_the_traces_token_counts_even_when_decode_instances_preempt(split):
    trace = mixed_trace(40)
    trace[5] = dataclasses.replace(trace[5], max_tokens=1)  # ends at the prefill instance: nothing to transfer
    tight = dataclasses.replace(ENGINE, num_kv_blocks=40)  # 640 tokens: decode instances must preempt
    report = disaggregated(trace, SMALL, tight, STEP, split)
    assert sorted(int(r.request_id) for r in report.records) == list(range(len(trace)))
    for r in report.records:
        spec = trace[int(r.request_id)]
        assert (r.prompt_tokens, r.output_tokens) == (len(spec.prompt_token_ids), spec.max_tokens)
        assert len(r.itl_s) == spec.max_tokens - 1 and r.ttft_s > 0 and r.e2e_s >= r.ttft_s
    assert report.output_tokens == sum(r.max_tokens for r in trace)
    if split.num_decode == 1:
        assert report.preemptions > 0  # the test exercised the recompute path


def test_colocated_on_one_instance_is_todays_simulator():
    trace = mixed_trace(20)
    assert colocated(trace, SMALL, ENGINE, STEP, 1).records == simulate(trace, SMALL, ENGINE, STEP).records


def test_a_decode_instance_never_waits_for_someone_elses_prefill_but_a_colocated_one_does():
    # a long decode starts, then long prompts arrive while it decodes
    trace = [RequestSpec(0.0, tuple(CORPUS[:50]), 60)] + [
        RequestSpec(0.02 + 0.01 * i, tuple(CORPUS[100 + i: 1100 + i]), 2) for i in range(4)]

    def step(chunks):  # 1 ms a step + 10 µs a token: a 256-token prefill chunk makes a step 3.5x a decode's
        return 1e-3 + 1e-5 * sum(c.num_new for c in chunks)

    colo = colocated(trace, SMALL, ENGINE, step, 1).records[0]
    dis = disaggregated(trace, SMALL, ENGINE, step, PDSplit(2, 1, 1, INSTANT)).records[0]
    assert max(colo.itl_s) > 3e-3  # a step shared with a 256-token prefill chunk
    assert max(dis.itl_s) < 1.1e-3  # decode steps only (batched with the others' one decode each)


@pytest.mark.parametrize(("p", "d", "n"), [(0, 4, 4), (4, 0, 4), (1, 2, 4), (3, 3, 4)])
def test_a_split_without_prefill_or_decode_instances_or_not_summing_to_n_is_refused(p, d, n):
    with pytest.raises(ValueError, match="num_prefill"):
        PDSplit(n, p, d, INSTANT)


def test_a_sweep_is_deterministic_given_its_seed():
    wl = Workload("tiny", (100, 400), (2, 20), 0.2, 0.01)
    kw = dict(num_instances=3, rates=[50.0, 200.0], links=[KV_LINKS["InfiniBand"]], num_requests=24,
              corpus=CORPUS)
    a = sweep(wl, SMALL, ENGINE, STEP, seed=1, **kw)
    assert a == sweep(wl, SMALL, ENGINE, STEP, seed=1, **kw)
    assert a != sweep(wl, SMALL, ENGINE, STEP, seed=2, **kw)
    assert [r["deployment"] for r in a] == ["colocated", "1P:2D InfiniBand", "2P:1D InfiniBand"]
    assert best_split(a, "InfiniBand")["link"] == "InfiniBand"


def test_goodput_at_the_slo_is_the_highest_rate_before_attainment_first_drops_below_target():
    assert max_rate_at_slo([1, 2, 4, 8], [1.0, 0.95, 0.5, 0.92]) == 2
    assert max_rate_at_slo([1, 2], [0.8, 1.0]) == 0.0
    assert max_rate_at_slo([1, 2], [0.9, 0.9]) == 2


def synthetic_rows() -> list[dict]:
    rows = [{"workload": "w", "num_instances": 4, "deployment": "colocated", "link": None, "num_prefill": 0,
             "num_decode": 0, "goodput_at_slo": 10.0}]
    for link, goodputs in (("NVLink", (8.0, 14.0, 12.0)), ("PCIe", (6.0, 9.0, 9.0))):
        rows += [{"workload": "w", "num_instances": 4, "deployment": f"{p}P:{4 - p}D {link}", "link": link,
                  "num_prefill": p, "num_decode": 4 - p, "goodput_at_slo": g}
                 for p, g in zip((1, 2, 3), goodputs, strict=True)]
    return rows


def test_the_bench_summary_names_each_links_best_split_and_its_ratio_to_colocated():
    from minillm.perf.bench.disagg import summary

    s = {r["link"]: r for r in summary(synthetic_rows())}
    assert (s["NVLink"]["best_split"], s["NVLink"]["ratio"]) == ("2P:2D", pytest.approx(1.4))
    assert (s["PCIe"]["best_split"], s["PCIe"]["ratio"]) == ("2P:2D", pytest.approx(0.9))  # a tie: fewer prefill


def test_the_bench_figure_has_a_line_per_link_plus_colocated_and_no_overlapping_labels():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minillm.perf.bench.disagg import plot
    from minillm.perf.figures import overlapping_labels

    fig = plot(synthetic_rows())
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["NVLink", "PCIe", "colocated"]
    assert overlapping_labels(fig) == []
    plt.close(fig)


def test_the_cli_dispatches_bench_disagg():
    from minillm.entrypoints.cli import build_parser, cmd_bench

    args = build_parser().parse_args(["bench", "disagg", "--quick"])
    assert (args.what, args.quick, args.fn) == ("disagg", True, cmd_bench)


def test_transfer_seconds_and_max_rate_at_slo_reject_nonsense():
    link = next(iter(KV_LINKS.values()))
    with pytest.raises(ValueError, match="nbytes"):
        transfer_seconds(-1.0, link)
    with pytest.raises(ValueError, match="pair up"):
        max_rate_at_slo([1.0, 2.0], [0.5])
    with pytest.raises(ValueError, match="target"):
        max_rate_at_slo([1.0], [1.0], target=90)
