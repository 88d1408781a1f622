"""Structured output: GuidedDecodingParams, the batched xgrammar mask against a per-token reference, and guided
requests in the engine (every output validates; bad constraints raise before a step; drafts skip guided rows)."""

import json
import re
from importlib.util import find_spec

import pytest
import torch

from minillm import EngineConfig, GuidedDecodingParams, LLMEngine, SamplingParams

needs_xgrammar = pytest.mark.skipif(find_spec("xgrammar") is None, reason="xgrammar is not installed (serve extra)")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
CODE = r"[A-Z][a-z]{2,5}-[0-9]{3}"
MOODS = ["positive", "negative", "neutral"]


@pytest.mark.parametrize("kwargs, field", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["b"]}, "exactly one"), ({"choice": []}, "choice"),
    ({"choice": "ab"}, "choice"), ({"json": "{oops"}, "json"), ({"json": 3}, "json"), ({"regex": 5}, "regex"),
    ({"json_object": "yes"}, "json_object"),
])
def test_guided_params_reject_bad_shapes_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GuidedDecodingParams(**kwargs)


def test_sampling_params_take_only_guided_decoding_params():
    with pytest.raises(ValueError, match="guided_decoding"):
        SamplingParams(guided_decoding={"json": {}})
    g = GuidedDecodingParams(json=json.dumps(PERSON))
    assert g == GuidedDecodingParams(json=PERSON) and hash(g) == hash(GuidedDecodingParams(json=PERSON))
    assert SamplingParams(guided_decoding=g).guided_decoding.kind == "json"


@pytest.fixture(scope="module")
def compiler(default_llm):
    from minillm.sampling.guided import GrammarCompiler

    return GrammarCompiler(default_llm.tokenizer, default_llm.model.config.vocab_size, list(default_llm.eos_token_ids))


@needs_xgrammar
@pytest.mark.parametrize("guided, prefix", [
    (GuidedDecodingParams(choice=["yes", "no", "yesterday"]), "yes"),
    (GuidedDecodingParams(regex=CODE), "Ab"),
    (GuidedDecodingParams(json=PERSON), '{"name": "x'),
    (GuidedDecodingParams(json_object=True), "{"),
])
def test_batched_mask_equals_accept_token_over_the_vocabulary(compiler, default_llm, guided, prefix):
    from minillm.sampling.guided import mask_logits, reference_mask

    a, b = compiler.matchers(guided, 2)
    for t in default_llm.tokenizer.encode(prefix, add_special_tokens=False):  # row 1: a state inside the grammar
        assert b.accept_token(t)
    V = compiler.vocab_size
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    masked = mask_logits(logits.clone(), [a, None, b])
    for row, matcher in ((0, a), (2, b)):
        allowed = reference_mask(matcher, V)
        assert 0 < allowed.sum() < V
        torch.testing.assert_close(masked[row], logits[row].masked_fill(~allowed, float("-inf")))
    assert torch.equal(masked[1], logits[1])  # an unguided row is untouched


@needs_xgrammar
@pytest.mark.parametrize("guided_rows", [[0, 1, 2, 3], [1, 3], [2]])
def test_the_mask_is_applied_in_place_to_the_guided_rows_only(compiler, guided_rows):
    """Every row guided (the served ``--json-schema`` batch) or some: the tensor passed in is masked in place (no
    copy of its rows comes back), each guided row as the per-token reference says, the others untouched."""
    from minillm.sampling.guided import mask_logits, reference_mask

    V = compiler.vocab_size
    matchers = [None] * 4
    for i, m in zip(guided_rows, compiler.matchers(GuidedDecodingParams(regex=CODE), len(guided_rows)),
                    strict=True):
        matchers[i] = m
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    x = logits.clone()
    storage = x.untyped_storage().data_ptr()
    assert mask_logits(x, matchers) is x and x.untyped_storage().data_ptr() == storage
    for i, m in enumerate(matchers):
        want = logits[i] if m is None else logits[i].masked_fill(~reference_mask(m, V), float("-inf"))
        assert torch.equal(x[i], want)


@needs_xgrammar
@pytest.mark.parametrize("guided, field", [
    (GuidedDecodingParams(regex="a("), "guided_decoding.regex"),
    (GuidedDecodingParams(json={"type": "integer", "minimum": 5, "maximum": 1}), "guided_decoding.json"),
    (GuidedDecodingParams(json={"enum": []}), "guided_decoding.json"),
    (GuidedDecodingParams(json={"type": "objec"}), "guided_decoding.json"),
    (GuidedDecodingParams(grammar="root ::= undefined_rule"), "guided_decoding.grammar"),
])
def test_bad_constraint_raises_at_add_request_and_queues_nothing(default_llm, guided, field):
    eng = default_llm.engine
    live = eng.num_live_requests
    with pytest.raises(ValueError, match=re.escape(field)):
        eng.add_request("Hi", SamplingParams(guided_decoding=guided))
    assert eng.num_live_requests == live


@needs_xgrammar
def test_compiled_grammars_are_cached_per_constraint(compiler):
    assert compiler.compile(GuidedDecodingParams(json=PERSON)) is compiler.compile(
        GuidedDecodingParams(json=json.dumps(PERSON)))
    assert compiler.compile(GuidedDecodingParams(regex=CODE)) is not compiler.compile(
        GuidedDecodingParams(regex=CODE + "x"))


def _valid(kind: str, text: str) -> bool:
    import jsonschema

    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), PERSON)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    return re.fullmatch(CODE, text) is not None if kind == "regex" else text in MOODS


