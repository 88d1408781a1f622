"""Build one lecture deck per solution notebook: ``solutions/NN_name.ipynb`` → ``slides/NN_name.html``.

    python course/slides.py [--check] [NAMES...]

The notebook is the deck's only source; the rule that turns it into slides (one idea per slide, at most
``MAX_WORDS`` words of visible prose, the longer prose in speaker notes):

- A heading (``#``, ``##``, ``###``, anywhere in a markdown cell) starts a section; every slide of the section
  carries its heading as title. The first ``#`` section is the title slide.
- Prose shows its **lead**: each paragraph and each list item contributes its first sentence, parentheticals
  dropped, cut at a clause (``:``, ``;``, `` — ``) or at ``MAX_LEAD_WORDS`` words if still long. Leads fill a
  slide up to ``MAX_WORDS`` words (title included) or ``MAX_POINTS`` points; the rest continue on the next
  slide under the same title. The full text of every paragraph, list item, table and code block goes into the
  slide's speaker notes (``<aside class="notes">``), so no prose is lost.
- Evidence gets a slide of its own, in notebook order, titled by its section: every PNG figure a code cell
  produced; the printed text of cells tagged ``slide-output``; the source of cells tagged ``slide``; every
  markdown table. The paragraph just before it (the claim it supports) becomes its caption rather than a slide,
  and so does a lone one-sentence paragraph before that (a task and its evidence on one slide). Long text is set
  in a smaller font, never below ``MIN_FONT_PX`` (18 px, what a projector shows): printed output drops native
  loggers' lines (the profiler's start/stop) and local cache paths, aligned columns are narrowed to two-space
  gaps, prose lines wrap, a table still too wide is shown in column groups beside its row labels, and what is
  still too tall is split over slides (a table's header repeated). A markdown table too big for one slide shows
  only its cells' marks (✓ ~ —) when most cells open with one, else its columns and rows over several slides;
  the full text of anything shortened goes into the notes.
- A ``###`` section that comes to a single sentence (a one-line task such as "Write ``f(x)``.") joins the slide
  before it as a point labelled with its heading, when that slide has room.
- A figure without a caption followed by one claim of its section takes that claim as its caption, and a short
  output followed by one claim shows it underneath (the evidence and its reading are one idea); a slide left
  without speaker notes gets its section's nearest notes.
- Decks 05, 06, 08 and 10 get their component's diagram (course/diagrams.py: inline SVG, drawn at the slide's
  size) after the first slide of the section it illustrates.
- Cells tagged ``slide-skip`` or ``colab-badge`` are left out.

A slide is a fixed 1280 × 720 px stage that the deck scales to the window, so what the headless-browser test
(``tests/course/test_slides_browser.py``) measures is what a projector shows. The deck is one self-contained
file — course/deck/deck.css and deck.js inlined, figures as data URIs, no CDN — viewable offline: arrow keys,
space or a click to move, ``n`` for the speaker notes, ``f`` for full screen; printing gives one slide per page.
``--check`` writes nothing and exits 1 when a deck differs from a fresh build.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import mistune
import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
import diagrams  # noqa: E402  (course/diagrams.py: the component diagrams, inline SVG)

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS, SLIDES = ROOT / "solutions", ROOT / "slides"
RUNTIME = Path(__file__).resolve().parent / "deck"  # deck.css and deck.js, inlined into every deck
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # terminal colour codes in stored outputs
_markdown = mistune.create_markdown(plugins=["table", "strikethrough"])

MAX_WORDS = 60  # visible prose per slide, title included: short bullets, the details stay in the notes
MAX_POINTS = 4  # leads per slide
MAX_LEAD_WORDS = 24  # a lead longer than this is cut at a clause, then at a word
SHORT_LEAD_WORDS = 7  # a first sentence shorter than this is a label: the next sentence joins it
WIDTH, HEIGHT = 1280, 720  # the stage, px; the deck scales it to the window
TEXT_W, TEXT_H = 1168, 540  # room for a <pre> under a one-line title (WIDTH − padding; HEIGHT − title − padding)
PRE_W = TEXT_W - 2 * 14  # a <pre>'s text width: the slide's less the <pre>'s own padding
MAX_CAPTION_WORDS = 30  # a lead this short captions the evidence after it
CAPTION_LINE, CAPTION_CHARS, CAPTION_GAP = 33, 80, 14  # a 24-px caption line's height, its characters, the gap
MAX_FONT_PX, MIN_FONT_PX = 22, 18  # monospaced output: as large as fits, never smaller than a projector shows
MAX_WRAP_ROWS = 3  # a printed prose line wraps over at most this many rows on a slide (all of it in the notes)
MONO_EM, LINE_EM = 0.61, 1.3  # DejaVu Sans Mono's advance width and the line height, in ems (+1 % margin)

NATIVE_LOG = re.compile(r"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\.(?:cpp|cc|h):\d+\] ")  # glog-style
LOCAL_PATH_ASIDE = re.compile(r" \([^()]*?(?:/root|/home|/tmp|/Users|~)/[^()]*\)")  # "(cached in /root/…)"
DANGLING = {"and", "or", "but", "of", "the", "a", "an", "to", "with", "for", "in", "on", "by", "from", "as"}  # no end
LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
MARK = re.compile(r"^[✓~—✗](?: / [✓~—✗])?(?=\s|$)")  # a feature table's verdict: supported, partial, absent
TABLE_EM, TABLE_PAD = 0.6, 8  # DejaVu Sans's mean advance width in ems (generous); a table cell's padding, px
HEADING = re.compile(r"^(#{1,3}) +(.*)$")
ITEM = re.compile(r"^(?:[-*+]|(\d+)\.) +")
ABBREVIATION = re.compile(r"(?:\be\.g|\bi\.e|\bet al|\bvs|\bcf|\bFig|\bapprox|\betc)\.$")


@dataclass(frozen=True)
class Block:
    """One markdown block: ``kind`` is "heading", "para", "list" or "other" (table, code, html)."""

    kind: str
    text: str
    level: int = 0  # heading level
    items: tuple[str, ...] = ()  # list items' markdown
    start: int | None = None  # an ordered list's first number


class Point(NamedTuple):
    """One lead on a text slide: its markdown, the full block's HTML for the notes, and its list (or None)."""

    lead: str
    notes: str
    group: tuple[int, str, int | None] | None  # (list number in the deck, "ul"/"ol", first number)


