"""minillm's own regex backend (``sampling.regex``): the byte DFA against Python's ``re``, the per-state token mask
against the brute-force walk and against xgrammar's mask on the real tokenizer, the matcher protocol, and
``backend="minillm"`` requests in the engine beside unconstrained ones (every output matches)."""

import random
import re
from importlib.util import find_spec

import numpy as np
import pytest
import torch

from minillm import EngineConfig, GuidedDecodingParams, LLMEngine, SamplingParams
from minillm.sampling.guided import mask_logits
from minillm.sampling.regex import (
    DEAD,
    RegexCompiler,
    compile_regex,
    pad_vocabulary,
    reference_token_mask,
    token_mask,
)

needs_xgrammar = pytest.mark.skipif(find_spec("xgrammar") is None, reason="xgrammar is not installed (serve extra)")

PATTERNS = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[a-z]+@[a-z]+\.(com|org)", r"-?[0-9]+(\.[0-9]+)?",
            r"(ab)*c?", r"héllo|wörld", r"\w+ \d*", r"[^0-9]{2,4}x"]


def _full_match(dfa, text: str) -> bool:
    state = dfa.walk(dfa.start, text.encode())
    return state != DEAD and bool(dfa.accepting[state])


@pytest.mark.parametrize("pattern", PATTERNS)
def test_dfa_accepts_exactly_what_python_re_fullmatches(pattern):
    dfa = compile_regex(pattern)
    rng = random.Random(0)
    alphabet = "abcxyz0123456789-.@ moegsélhrwöd"
    strings = ["", "555-1234", "yes", "no", "maybe", "ab@cd.com", "-3.25", "ababc", "héllo", "wörld", "abc 12",
               "--x", "ab x"]
    strings += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 9))) for _ in range(3000)]
    ascii_classes = any(x in pattern for x in ("\\w", "\\d", "[^"))  # ASCII-only here (the module says so)
    for s in strings:
        if ascii_classes and not s.isascii():
            continue
        assert _full_match(dfa, s) == (re.fullmatch(pattern, s, flags=re.ASCII) is not None), (pattern, s)


@pytest.mark.parametrize("pattern, where", [("(ab", "missing ')'"), ("a{3,1}", "bad repeat"), ("*a", "nothing to "
                                            "repeat"), (r"\p", "unsupported escape"), ("[é]", "non-ASCII"),
                                            ("a]", "unexpected"), (5, "must be a string")])
def test_patterns_outside_the_subset_are_value_errors_naming_the_regex(pattern, where):
    with pytest.raises(ValueError, match=rf"guided_decoding\.regex.*{re.escape(where)}"):
        compile_regex(pattern)


@pytest.mark.parametrize("make", [lambda: compile_regex(r"\p"), lambda: compile_regex("[ab]*a[ab]{12}"),
                                  lambda: GuidedDecodingParams(json={"type": "object"}, backend="minillm")])
def test_minillm_backend_refusals_name_the_xgrammar_fix_for_python_and_server_callers(make):
    with pytest.raises(ValueError) as err:
        make()
    assert "backend='xgrammar'" in str(err.value) and "guided_decoding_backend='xgrammar'" in str(err.value)


def test_states_that_cannot_accept_are_dead():
    dfa = compile_regex("ab|ac")
    assert dfa.walk(dfa.start, b"a") != DEAD and dfa.walk(dfa.start, b"ad") == DEAD
    assert compile_regex("a{0}").walk(compile_regex("a{0}").start, b"a") == DEAD


def test_token_mask_equals_the_brute_force_on_made_up_tokens():
    vocab = [b"1", b"12", b"123", b"1-", b"-", b"-1", b"a", None, b"", b"2-3", b"12345", b"\x00"]
    token_bytes, lengths = pad_vocabulary(vocab)
    dfa = compile_regex(r"[0-9]{3}-[0-9]{2}")
    for prefix in [b"", b"1", b"12", b"123", b"123-", b"123-4", b"123-45"]:
        state = dfa.walk(dfa.start, prefix)
        got = token_mask(dfa.table, state, token_bytes, lengths)
        assert torch.equal(got, reference_token_mask(dfa, state, vocab)), prefix
    assert token_mask(dfa.table, dfa.start, token_bytes, lengths).nonzero().flatten().tolist() == [0, 1, 2]


@pytest.fixture(scope="module")
def real(default_llm):
    """(tokenizer, V, stop ids, RegexCompiler) for the default model."""
    tok, vocab_size, stops = default_llm.tokenizer, default_llm.model.config.vocab_size, list(default_llm.eos_token_ids)
    return tok, vocab_size, stops, RegexCompiler(tok, vocab_size, stops)


def test_vocabulary_bytes_decode_back_to_the_tokenizers_text(real):
    tok, vocab_size, _, rc = real
    assert len(rc.vocab) == vocab_size and all(rc.vocab[i] is None for i in tok.all_special_ids)
    ids = tok.encode("Hello wörld, 12 €!", add_special_tokens=False)
    assert b"".join(rc.vocab[i] for i in ids).decode() == "Hello wörld, 12 €!"


def _xgrammar_mask(matcher, vocab_size: int) -> torch.Tensor:
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")[0, :vocab_size]
    return torch.from_numpy(bits.astype(bool))


