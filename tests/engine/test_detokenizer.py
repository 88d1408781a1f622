"""The incremental detokenizer against the plain one it replaced (decode every id at each token, search the whole
text and every prefix of every stop string), over random texts, stop strings and token splits, and over random
ids of the real tokenizer."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.engine.detokenizer import IncrementalDetokenizer, prefix_function
from minillm.sampling.params import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams


class ByteTokenizer:
    """Each id is a byte string in ``pieces``; decode joins them and decodes UTF-8 with replacement, so a
    character split across ids shows as U+FFFD at the end, like a byte-level BPE tokenizer."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


class ReferenceDetokenizer:
    """The plain algorithm the incremental one replaced: decode every id so far at each token, search the whole text
    and every prefix of every stop string.  O(text + sum of len(stop)^2) per token, O(length²) per request."""

    def __init__(self, tokenizer, stop=(), include_stop=False):
        self.tokenizer, self.stop, self.ids, self.text, self.stopped = tokenizer, tuple(stop), [], "", False

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        return self._delta(final=True) if self.ids else ""

    def _delta(self, final: bool) -> str:
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if full.endswith("\ufffd") and not final:
            return ""
        for s in self.stop:
            at = full.find(s)
            if at != -1:
                full, self.stopped = full[:at], True
        hold = 0 if (final or self.stopped) else max((k for s in self.stop for k in range(1, len(s))
                                                       if full.endswith(s[:k])), default=0)
        visible = full[: len(full) - hold]
        delta, self.text = visible[len(self.text):], visible
        return delta


def run(detok_cls, pieces: list[bytes], stop: list[str]) -> tuple[list[str], bool]:
    return run_ids(detok_cls, ByteTokenizer(pieces), range(len(pieces)), stop)


def run_ids(detok_cls, tokenizer, ids, stop) -> tuple[list[str], bool]:
    """Push ``ids`` one at a time until a stop string ends the output, then flush: the deltas and whether it
    stopped (the text the deltas add up to is also ``detok.text``, checked here)."""
    detok = detok_cls(tokenizer, stop)
    deltas = []
    for i in ids:
        deltas.append(detok.push(i))
        if detok.stopped:
            break
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas, detok.stopped


ALPHABET = "ab\u00e9\u4e2d\n"  # few letters (stop strings recur), 2- and 3-byte characters (split across ids)


@st.composite
def texts_and_splits(draw):
    text = draw(st.text(alphabet=ALPHABET, max_size=40))
    data = text.encode()
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(data) - 1)), max_size=len(data))))
    bounds = [0, *[c for c in cuts if 0 < c < len(data)], len(data)]
    pieces = [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    stop = draw(st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=6), max_size=3))
    return pieces, stop


@settings(max_examples=400, deadline=None)
@given(texts_and_splits())
def test_linear_stop_check_gives_the_same_deltas_as_the_plain_one(case):
    pieces, stop = case
    assert run(IncrementalDetokenizer, pieces, stop) == run(ReferenceDetokenizer, pieces, stop)


@functools.cache
def real_tokenizer():
    """The default model's tokenizer (byte-level BPE: byte tokens, multi-byte characters split across tokens)."""
    from minillm.models.loader import load_tokenizer

    return load_tokenizer(None)


# pieces of real text the tokenizer splits across tokens: emoji (4 bytes, often several byte tokens), CJK (3),
# accents (2), runs of spaces and newlines, a special token's text
SAMPLES = ["Hello world", "  two  spaces\n\n", "caf\u00e9 na\u00efve", "\u4e2d\u6587\u5b57", "\U0001f600\U0001f680!",
           "\U0001f468\u200d\U0001f469\u200d\U0001f467", "<|im_end|>", " \t\u00a0x"]


@st.composite
def real_ids(draw):
    """Ids of the real tokenizer: random ids from the whole vocabulary, from its low range (special and single-byte
    tokens: byte fallback, invalid UTF-8), and the ids of text with multi-byte characters."""
    vocab = len(real_tokenizer())
    parts = draw(st.lists(st.one_of(
        st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4),
        st.lists(st.integers(0, 300), min_size=1, max_size=6),
        st.sampled_from(SAMPLES).map(lambda t: real_tokenizer().encode(t, add_special_tokens=False)),
    ), max_size=8))
    return [i for part in parts for i in part]


@settings(max_examples=300, deadline=None)
@given(real_ids())
def test_incremental_decoding_adds_up_to_decoding_every_id_with_the_real_tokenizer(ids):
    tok = real_tokenizer()
    deltas, stopped = run_ids(IncrementalDetokenizer, tok, ids, [])
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert (deltas, stopped) == run_ids(ReferenceDetokenizer, tok, ids, [])


@settings(max_examples=200, deadline=None)
@given(real_ids(), st.data())
def test_incremental_decoding_with_stop_strings_gives_the_old_deltas_with_the_real_tokenizer(ids, data):
    """Stop strings cut from the decoded text itself (so they occur), possibly across token boundaries."""
    full = real_tokenizer().decode(ids, skip_special_tokens=True)
    cuts = st.tuples(st.integers(0, len(full)), st.integers(1, 4))
    stop = [full[a:a + n] or "x" for a, n in data.draw(st.lists(cuts, max_size=2))]
    tok = real_tokenizer()
    assert run_ids(IncrementalDetokenizer, tok, ids, stop) == run_ids(ReferenceDetokenizer, tok, ids, stop)


