"""Conclusions generated from the values a notebook just measured, so that a re-run never contradicts its output.

A notebook's prose explains mechanisms; a sentence that states a measured relation ("continuous batching is
faster than static here", "the bubble shrinks with m", "the formula holds") is printed by the cell that measured
it, through ``conclude``, with both outcomes written.  Each line has one fixed shape, which
``parse_conclusion`` reads back (tests scan the executed notebooks and check every line against its own numbers)::

    ▸ continuous ÷ static throughput: 1.75× vs 1× (expected >) — holds: continuous batching is faster here
    ▸ tokens per call, measured vs formula: 2.71 vs 3.75 (expected ≈ within 15%) — does not hold here: ...

The verdict is decided on the numbers as printed (three significant digits by default), so the printed values
always agree with it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["MARK", "Conclusion", "conclude", "parse_conclusion"]

MARK = "▸"
_LINE = re.compile(rf"^{MARK} (?P<claim>.+?): (?P<value>-?[\d.]+(?:e[-+]?\d+)?)(?P<unit>\S*) vs "
                   r"(?P<reference>-?[\d.]+(?:e[-+]?\d+)?)\S* \(expected (?P<expect>[<>≈])"
                   r"(?: within (?P<tolerance>[\d.]+)%)?\) — (?P<verdict>holds|does not hold here): (?P<text>.*)$")


@dataclass(frozen=True)
class Conclusion:
    """One generated conclusion: ``value`` set against ``reference`` as ``expect`` says ('>': above, '<': below,
    '≈': within ``tolerance``, relative); ``holds`` is the verdict on the printed numbers; ``line`` the text."""

    claim: str
    value: float
    reference: float
    expect: str
    tolerance: float
    holds: bool
    line: str

    def __bool__(self) -> bool:
        return self.holds

    def _ipython_display_(self) -> None:
        """Show nothing as a cell's value: ``conclude`` printed the line when it made this, and a cell ending in
        ``conclude(...)`` would otherwise print the whole record under it.  ``print(c.line)`` shows it again."""


def _decide(value: float, reference: float, expect: str, tolerance: float) -> bool:
    if expect == ">":
        return value > reference
    if expect == "<":
        return value < reference
    return abs(value - reference) <= tolerance * abs(reference) + 1e-12


def conclude(claim: str, value: float, reference: float, *, expect: str, held: str, missed: str, unit: str = "",
             tolerance: float = 0.15, digits: int = 3, show: bool = True) -> Conclusion:
    """Print (``show``) and return the conclusion "``claim``: ``value`` vs ``reference``" — ``held`` when the values
    bear it out, ``missed`` when they do not (write both: the machine decides which is printed).

    ``expect``: '>' (value above reference), '<' (below) or '≈' (within ``tolerance``, a fraction, of it).  ``unit``
    follows each number without a space, one token ("×", "%", "ms", "tok/s").  Numbers are printed with
    ``digits`` significant digits and the verdict is taken on the printed numbers.  Raises
    ``ValueError`` for an unknown ``expect``, a non-finite value or a unit with spaces.
    """
    if expect not in (">", "<", "≈"):
        raise ValueError(f"expect must be '>', '<' or '≈', got {expect!r}")
    if not (math.isfinite(value) and math.isfinite(reference)):
        raise ValueError(f"{claim}: value and reference must be finite numbers, got {value!r} and {reference!r}")
    if any(c.isspace() for c in unit):
        raise ValueError(f"unit must be one token without spaces (e.g. '×', '%', 'ms'), got {unit!r}")
    shown_value, shown_reference = (float(f"{x:.{digits}g}") for x in (value, reference))
    holds = _decide(shown_value, shown_reference, expect, tolerance)
    band = f" within {tolerance * 100:g}%" if expect == "≈" else ""
    verdict = f"holds: {held}" if holds else f"does not hold here: {missed}"
    line = (f"{MARK} {claim}: {shown_value:.{digits}g}{unit} vs {shown_reference:.{digits}g}{unit} "
            f"(expected {expect}{band}) — {verdict}")
    if show:
        print(line)
    return Conclusion(claim, shown_value, shown_reference, expect, tolerance, holds, line)


def parse_conclusion(line: str) -> Conclusion | None:
    """The conclusion a printed line states (None for any other line): what a test checks against its numbers."""
    m = _LINE.match(line.strip())
    if not m:
        return None
    tolerance = float(m["tolerance"]) / 100 if m["tolerance"] else 0.15
    return Conclusion(m["claim"], float(m["value"]), float(m["reference"]), m["expect"], tolerance,
                      m["verdict"] == "holds", line.strip())