@dataclass
class Slide:
    """A slide under construction: its title, the HTML of its body, its notes' HTML and its kind."""

    title: str
    kind: str  # "title", "section" (a divider), "text", "statement" (a single claim), "figure", "code", "table",
    # "diagram"
    body: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    points: list[Point] = field(default_factory=list)  # a text slide's leads (to fold another section's into it)


def parse_blocks(source: str) -> list[Block]:
    """Split a markdown cell into headings, paragraphs, lists and other blocks (tables, fenced code)."""
    blocks: list[Block] = []
    lines, i = source.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif m := HEADING.match(line):
            blocks.append(Block("heading", m[2].strip(), level=len(m[1])))
            i += 1
        elif line.startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines) - 1)
            blocks.append(Block("other", "\n".join(lines[i:end + 1])))
            i = end + 1
        else:
            j = i
            while j < len(lines) and lines[j].strip() and not HEADING.match(lines[j]) \
                    and not lines[j].startswith("```"):
                j += 1
            blocks.append(_paragraph_or_list(lines[i:j]))
            i = j
    return blocks


def _paragraph_or_list(lines: list[str]) -> Block:
    text = "\n".join(lines)
    if lines[0].startswith("|") or lines[0].startswith("<"):
        return Block("other", text)
    first = ITEM.match(lines[0])
    if not first:
        return Block("para", text)
    items: list[list[str]] = []
    for line in lines:  # an item runs until the next line that starts with a marker at column 0
        if m := ITEM.match(line):
            items.append([line[m.end():]])
        else:
            items[-1].append(line.strip())
    return Block("list", text, items=tuple(" ".join(it) for it in items),
                 start=int(first[1]) if first[1] else None)


def _unclosed(text: str) -> str:
    """Close what a cut left open: a code span, bold, emphasis."""
    if text.count("`") % 2:
        text += "`"
    outside_code = re.sub(r"`[^`]*`", "", text)
    if outside_code.count("**") % 2:
        text += "**"
    if re.sub(r"\*\*", "", outside_code).count("*") % 2:
        text += "*"
    return text


def _outside_code(text: str, pos: int) -> bool:
    return text[:pos].count("`") % 2 == 0


