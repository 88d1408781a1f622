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
  produced; the printed text of cells tagged ``slide-output``; the source of cells tagged ``slide``. The
  paragraph just before it (the claim it supports) becomes its caption rather than a slide. Long text is set in
  a smaller font (never below ``MIN_FONT_PX``) and, if it still does not fit, split over slides.
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
MAX_CAPTION_WORDS, CAPTION_H = 30, 90  # a lead this short captions the evidence after it; two 24-px lines + gap
MAX_FONT_PX, MIN_FONT_PX = 22, 12  # monospaced output: as large as fits, never smaller than readable
MONO_EM, LINE_EM = 0.61, 1.3  # DejaVu Sans Mono's advance width and the line height, in ems (+1 % margin)

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
    kind: str  # "title", "text", "statement" (a single claim), "figure", "code"
    body: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


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
    if len(text.split()) > MAX_LEAD_WORDS:
        for m in re.finditer(r"(?::|;| —) ", text):  # the first clause of 5+ words: a claim, not a label
            if _outside_code(text, m.start()) and 5 <= len(text[:m.start()].split()) <= MAX_LEAD_WORDS:
                text = text[:m.start()] + "."
                break
    if len(text.split()) > MAX_LEAD_WORDS:
        text = _unclosed(" ".join(text.split()[:MAX_LEAD_WORDS - 4]).rstrip(",;:—(")) + " …"
    text = _unclosed(text.rstrip(":").rstrip())
    return text + ")" * (text.count("(") - text.count(")"))


def words(markdown: str) -> int:
    """Words a reader sees once ``markdown`` is rendered: tokens with a letter or digit (so "—" and "×" are not)."""
    return sum(1 for w in markdown.split() if re.search(r"[^\W_]", w))


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

    def heading(self, block: Block) -> None:
        """Close the current section and open the one ``block`` heads."""
        self.flush()
        if not self.shown:  # a heading with nothing under it still gets its slide (a section divider)
            self.slides.append(Slide(self.title, "title" if self.level == 1 else "text"))
        self.title, self.level, self.shown = block.text, block.level, False

    def prose(self, block: Block) -> None:
        """Queue a paragraph's or list's leads for the next text slide; tables and code go to the notes only."""
        if block.kind == "para":
            self.points.append(Point(lead(block.text), _markdown(block.text), None))
        elif block.kind == "list":
            self._lists += 1
            tag = "ol" if block.start is not None else "ul"
            for item in block.items:
                self.points.append(Point(lead(item), _markdown(item), (self._lists, tag, block.start)))
        else:
            self.loose_notes.append(_markdown(block.text))

    def evidence(self, kind: str, content: str) -> None:
        """A figure (``content`` is its ``<img>``) or monospaced text (``kind`` "code" or "output": the text) on
        slides of its own; a short paragraph just before it becomes its caption instead of a slide."""
        caption = None
        if self.points and self.points[-1].group is None and words(self.points[-1].lead) <= MAX_CAPTION_WORDS:
            caption = self.points.pop()
        self.flush()
        room = TEXT_H - (CAPTION_H if caption else 0)
        bodies = [content] if kind == "figure" else text_pages(content, kind, room)
        for k, body in enumerate(bodies):
            top = f'<p class="caption">{inline(caption.lead)}</p>\n' if caption and k == 0 else ""
            notes = ([caption.notes] if caption and k == 0 else []) + (self.loose_notes if k == 0 else [])
            self.slides.append(Slide(self.title, "figure" if kind == "figure" else "code", [top + body], notes))
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
            self.slides.append(Slide(self.title, kind, [_points_html(page)], [p.notes for p in page]))
        if pages:
            self.slides[-1].notes += self.loose_notes
            self.loose_notes, self.shown = [], True
        elif self.loose_notes and self.slides:
            self.slides[-1].notes += self.loose_notes
            self.loose_notes = []
        self.points = []


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


def text_pages(text: str, css_class: str, height: int = TEXT_H) -> list[str]:
    """``<pre>`` blocks for monospaced text, in the largest font that fits the stage, split if it cannot."""
    lines = ANSI.sub("", text.rstrip()).expandtabs().split("\n")
    widest = max(len(ln) for ln in lines) or 1
    font = min(MAX_FONT_PX, int(TEXT_W / (MONO_EM * widest)), int(height / (LINE_EM * len(lines))))
    if font >= MIN_FONT_PX:
        pages = [lines]
    else:  # as small as allowed; long lines wrap, and the lines are shared out over slides
        font = max(MIN_FONT_PX, min(MAX_FONT_PX, int(TEXT_W / (MONO_EM * widest))))
        per_line = max(1, int(TEXT_W / (MONO_EM * font)))
        rows, pages, used = int(height / (LINE_EM * font)), [[]], 0
        for ln in lines:
            need = max(1, -(-len(ln) // per_line))
            if used + need > rows and pages[-1]:
                pages.append([])
                used = 0
            pages[-1].append(ln)
            used += need
    return [f'<pre class="{css_class}" style="font-size: {font}px">{html.escape(chr(10).join(p))}</pre>'
            for p in pages]


def build_slides(nb: nbformat.NotebookNode) -> list[Slide]:
    """The deck's slides, in notebook order."""
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
    return deck.slides


def _slide_html(k: int, slide: Slide) -> str:
    tag = "h1" if slide.kind == "title" else "h2"
    title = inline(slide.title)
    notes = "\n".join(slide.notes)
    return (f'<section class="slide {slide.kind}" id="s{k + 1}">\n<{tag}>{title}</{tag}>\n'
            f'<div class="body">\n' + "\n".join(slide.body) + "\n</div>\n"
            + (f'<aside class="notes">\n{notes}</aside>\n' if notes else "") + "</section>")





def render_deck(nb: nbformat.NotebookNode, title: str) -> str:
    """The whole deck as one self-contained HTML document."""
    body = "\n".join(_slide_html(k, s) for k, s in enumerate(build_slides(nb)))
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
        text = render_deck(nb, deck_title(nb, path.stem))
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
