"""Incremental detokenization: ids in, text deltas out, with stop strings and split UTF-8 characters held back.

The stop-string check runs on the engine thread once per token, so its cost must not grow with the text or with
the square of a stop string: each stop string keeps a Knuth–Morris–Pratt matcher whose state is the length of the
longest suffix of the text read so far that is a prefix of the stop string.  That state is both the match (state ==
len(stop)) and the hold-back (the text that could still become a stop string), and reading a new character moves it
in amortised O(1): a token costs O(new characters × stop strings), and building a matcher O(len(stop)) once.
"""

from __future__ import annotations

from collections.abc import Sequence


def prefix_function(s: str) -> list[int]:
    """KMP's failure table: ``pi[i]`` = the length of the longest proper prefix of ``s[:i + 1]`` that is also its
    suffix.  O(len(s)) time and memory."""
    pi = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = pi[k - 1]
        if s[i] == s[k]:
            k += 1
        pi[i] = k
    return pi


class StopMatcher:
    """One stop string read character by character: ``state`` is the length of the longest suffix of the text read
    so far that is a prefix of ``stop``; ``found`` is the end offset (in the text) of its first occurrence, if any."""

    def __init__(self, stop: str):
        self.stop = stop
        self.pi = prefix_function(stop)
        self.state = 0
        self.found: int | None = None

    def feed(self, new: str, offset: int, armed: bool = True) -> None:
        """Read ``new``, the characters of the text from ``offset`` on (those not read yet); stops at the first full
        match (``found`` is an offset in the whole text).  Not ``armed`` (before ``min_tokens``): a match is passed
        over, so one that ends later, even one overlapping it, is still found."""
        s, pi, k = self.stop, self.pi, self.state
        for i, c in enumerate(new):
            while k and c != s[k]:
                k = pi[k - 1]
            if c == s[k]:
                k += 1
            if k == len(s):
                if armed:
                    self.found, self.state = offset + i + 1, k
                    return
                k = pi[k - 1]
        self.state = k


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas, holding back bytes of a character split across tokens and any
    tail that could still become a stop string.

    Decoding is incremental (vLLM's prefix/read offsets): each token decodes only the ids after the last emitted
    text plus the few before them for context (``ids[prefix:read]``, the previous delta's tokens, so a tokenizer
    that drops a leading space at the start of a decode still spaces the new word right), so a token costs
    O(window) instead of O(output) and a request O(length) instead of O(length²).  The concatenated deltas equal
    ``tokenizer.decode(ids)`` (cut at a stop string): the window starts where an earlier decode ended on a whole
    character, and UTF-8 decodes independently on either side of a whole character.

    Stop strings end the output before the first one generated; with several, the earliest found in the order
    given wins unless a later-listed one ends before it starts (the output is cut before the first stop string
    that lies wholly inside the output so far); ``stop_reason`` is the one that cut.  As in vLLM, no stop string
    counts before ``min_tokens`` tokens: one must end in the text of a later token (it may start earlier)."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), include_stop: bool = False, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop  # SamplingParams.include_stop_str_in_output: keep the stop string
        self._matchers = [StopMatcher(s) for s in self.stop]
        self.min_tokens = min_tokens
        self.stop_reason: str | None = None  # the stop string that ended the output
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read]: context decoded again with the new ids (the previous delta's ids)
        self._offset = 0  # ids[:_offset] are decoded into whole characters (read by the matchers)
        self._read = 0  # characters of the decoded text read by the matchers (the text up to ids[:_offset])
        self._pieces: list[str] = []  # the deltas emitted so far (joined on demand: appending stays O(delta))
        self._emitted = 0  # characters emitted: sum of len(_pieces)
        self._pending = ""  # decoded characters not emitted yet (a possible stop-string start), at offset _emitted
        self.stopped = False

    @property
    def text(self) -> str:
        """The text emitted so far (never beyond a stop string).  O(length): read it once, at the end."""
        return "".join(self._pieces)

    def push(self, token_id: int, final: bool = False) -> str:
        """Add a token; returns the new visible text (``final``: no token follows, hold nothing back)."""
        self.ids.append(token_id)
        return self._delta(final)

    def flush(self) -> str:
        """The text held back so far (a split character, a possible stop-string start), now that no token follows."""
        return self._delta(final=True) if self.ids else ""

    def _decode_new(self, final: bool) -> str | None:
        """The characters ``ids[_offset:]`` add to the text, or None while they end in an incomplete UTF-8 sequence
        (U+FFFD at the end; ``final`` takes it as it is).  Two decodes of the window, O(window) each."""
        decode, ids = self.tokenizer.decode, self.ids
        before = decode(ids[self._prefix:self._offset], skip_special_tokens=True)
        after = decode(ids[self._prefix:], skip_special_tokens=True)
        if after.endswith("\ufffd") and not final:
            return None  # an incomplete UTF-8 sequence: wait for the next token
        if len(after) <= len(before):
            return ""  # nothing visible yet (a skipped special token): keep the window's context
        self._prefix, self._offset = self._offset, len(ids)
        return after[len(before):]

    def _delta(self, final: bool) -> str:
        new = self._decode_new(final)
        if new is None or self.stopped:  # stopped: the output already ends before a stop string
            return ""
        # the text read before held no stop string, so a new one ends in the new characters: read only those
        armed = len(self.ids) > self.min_tokens
        for m in self._matchers:
            m.feed(new, self._read, armed)
        self._read += len(new)
        end = self._read
        for m in self._matchers:  # in order: cut before each stop string that lies wholly inside what is left
            if m.found is not None and m.found <= end:
                end, self.stopped = m.found - (0 if self.include_stop else len(m.stop)), True
                self.stop_reason = m.stop
        # hold back a tail that could be the start of a stop string, unless this is the end
        hold = 0 if (final or self.stopped) else max((m.state for m in self._matchers), default=0)
        pending = self._pending + new  # the text from character _emitted on
        cut = max(end - hold - self._emitted, 0)
        delta, self._pending = pending[:cut], pending[cut:]
        self._pieces.append(delta)
        self._emitted += len(delta)
        return delta