def lead(markdown: str) -> str:
    """A paragraph's or list item's visible part: its first sentence, shortened to ``MAX_LEAD_WORDS`` words.

    A short first sentence ("Two rules.") takes the next ones along; a long one loses its parenthetical asides
    (not formulas like "(tok/s × 3600)"), then is cut at a clause, then at a word.
    """
    text = " ".join(markdown.split())
    ends = [m.end() for m in re.finditer(r"[.!?](?= |$)", text)
            if _outside_code(text, m.start()) and not ABBREVIATION.search(text[:m.end()])]
    cut = ends[0] if ends else len(text)
    for end in ends[1:]:
        if len(text[:cut].split()) >= SHORT_LEAD_WORDS or len(text[:end].split()) > MAX_LEAD_WORDS:
            break
        cut = end
    text = text[:cut]
    if len(text.split()) > MAX_LEAD_WORDS:  # asides, not calls like min(a, b) nor formulas
        text = re.sub(r"(?<= )\([^()`×÷=·+−^]*\)(?=[ ,.;:]|$)", "", text)
        text = re.sub(r" +([,.;:])", r"\1", re.sub(r"  +", " ", text))
    # the first clause of 5+ words (a claim, not a label); a colon last: what follows it is often the content
    for clause in (r"(?:;| —) ", r": "):
        if len(text.split()) <= MAX_LEAD_WORDS:
            break
        for m in re.finditer(clause, text):
            head = text[:m.start()]
            if _outside_code(text, m.start()) and 5 <= len(head.split()) <= MAX_LEAD_WORDS \
                    and head.split()[-1].lower() not in DANGLING and head.count(" — ") % 2 == 0:  # not in an aside
                text = head + "."
                break
    if len(text.split()) > MAX_LEAD_WORDS:
        text = _unclosed(" ".join(text.split()[:MAX_LEAD_WORDS - 4]).rstrip(",;:—(")) + " …"
    text = _unclosed(text.rstrip(":").rstrip())
    return text + ")" * (text.count("(") - text.count(")"))


def words(markdown: str) -> int:
    """Words a reader sees once ``markdown`` is rendered: tokens with a letter or digit (so "—" and "×" are not)."""
    shown = html.unescape(re.sub(r"<[^>]+>", " ", inline(markdown)))  # "`a`/`b`" shows as two words
    return sum(1 for w in shown.split() if re.search(r"[^\W_]", w))


def inline(markdown: str) -> str:
    """``markdown`` rendered as one line of inline HTML (a leading "1." is a number here, not a list)."""
    escaped = re.sub(r"^(\d+)\.(?= )", r"\1\\.", markdown)
    return _markdown(escaped).strip().removeprefix("<p>").removesuffix("</p>")