def min_tokens_reference(pieces: list[bytes], stop: list[str], min_tokens: int) -> tuple[str, str | None]:
    """vLLM's rule read plainly (ASCII pieces: one character per byte): after each token past the first
    ``min_tokens``, the stop strings, in the order given, that end in the text after those tokens' characters (they
    may start before) cut the text before them; the first token with a cut ends the output."""
    armed_from = len(b"".join(pieces[:min_tokens]))  # a stop string must end after this many characters
    for t in range(min_tokens + 1, len(pieces) + 1):
        text = b"".join(pieces[:t]).decode()
        cut, reason = len(text), None
        for s in stop:
            at = text.find(s, max(0, armed_from - len(s) + 1))
            if at != -1 and at + len(s) <= cut:  # wholly inside what is left, as the order rule reads
                cut, reason = at, s
        if reason is not None:
            return text[:cut], reason
    return b"".join(pieces).decode(), None


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text(alphabet="ab", min_size=1, max_size=3), max_size=12),
       st.lists(st.text(alphabet="ab", min_size=1, max_size=4), min_size=1, max_size=3), st.integers(0, 12))
def test_no_stop_string_counts_before_min_tokens_and_the_one_that_cut_is_the_stop_reason(words, stop, min_tokens):
    pieces = [w.encode() for w in words]
    detok = IncrementalDetokenizer(ByteTokenizer(pieces), stop, min_tokens=min_tokens)
    out = ""
    for i in range(len(pieces)):
        out += detok.push(i)
        if detok.stopped:
            break
    out += detok.flush()
    assert (out, detok.stop_reason) == min_tokens_reference(pieces, stop, min_tokens)


class CountingTokenizer(ByteTokenizer):
    """Counts the ids each decode reads."""

    def __init__(self, pieces):
        super().__init__(pieces)
        self.ids_read = 0

    def decode(self, ids, skip_special_tokens=True):
        self.ids_read += len(ids)
        return super().decode(ids, skip_special_tokens)


def test_each_token_decodes_a_short_window_not_the_whole_output():
    """2000 one-character tokens: the ids decoded per token stay bounded (the old decoder read all of them at every
    token: 2000 * 2001 / 2 in all)."""
    n = 2000
    tok = CountingTokenizer([b"a"] * n)
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push(i) for i in range(n)) + detok.flush() == "a" * n
    assert tok.ids_read <= 4 * n


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab", max_size=30))
def test_prefix_function_matches_its_definition(s):
    want = [max(k for k in range(i + 1) if s[:k] == s[i + 1 - k:i + 1]) for i in range(len(s))]
    assert prefix_function(s) == want


def test_a_stop_string_at_the_limit_holds_back_exactly_what_could_still_match():
    """``MAX_STOP_CHARS - 1`` 'a's then 'b', over a text of 'a's that never completes it: the output trails the
    text by the longest stop-string prefix it ends with, and nothing is lost."""
    stop = "a" * (MAX_STOP_CHARS - 1) + "b"
    pieces = [b"a"] * 3000
    detok = IncrementalDetokenizer(ByteTokenizer(pieces), [stop])
    out = "".join(detok.push(i) for i in range(len(pieces)))
    assert not detok.stopped
    assert len(out) + detok._matchers[0].state == len(pieces)  # held back exactly what could still match
    assert detok._matchers[0].state == MAX_STOP_CHARS - 1


@pytest.mark.parametrize("stop, match", [
    (["x"] * (MAX_STOP_STRINGS + 1), f"at most {MAX_STOP_STRINGS} strings"),
    (["y" * (MAX_STOP_CHARS + 1)], f"strings of at most {MAX_STOP_CHARS} characters"),
])
def test_stop_strings_beyond_the_limits_are_refused_naming_the_limit(stop, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(stop=stop)


def test_stop_strings_at_the_limits_are_accepted():
    assert len(SamplingParams(stop=["y" * MAX_STOP_CHARS] * MAX_STOP_STRINGS).stop) == MAX_STOP_STRINGS


def test_the_engine_text_is_the_decode_of_its_tokens_sampled_and_streamed(default_llm):
    """Sampled at temperature 2 (odd bytes, split characters), streamed and not: the engine's text is the decode of
    its token ids, and the streamed deltas add up to it."""
    params = SamplingParams(max_tokens=40, temperature=2.0, seed=7, ignore_eos=True)
    prompts = ["Emoji: \U0001f600", "\u4e2d\u6587:"]
    outs = default_llm.generate(prompts, params)
    streamed: dict[str, str] = {}
    for u in default_llm.stream(prompts, params):
        streamed[u.request_id] = streamed.get(u.request_id, "") + u.text
    tok = default_llm.tokenizer
    assert [o.text for o in outs] == [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    assert sorted(streamed.values()) == sorted(o.text for o in outs)
