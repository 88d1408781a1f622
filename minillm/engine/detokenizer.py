"""Incremental detokenization: ids in, text deltas out, with stop strings and split UTF-8 characters held back."""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas, holding back bytes of a character split across tokens."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop  # SamplingParams.include_stop_str_in_output: keep the stop string
        self.ids: list[int] = []
        self.text = ""  # text emitted so far (never beyond a stop string)
        self.stopped = False

    def push(self, token_id: int, final: bool = False) -> str:
        """Add a token; returns the new visible text (``final``: no token follows, hold nothing back)."""
        self.ids.append(token_id)
        return self._delta(final)

    def flush(self) -> str:
        """The text held back so far (a split character, a possible stop-string start), now that no token follows."""
        return self._delta(final=True) if self.ids else ""

    def _delta(self, final: bool) -> str:
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if full.endswith("\ufffd") and not final:
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        for s in self.stop:  # stop strings are searched in the whole text; the output ends before them
            at = full.find(s)
            if at != -1:
                full, self.stopped = full[: at + (len(s) if self.include_stop else 0)], True
        # hold back a tail that could be the start of a stop string, unless this is the end
        hold = 0 if (final or self.stopped) else max((k for s in self.stop for k in range(1, len(s))
                                                       if full.endswith(s[:k])), default=0)
        visible = full[: len(full) - hold]
        delta, self.text = visible[len(self.text):], visible
        return delta