class DeckBuilder:
    """Walks a notebook's cells in order and collects its slides (see the module docstring for the rule)."""

    def __init__(self) -> None:
        self.slides: list[Slide] = []
        self.title = ""
        self.level = 1
        self.shown = True  # the current heading already has a slide
        self.points: list[Point] = []  # prose waiting for its slide
        self.loose_notes: list[str] = []
        self._lists = 0
        self.first = 0  # the current section's first slide


    def heading(self, block: Block) -> None:
        """Close the current section and open the one ``block`` heads."""
        self.flush()
        if not self.shown:  # a heading with nothing under it still gets its slide: a divider, its title centred
            self.slides.append(Slide(self.title, "title" if self.level == 1 else "section"))
        self.fold()
        self.title, self.level, self.shown, self.first = block.text, block.level, False, len(self.slides)

    def fold(self) -> None:
        """A ``###`` section that came to one sentence on a slide of its own (a one-line task: "Write f(x).")
        joins the slide before it as a point labelled with its heading, when that slide has room."""
        mine, before = self.slides[self.first:], self.slides[self.first - 1] if self.first else None
        if self.level != 3 or len(mine) != 1 or mine[0].kind != "statement" or before is None \
                or before.kind not in ("text", "statement") or not before.points:
            return
        point = mine[0].points[0]
        label = Point(f"**{self.title}:** {point.lead}", point.notes, None)
        merged = before.points + [label]
        if len(merged) > MAX_POINTS or words(before.title) + sum(words(p.lead) for p in merged) > MAX_WORDS:
            return
        before.kind, before.body, before.points = "text", [_points_html(merged)], merged
        before.notes += mine[0].notes
        self.slides.pop()

    def prose(self, block: Block) -> None:
        """Queue a paragraph's or list's leads for the next text slide; tables and code go to the notes only."""
        if block.kind == "para":
            self.points.append(Point(lead(block.text), _markdown(block.text), None))
        elif block.kind == "list":
            self._lists += 1
            tag = "ol" if block.start is not None else "ul"
            for item in block.items:
                self.points.append(Point(lead(item), _markdown(item), (self._lists, tag, block.start)))
        elif block.text.startswith("|"):
            self.evidence("table", block.text)
        else:
            self.loose_notes.append(_markdown(block.text))

    def evidence(self, kind: str, content: str) -> None:
        """A figure (``content`` is its ``<img>``) or monospaced text (``kind`` "code" or "output": the text) on
        slides of its own. A short paragraph just before it (the claim it supports) becomes its caption instead
        of a slide, and so does a lone paragraph before that one (a one-sentence task: claim and evidence on one
        slide rather than a slide each)."""
        captions: list[Point] = []
        title_slide = self.level == 1 and not self.shown  # keeps its leads: the deck opens with its claim
        if self.points and self.points[-1].group is None and words(self.points[-1].lead) <= MAX_CAPTION_WORDS \
                and not title_slide:
            captions.append(self.points.pop())
            if len(self.points) == 1 and self.points[0].group is None and not self.shown \
                    and words(self.title) + words(self.points[0].lead) + words(captions[0].lead) <= MAX_WORDS - 10:
                captions.insert(0, self.points.pop())
        self.flush()
        top = "".join(f'<p class="caption">{inline(c.lead)}</p>\n' for c in captions)
        room = TEXT_H - sum(caption_height(c.lead) for c in captions)
        pages = [(content, "")] if kind == "figure" else table_pages(content, room) if kind == "table" \
            else text_pages(content, kind, room)
        for k, (body, full) in enumerate(pages):
            notes = ([c.notes for c in captions] + self.loose_notes if k == 0 else []) + ([full] if full else [])
            self.slides.append(Slide(self.title, "code" if kind in ("output", "code") else kind,
                                     [(top if k == 0 else "") + body], notes))
        self.loose_notes, self.shown = [], True

    def flush(self) -> None:
        """Turn the pending prose into text slides of at most MAX_WORDS words and MAX_POINTS leads."""
        pages: list[list[Point]] = []
        budget = MAX_WORDS - words(self.title)
        for point in self.points:
            used = sum(words(p.lead) for p in pages[-1]) if pages else 0
            if not pages or len(pages[-1]) == MAX_POINTS or used + words(point.lead) > budget:
                pages.append([])
            pages[-1].append(point)
        for k, page in enumerate(pages):
            kind = "title" if self.level == 1 and not self.shown and k == 0 else \
                "statement" if len(page) == 1 and page[0].group is None else "text"  # one claim: say it big
            self.slides.append(Slide(self.title, kind, [_points_html(page)], [p.notes for p in page], page))
        if pages:
            self.slides[-1].notes += self.loose_notes
            self.loose_notes, self.shown = [], True
        elif self.loose_notes and self.slides:
            self.slides[-1].notes += self.loose_notes
            self.loose_notes = []
        self.points = []


def _used_height(body: str) -> int:
    """Estimated pixels an evidence slide's captions and ``<pre>`` take (as ``text_pages`` laid them out)."""
    used = sum(caption_height(html.unescape(re.sub(r"<[^>]+>", "", c)))
               for c in re.findall(r'<p class="caption[^"]*">(.*?)</p>', body, re.S))
    for font, text in re.findall(r'<pre class="\w+" style="font-size: (\d+)px">(.*?)</pre>', body, re.S):
        per_line = max(1, int(PRE_W / (MONO_EM * int(font))))
        rows = sum(_rows(ln, per_line) for ln in html.unescape(text).split("\n"))
        used += int(rows * LINE_EM * int(font)) + 2 * 10  # the <pre>'s vertical padding
    return used if "<pre" in body else TEXT_H  # only text evidence has a known height


