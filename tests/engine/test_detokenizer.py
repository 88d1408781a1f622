"""The incremental detokenizer's stop-string check against the plain one it replaced (search the whole text and
every prefix of every stop string at each token), over random texts, stop strings and token splits."""

from __future__ import annotations

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


class ReferenceDetokenizer(IncrementalDetokenizer):
    """The plain algorithm: O(text + sum of len(stop)^2) per token."""

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
    detok = detok_cls(ByteTokenizer(pieces), stop)
    deltas = []
    for i in range(len(pieces)):
        deltas.append(detok.push(i))
        if detok.stopped:
            break
    deltas.append(detok.flush())
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