@needs_xgrammar
@pytest.mark.parametrize("pattern", PATTERNS[:7])
def test_masks_equal_the_brute_force_and_xgrammars_along_random_walks(real, pattern):
    from minillm.sampling.guided import GrammarCompiler

    tok, vocab_size, stops, rc = real
    xgc = GrammarCompiler(tok, vocab_size, stops)
    gen = torch.Generator().manual_seed(1)
    for _ in range(1):
        mine, theirs = rc.matchers(pattern, 1)[0], xgc.matchers(GuidedDecodingParams(regex=pattern), 1)[0]
        for _ in range(8):
            allowed = mine.allowed_tokens()
            brute = reference_token_mask(mine.compiled.dfa, mine.state, rc.vocab)
            brute[stops] = bool(mine.compiled.dfa.accepting[mine.state])
            assert torch.equal(allowed, brute)
            assert torch.equal(allowed, _xgrammar_mask(theirs, vocab_size))
            ids = allowed.nonzero().flatten()
            token = int(ids[torch.randint(len(ids), (1,), generator=gen)])
            assert mine.accept_token(token) and theirs.accept_token(token)
            if mine.is_terminated():
                assert theirs.is_terminated()
                break


def test_matcher_protocol_accept_rollback_reset(real):
    tok, _, stops, rc = real
    m = rc.matchers(r"[0-9]{2}", 1)[0]
    one, x = tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("x")
    assert not m.accept_token(stops[0]) and not m.accept_token(x) and m.accept_token(one)
    assert m.accept_token(one) and not m.accept_token(one)  # "11" is complete: only a stop token is left
    assert m.allowed_tokens().nonzero().flatten().tolist() == sorted(stops)
    assert m.accept_token(stops[0]) and m.is_terminated() and not m.allowed_tokens().any()
    m.rollback(2)
    assert not m.is_terminated() and m.accept_token(one)
    m.reset()
    assert m.state == m.compiled.dfa.start and not m.is_terminated()


def test_mask_logits_applies_a_protocol_matcher_and_leaves_other_rows(real):
    _, vocab_size, _, rc = real
    m = rc.matchers(r"(yes|no)", 1)[0]
    logits = torch.randn(2, vocab_size)
    before = logits.clone()
    mask_logits(logits, [None, m])
    assert torch.equal(logits[0], before[0])
    assert torch.equal(torch.isfinite(logits[1]), m.allowed_tokens())


def test_compiled_regexes_and_state_masks_are_cached_and_a_new_mask_fn_starts_fresh(real):
    tok, vocab_size, stops, _ = real
    calls = []

    def counting(*args):
        calls.append(args[1])
        return token_mask(*args)

    rc = RegexCompiler(tok, vocab_size, stops, mask_fn=counting)
    a, b = rc.matchers("(yes|no)", 2)
    assert a.compiled is b.compiled is rc.compile("(yes|no)")
    a.allowed_tokens(), b.allowed_tokens()
    assert calls == [a.state]  # once per state, shared by the two matchers
    rc.mask_fn = token_mask
    assert not rc.compile("(yes|no)")._masks


def test_unsatisfiable_regex_and_wrong_backend_use_are_value_errors(real, default_llm):
    with pytest.raises(ValueError, match="backend"):
        GuidedDecodingParams(json={"type": "object"}, backend="minillm")
    with pytest.raises(ValueError, match="backend must be one of"):
        GuidedDecodingParams(regex="a", backend="outlines")
    assert GuidedDecodingParams(regex="a", backend="minillm") != GuidedDecodingParams(regex="a")
    engine = LLMEngine(default_llm.model, default_llm.tokenizer)
    nothing = "[^" + "".join(c if c.isalnum() else "\\" + c for c in map(chr, range(128))) + "]"  # no ASCII byte
    with pytest.raises(ValueError, match="admits no output"):
        engine.add_request("x", SamplingParams(guided_decoding=GuidedDecodingParams(regex=nothing, backend="minillm")))
    with pytest.raises(ValueError, match="missing"):
        engine.add_request("x", SamplingParams(guided_decoding=GuidedDecodingParams(regex="(a", backend="minillm")))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_outputs_match_the_regex_beside_unconstrained_requests(default_llm, temperature):
    patterns = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)"]
    prompts, params, kinds = [], [], []
    for i in range(12):
        pattern = patterns[i % len(patterns)]
        prompts.append(f"Item {i}: answer briefly.")
        params.append(SamplingParams(max_tokens=24, temperature=temperature, seed=i,
                                     guided_decoding=GuidedDecodingParams(regex=pattern, backend="minillm")))
        kinds.append(pattern)
        if i % 3 == 0:
            prompts.append(f"Tell me about the number {i}.")
            params.append(SamplingParams(max_tokens=8, temperature=temperature, seed=i, ignore_eos=True))
            kinds.append(None)
    engine = LLMEngine(default_llm.model, default_llm.tokenizer, EngineConfig(max_num_seqs=8))
    outs = engine.generate(prompts, params)
    bad = [(k, o.text, o.finish_reason) for k, o in zip(kinds, outs, strict=True)
           if k and (o.finish_reason != "stop" or not re.fullmatch(k, o.text))]
    assert not bad, bad
    free = [o for k, o in zip(kinds, outs, strict=True) if k is None]
    assert all(len(o.token_ids) == 8 for o in free)
    assert not any(re.fullmatch(p, o.text) for o in free for p in patterns)  # those ran unconstrained


def test_regex_backend_runs_without_xgrammar(default_llm, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    engine = LLMEngine(default_llm.model, default_llm.tokenizer)
    out = engine.generate(["Yes or no?"], SamplingParams(max_tokens=8, temperature=0, guided_decoding=(
        GuidedDecodingParams(regex="(yes|no)", backend="minillm"))))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