@needs_xgrammar
@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_of_each_constraint_validates_beside_unconstrained_requests(default_llm, temperature):
    """25 requests per constraint and 3 unconstrained ones: 78 requests over 64 slots, so requests of every kind
    join running batches as others finish (each step masks a mix of grammars and free rows)."""
    pytest.importorskip("jsonschema")
    constraints = {"json": GuidedDecodingParams(json=PERSON), "regex": GuidedDecodingParams(regex=CODE),
                   "choice": GuidedDecodingParams(choice=MOODS)}
    prompts, params, kinds = [], [], []
    for i in range(25):
        for kind, guided in constraints.items():
            prompts.append(f"Item {i}: give a {kind} answer about the weather.")
            params.append(SamplingParams(max_tokens=80, temperature=temperature, seed=i, guided_decoding=guided))
            kinds.append(kind)
        if i % 10 == 0:  # unconstrained requests in the same continuous batches
            prompts.append(f"Tell me about the number {i}.")
            params.append(SamplingParams(max_tokens=12, temperature=temperature, seed=i))
            kinds.append(None)
    engine = LLMEngine(default_llm.model, default_llm.tokenizer,
                       EngineConfig(max_num_seqs=64, max_num_batched_tokens=1024))  # wide batches: fewer steps
    outs = engine.generate(prompts, params)
    bad = [(k, o.text, o.finish_reason) for k, o in zip(kinds, outs, strict=True) if k and
           (o.finish_reason != "stop" or not _valid(k, o.text))]
    assert not bad, bad[:5]
    free = [o for k, o in zip(kinds, outs, strict=True) if k is None]
    assert any(not _valid("json", o.text) and o.text not in MOODS for o in free)  # those were not constrained


@needs_xgrammar
def test_each_of_n_samples_follows_its_own_matcher(default_llm):
    out = default_llm.generate("Pick a code.", SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=16,
                                                               guided_decoding=GuidedDecodingParams(regex=CODE)))[0]
    assert len(out.outputs) == 4
    assert all(re.fullmatch(CODE, c.text) and c.finish_reason == "stop" for c in out.outputs)


@needs_xgrammar
def test_a_completed_grammar_ends_the_sample_even_with_ignore_eos(default_llm):
    out = default_llm.generate("Mood?", SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                       guided_decoding=GuidedDecodingParams(choice=MOODS)))[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < 16
    assert out.text.startswith(tuple(MOODS))


@needs_xgrammar
def test_speculative_engine_never_drafts_for_guided_requests(default_llm):
    eng = LLMEngine(default_llm.model, default_llm.tokenizer,
                    EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3}))
    guided = SamplingParams(max_tokens=80, temperature=0, guided_decoding=GuidedDecodingParams(json=PERSON))
    outs = eng.generate(["a a a a a a a a a a", "b b b b b b b b"], guided)
    assert all(o.finish_reason == "stop" and json.loads(o.text)["color"] in PERSON["properties"]["color"]["enum"]
               for o in outs)
    assert eng.spec_stats.draft_tokens == 0
    plain = eng.generate("a a a a a a a a a a a a", SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert plain[0].token_ids and eng.spec_stats.draft_tokens > 0  # the same engine does draft for the others


def test_llm_chat_renders_tools_with_a_template_that_supports_them(default_llm, monkeypatch):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    seen = []
    real = default_llm.tokenizer.apply_chat_template

    def spy(messages, **kw):
        seen.append(kw.get("tools"))
        return real(messages, **kw)

    monkeypatch.setattr(default_llm.tokenizer, "apply_chat_template", spy)
    default_llm.chat([{"role": "user", "content": "Time?"}], SamplingParams(max_tokens=2), tools=tools)
    default_llm.chat([{"role": "user", "content": "Time?"}], SamplingParams(max_tokens=2))
    assert seen == [tools, None]


@needs_xgrammar
def test_llm_chat_with_guided_decoding_returns_json_that_validates(default_llm):
    pytest.importorskip("jsonschema")
    params = SamplingParams(max_tokens=80, temperature=0, guided_decoding=GuidedDecodingParams(json=PERSON))
    out = default_llm.chat([{"role": "user", "content": "Describe Ann, 31, who likes red."}], params)
    assert _valid("json", out[0].text)


@needs_xgrammar
def test_guided_samples_survive_preemption_by_recompute(default_llm):
    pytest.importorskip("jsonschema")
    eng = LLMEngine(default_llm.model, default_llm.tokenizer,
                    EngineConfig(block_size=16, num_kv_blocks=12, max_num_seqs=8, preemption="recompute"))
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=4, guided_decoding=GuidedDecodingParams(json=PERSON))
    outs = eng.generate([f"Person number {i}, described in JSON with all fields:" for i in range(8)], params)
    assert eng.stats.preemptions > 0  # the grammar state outlived the recomputed prefill
    assert all(o.finish_reason == "stop" and _valid("json", o.text) for o in outs), [o.text for o in outs]


@needs_xgrammar
def test_guided_bench_times_the_mask_and_the_step_per_batch(compiler, default_llm):
    from minillm.perf.bench.guided import time_decode_step, time_masks

    row = time_masks(compiler, 4, 6)
    assert row["mask_ms"] > 0 and row["per_row_fill_ms"] > 0
    assert time_decode_step(LLMEngine(default_llm.model, default_llm.tokenizer), 2, 3) > 0


def test_guided_decoding_without_a_tokenizer_is_a_value_error(default_llm):
    eng = LLMEngine(default_llm.model, config=EngineConfig(num_kv_blocks=8))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        eng.add_request([1, 2, 3], SamplingParams(guided_decoding=GuidedDecodingParams(regex="a")))
    assert eng.num_live_requests == 0