def caption_height(markdown: str) -> int:
    """Pixels a caption takes above the evidence: its estimated lines of 24-px text and the gap under it."""
    text = html.unescape(re.sub(r"<[^>]+>", "", inline(markdown)))
    return -(-len(text) // CAPTION_CHARS) * CAPTION_LINE + CAPTION_GAP


def _points_html(page: list[Point]) -> str:
    """The leads as paragraphs, and consecutive items of one list as one <ul>/<ol>."""
    out, open_list = [], None
    for text, _, group in page:
        if group != open_list and open_list is not None:
            out.append(f"</{open_list[1]}>")
        if group is not None and group != open_list:
            start = f' start="{group[2]}"' if group[1] == "ol" and group[2] not in (None, 1) else ""
            out.append(f"<{group[1]}{start}>")
        out.append(f"<li>{inline(text)}</li>" if group is not None else f"<p>{inline(text)}</p>")
        open_list = group
    if open_list is not None:
        out.append(f"</{open_list[1]}>")
    return "\n".join(out)


def clean_output(text: str) -> list[str]:
    """A cell's printed text as the slide shows it: colour codes, native loggers' lines (the profiler's
    start/stop) and asides naming local cache files dropped; trailing blank lines gone."""
    text = ANSI.sub("", text.rstrip()).expandtabs()
    lines = [LOCAL_PATH_ASIDE.sub("", ln) for ln in text.split("\n") if not NATIVE_LOG.match(ln)]
    while lines and not lines[0].strip():
        lines.pop(0)
    return lines or [""]


def is_tabular(line: str) -> bool:
    """A line whose spacing carries meaning (aligned columns: two spaces inside it) must not wrap; prose may."""
    return "  " in line.strip()


def _blocks(lines: list[str]) -> list[tuple[bool, list[str]]]:
    """``lines`` in runs: ``(True, lines)`` for two or more consecutive tabular lines, else ``(False, [line])``."""
    out, k = [], 0
    while k < len(lines):
        end = k
        while end < len(lines) and is_tabular(lines[end]):
            end += 1
        if end - k >= 2:
            out.append((True, lines[k:end]))
            k = end
        else:
            out.append((False, [lines[k]]))
            k += 1
    return out


def _blank_columns(block: list[str]) -> tuple[list[str], list[bool]]:
    width = max(len(ln) for ln in block)
    padded = [ln.ljust(width) for ln in block]
    return padded, [all(ln[c] == " " for ln in padded) for c in range(width)]


def compact_columns(lines: list[str]) -> list[str]:
    """Narrow aligned text without breaking its alignment: inside each run of two or more tabular lines, every
    stretch of character columns that is blank in all of them keeps at most two of its columns; a lone line's
    spacing aligns it with nothing, so its gaps become one space."""
    out: list[str] = []
    for table, block in _blocks(lines):
        if not table:
            out.append(re.sub(r"(?<=\S)  +", " ", block[0]))
            continue
        padded, blank = _blank_columns(block)
        keep, run = [], 0
        for c, is_blank in enumerate(blank):
            run = run + 1 if is_blank and c > 0 else 0
            keep.append(run <= 2)
        out += ["".join(ch for ch, kept in zip(ln, keep, strict=True) if kept).rstrip() for ln in padded]
    return out


def split_columns(lines: list[str], width: int) -> list[str]:
    """Tables wider than ``width`` characters shown as several narrower ones, each with the row labels (the
    columns before the first two-space gap) and as many further columns as fit; a table of two lines is too small
    to split, so it becomes prose that wraps."""
    out: list[str] = []
    for table, block in _blocks(lines):
        if not table or max(len(ln) for ln in block) <= width:
            out += block
            continue
        if len(block) < 3:
            out += [re.sub(r"(?<=\S)  +", " ", ln) for ln in block]
            continue
        padded, blank = _blank_columns(block)
        fields, start = [], None  # [start, end) spans of non-blank character columns
        for c, is_blank in enumerate(blank + [True]):
            if not is_blank and start is None:
                start = c
            elif is_blank and start is not None:
                fields.append((start, c))
                start = None
        label = next((k for k in range(1, len(fields)) if fields[k][0] - fields[k - 1][1] >= 2), 1)
        label_end, groups = fields[label - 1][1], [[]]
        for f in fields[label:]:
            if groups[-1] and f[1] - groups[-1][0][0] + label_end + 2 > width:
                groups.append([])
            groups[-1].append(f)
        for g, group in enumerate(groups):
            out += ([""] if g else []) + [(ln[:label_end] + "  " + ln[group[0][0]:group[-1][1]]).rstrip()
                                          for ln in padded]
    return out


def _rows(line: str, per_line: int) -> int:
    return max(1, -(-len(line) // per_line))


def text_pages(text: str, css_class: str, height: int = TEXT_H) -> list[tuple[str, str]]:
    """Monospaced text as ``(slide HTML, notes HTML)`` pages: ``<pre>`` blocks in the largest font (at least
    ``MIN_FONT_PX``) at which every aligned line fits the width and the text the height; prose lines wrap (at most
    ``MAX_WRAP_ROWS`` rows, the rest in the notes), and what is still too tall is split over slides, repeating a
    table's first line on the slide that continues it. Cost: a few passes over the lines."""
    raw = ANSI.sub("", text.rstrip()).expandtabs()

    def per_line(font: int) -> int:
        return max(1, int(PRE_W / (MONO_EM * font)))

    lines = compact_columns(clean_output(text)) if css_class == "output" else raw.split("\n")
    if css_class == "output":
        lines = split_columns(lines, per_line(MIN_FONT_PX))
    widest = max((len(ln) for ln in lines if css_class != "output" or is_tabular(ln)), default=1) or 1

    def fitted(font: int) -> list[str]:
        n = per_line(font)
        if css_class != "output":
            return lines
        most = n * MAX_WRAP_ROWS
        return [ln if len(ln) <= most or is_tabular(ln) else ln[:most - 2].rstrip() + " …" for ln in lines]

    font = MIN_FONT_PX
    for size in range(MAX_FONT_PX, MIN_FONT_PX - 1, -1):  # the largest font that fits on one slide
        if widest <= per_line(size) and sum(_rows(ln, per_line(size)) for ln in fitted(size)) \
                <= int(height / (LINE_EM * size)):
            font = size
            break
    else:  # does not fit one slide: the largest font at which the aligned lines fit their width, then split
        font = next((size for size in range(MAX_FONT_PX, MIN_FONT_PX - 1, -1) if widest <= per_line(size)),
                    MIN_FONT_PX)
    shown, n = fitted(font), per_line(font)
    rows, pages, used, header = int(height / (LINE_EM * font)), [[]], 0, None
    for k, ln in enumerate(shown):
        starts_table = is_tabular(ln) and (k == 0 or not is_tabular(shown[k - 1]))
        header = ln if starts_table else header if is_tabular(ln) else None
        need = _rows(ln, n)
        if used + need > rows and pages[-1]:
            pages.append([header] if header is not None and header != ln else [])
            used = sum(_rows(h, n) for h in pages[-1])
        pages[-1].append(ln)
        used += need
    trimmed = shown != lines
    return [(f'<pre class="{css_class}" style="font-size: {font}px">{html.escape(chr(10).join(p))}</pre>',
             f"<pre>{html.escape(raw)}</pre>" if trimmed and k == 0 else "") for k, p in enumerate(pages)]


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def _plain(markdown: str) -> str:
    """What a reader sees of a table cell: links' text, no emphasis marks."""
    return re.sub(r"\*\*|`", "", LINK.sub(r"\1", markdown))


def _table_size(rows: list[list[str]], font: int) -> tuple[int, int]:
    """Estimated (narrowest possible width, height at the stage's width) of ``rows`` as an HTML table, px."""
    char, pad = TABLE_EM * font, 2 * TABLE_PAD
    cols = list(zip(*rows, strict=True))
    least = [max(len(w) for c in col for w in (c.split() or [""])) * char + pad for col in cols]
    natural = [max(len(c) for c in col) * char + pad for col in cols]
    spare = max(0.0, TEXT_W - sum(least))
    extra = [n - m for n, m in zip(natural, least, strict=True)]
    widths = [m + spare * e / (sum(extra) or 1) if sum(natural) > TEXT_W else n
              for m, n, e in zip(least, natural, extra, strict=True)]
    lines = [max(-(-int(len(c) * char) // max(1, int(w - pad))) or 1 for c, w in zip(row, widths, strict=True))
             for row in rows]
    return int(sum(least)), int(sum(n * LINE_EM * font + pad for n in lines))


def table_pages(markdown: str, height: int = TEXT_H) -> list[tuple[str, str]]:
    """A markdown table as ``(slide HTML, notes HTML)`` pages, at the largest font from ``MAX_FONT_PX`` down to
    ``MIN_FONT_PX`` that fits. A table too big for that shows only the marks (✓ ~ —) its cells open with, when
    most do (the full table goes to the notes), then its columns in groups beside the first column, then its rows
    over several slides, the header repeated."""
    lines = [ln for ln in markdown.strip().splitlines() if not re.match(r"^\|[\s:|-]+\|?$", ln)]
    md_rows = [[LINK.sub(r"\1", c) for c in _cells(ln)] for ln in lines]  # the deck has no notebooks to link
    md_rows = [(row + [""] * len(md_rows[0]))[:len(md_rows[0])] for row in md_rows]  # ragged rows: header-wide
    rows = [[_plain(c) for c in row] for row in md_rows]
    notes = ""
    body = [c for row in rows[1:] for c in row[1:]]
    marked = [MARK.match(c) for c in body]
    font = next((f for f in range(MAX_FONT_PX, MIN_FONT_PX - 1, -1)
                 if _table_size(rows, f)[0] <= TEXT_W and _table_size(rows, f)[1] <= height), None)
    if font is None and sum(bool(m) for m in marked) * 2 >= len(body):
        md_rows = [md_rows[0]] + [[row[0]] + [(MARK.match(_plain(c)) or [c])[0].strip() for c in row[1:]]
                                  for row in md_rows[1:]]
        rows, notes = [[_plain(c) for c in row] for row in md_rows], _markdown(markdown)
        font = next((f for f in range(MAX_FONT_PX, MIN_FONT_PX - 1, -1)
                     if _table_size(rows, f)[0] <= TEXT_W and _table_size(rows, f)[1] <= height), None)
    if font is not None:
        groups = [list(range(len(rows[0])))]
    else:  # columns in groups beside the first, then rows over slides
        font, notes, groups = MIN_FONT_PX, _markdown(markdown), [[0]]
        for c in range(1, len(rows[0])):
            trial = groups[-1] + [c]
            if len(groups[-1]) > 1 and _table_size([[r[k] for k in trial] for r in rows], font)[0] > TEXT_W:
                groups.append([0])
            groups[-1].append(c)
    pages = []
    for group in groups:
        chunk: list[int] = []
        for r in range(1, len(rows)):
            trial = [0] + chunk + [r]
            if chunk and _table_size([[rows[i][k] for k in group] for i in trial], font)[1] > height:
                pages.append((group, chunk))
                chunk = []
            chunk.append(r)
        pages.append((group, chunk))
    out = []
    for k, (group, chunk) in enumerate(pages):
        head = "".join(f"<th>{inline(md_rows[0][c])}</th>" for c in group)
        body_html = "".join("<tr>" + "".join(f"<td>{inline(md_rows[r][c])}</td>" for c in group) + "</tr>\n"
                            for r in chunk)
        out.append((f'<table class="deck-table" style="font-size: {font}px">\n<thead><tr>{head}</tr></thead>\n'
                    f"<tbody>\n{body_html}</tbody>\n</table>", notes if k == 0 else ""))
    return out


def build_slides(nb: nbformat.NotebookNode, name: str = "") -> list[Slide]:
    """The deck's slides, in notebook order; ``name`` (``NN_name``) picks the component diagram, if any."""
    deck = DeckBuilder()
    for cell in nb.cells:
        tags = cell.metadata.get("tags", [])
        if "colab-badge" in tags or "slide-skip" in tags:
            continue
        if cell.cell_type == "markdown":
            for block in parse_blocks(cell.source):
                deck.heading(block) if block.kind == "heading" else deck.prose(block)
        elif cell.cell_type == "code":
            if "slide" in tags:
                deck.evidence("code", cell.source)
            if "slide-output" in tags:
                text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
                if text.strip():
                    deck.evidence("output", text)
            for out in cell.get("outputs", []):
                png = out.get("data", {}).get("image/png")
                if png:
                    alt = html.escape(out.get("data", {}).get("text/plain", "figure"), quote=True)
                    deck.evidence("figure", f'<img alt="{alt}" src="data:image/png;base64,{png.strip()}">')
    deck.heading(Block("heading", "", level=1))  # flush the last section
    return with_diagram(finish(deck.slides), name[:2])


def with_diagram(slides: list[Slide], number: str) -> list[Slide]:
    """The deck's component diagram (course/diagrams.py) as a slide after the first slide of its section."""
    if number not in diagrams.DIAGRAMS:
        return slides
    heading, draw = diagrams.DIAGRAMS[number]
    where = next((k for k, s in enumerate(slides) if s.title.startswith(heading)), None)
    if where is None:
        raise ValueError(f"deck {number}: no section titled {heading!r} for its diagram; "
                         f"fix the heading in course/diagrams.py DIAGRAMS")
    caption, notes, svg = draw()
    slide = Slide(slides[where].title, "diagram", [f'<p class="caption">{inline(caption)}</p>\n{svg}'], [notes])
    return slides[:where + 1] + [slide] + slides[where + 1:]


def finish(slides: list[Slide]) -> list[Slide]:
    """Last touches over the whole deck. A figure without a caption followed by one claim of its section takes
    that claim as its caption (the figure and its reading are one idea); a slide still without speaker notes
    gets its section's nearest notes, so the presenter always has the notebook's words at hand."""
    out: list[Slide] = []
    for slide in slides:
        before = out[-1] if out else None
        if before is not None and before.kind == "figure" and slide.kind == "statement" \
                and slide.title == before.title and 'class="caption"' not in before.body[0]:
            before.body = [f'<p class="caption">{inline(slide.points[0].lead)}</p>\n' + before.body[0]]
            before.notes += slide.notes
            continue
        if before is not None and before.kind == "code" and slide.kind == "statement" \
                and slide.title == before.title and _used_height(before.body[0]) \
                + caption_height(slide.points[0].lead) <= TEXT_H:  # the reading of a short output goes under it
            before.body = [before.body[0] + f'\n<p class="caption takeaway">{inline(slide.points[0].lead)}</p>']
            before.notes += slide.notes
            continue
        out.append(slide)
    for k, slide in enumerate(out):
        if slide.notes or slide.kind == "title":
            continue
        near = [out[j] for j in (k - 1, k + 1, k - 2, k + 2) if 0 <= j < len(out) and out[j].title == slide.title]
        source = next((other for other in near if other.notes), None)
        if source is not None:
            slide.notes = list(source.notes)
    return out


def _slide_html(k: int, slide: Slide) -> str:
    tag = "h1" if slide.kind == "title" else "h2"
    title = inline(slide.title)
    notes = "\n".join(slide.notes)
    return (f'<section class="slide {slide.kind}" id="s{k + 1}">\n<{tag}>{title}</{tag}>\n'
            f'<div class="body">\n' + "\n".join(slide.body) + "\n</div>\n"
            + (f'<aside class="notes">\n{notes}</aside>\n' if notes else "") + "</section>")





def render_deck(nb: nbformat.NotebookNode, title: str, name: str = "") -> str:
    """The whole deck as one self-contained HTML document (``name``: the notebook's ``NN_name``)."""
    body = "\n".join(_slide_html(k, s) for k, s in enumerate(build_slides(nb, name)))
    css, js = (RUNTIME / "deck.css").read_text(), (RUNTIME / "deck.js").read_text()
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{html.escape(title)}</title>\n<style>\n{css}</style>\n</head>\n<body>\n"
            f'<div id="stage">\n{body}\n</div>\n<div id="notes"></div><div id="bar"></div><div id="count"></div>\n'
            f"<script>\n{js}</script>\n</body>\n</html>\n")


def deck_title(nb: nbformat.NotebookNode, fallback: str) -> str:
    """The notebook's ``#`` heading, else ``fallback``."""
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.startswith("# "):
            return cell.source.split("\n", 1)[0][2:].strip()
    return fallback


def build(names: list[str], *, check: bool, solutions: Path = SOLUTIONS, out_dir: Path = SLIDES) -> int:
    """Render the decks of the notebooks matching ``names`` (all when empty); with ``check``, only compare."""
    notebooks = sorted(solutions.glob("[0-9][0-9]_*.ipynb"))
    if names:
        notebooks = [p for p in notebooks if any(p.stem.startswith(Path(n).stem) for n in names)]
    if not notebooks:
        print(f"no solution notebooks in {solutions} match {names or 'anything'}", file=sys.stderr)
        return 2
    stale = []
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        text = render_deck(nb, deck_title(nb, path.stem), path.stem)
        target = out_dir / f"{path.stem}.html"
        if not target.exists() or target.read_text() != text:
            stale.append(target)
            if not check:
                out_dir.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
                print(f"wrote {target}")
    if check and stale:
        print("stale slides (run `python course/slides.py`): " + ", ".join(str(p) for p in stale), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python course/slides.py [--check] [--out DIR] [NAMES...]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="decks to build (e.g. 01); default: all")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a deck is stale")
    parser.add_argument("--out", type=Path, default=SLIDES, help="output folder (default: slides/)")
    args = parser.parse_args(argv)
    return build(args.names, check=args.check, out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
