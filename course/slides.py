"""Build one HTML slide deck per solution notebook: ``solutions/NN_name.ipynb`` → ``slides/NN_name.html``.

    python course/slides.py [--check] [NAMES...]

A new slide starts at every markdown cell that opens with a heading (``#``, ``##``, ``###``). A slide shows the
markdown (rendered with mistune, which nbconvert already depends on) and the figures that the code cells after it
produced (PNG outputs, inlined as base64). Code cells tagged ``slide`` also show their source, cells tagged
``slide-output`` their printed text; cells tagged ``slide-skip`` are left out. The deck is one
self-contained file — inline CSS and JS, no CDN, no network — viewable offline in any browser: arrow keys,
space or a click to move, ``f`` for full screen, and printing gives one slide per page.
``--check`` writes nothing and exits 1 when a deck differs from a fresh build.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
from pathlib import Path

import mistune
import nbformat

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS, SLIDES = ROOT / "solutions", ROOT / "slides"
HEADING = re.compile(r"^#{1,3} ")
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # terminal colour codes in stored outputs
_markdown = mistune.create_markdown(plugins=["table", "strikethrough"])

CSS = """
:root { --fg: #1d232b; --muted: #5b6570; --accent: #b3261e; --bg: #fdfdfc; }
* { box-sizing: border-box; }
html, body { margin: 0; height: 100%; background: #2b2f33; font-family: system-ui, -apple-system, "Segoe UI",
  Roboto, sans-serif; color: var(--fg); }
.slide { display: none; position: absolute; inset: 2vh 2vw; background: var(--bg); border-radius: 6px;
  padding: 3vh 4vw; overflow: auto; font-size: clamp(14px, 1.55vw, 26px); line-height: 1.45; }
.slide.active { display: block; }
.slide h1 { font-size: 2.1em; margin: .2em 0 .5em; color: var(--accent); }
.slide h2 { font-size: 1.6em; margin: .1em 0 .5em; color: var(--accent); }
.slide h3 { font-size: 1.25em; margin: .1em 0 .4em; }
.slide code { background: #eef0f2; padding: 0 .2em; border-radius: 3px; font-size: .9em; }
.slide pre { background: #f3f4f6; padding: .6em .8em; border-radius: 4px; overflow-x: auto; font-size: .75em; }
.slide pre code { background: none; padding: 0; }
.slide pre.output { background: #f7f7f2; border-left: 3px solid var(--accent); }
.slide table { border-collapse: collapse; } .slide td, .slide th { border: 1px solid #ccc; padding: .2em .6em; }
.figures { display: flex; flex-wrap: wrap; gap: 1em; justify-content: center; margin-top: .6em; }
.figures img { max-width: 100%; max-height: 62vh; }
#bar { position: fixed; bottom: 0; left: 0; height: 4px; background: var(--accent); transition: width .2s; }
#count { position: fixed; bottom: 8px; right: 14px; color: #ccc; font-size: 13px; }
@media print {
  html, body { background: white; }
  .slide { display: block; position: relative; inset: auto; height: auto; page-break-after: always;
    overflow: visible; border-radius: 0; }
  #bar, #count { display: none; }
}
"""

JS = """
(function () {
  const slides = Array.from(document.querySelectorAll('.slide'));
  const bar = document.getElementById('bar'), count = document.getElementById('count');
  let i = Math.max(0, Math.min(slides.length - 1, (parseInt(location.hash.slice(1), 10) || 1) - 1));
  function show(n) {
    i = Math.max(0, Math.min(slides.length - 1, n));
    slides.forEach((s, k) => s.classList.toggle('active', k === i));
    bar.style.width = (100 * (i + 1) / slides.length) + '%';
    count.textContent = (i + 1) + ' / ' + slides.length;
    history.replaceState(null, '', '#' + (i + 1));
  }
  document.addEventListener('keydown', (e) => {
    if (['ArrowRight', 'PageDown', ' ', 'ArrowDown'].includes(e.key)) { show(i + 1); e.preventDefault(); }
    else if (['ArrowLeft', 'PageUp', 'ArrowUp'].includes(e.key)) { show(i - 1); e.preventDefault(); }
    else if (e.key === 'Home') show(0);
    else if (e.key === 'End') show(slides.length - 1);
    else if (e.key === 'f' && document.documentElement.requestFullscreen) document.documentElement.requestFullscreen();
  });
  document.addEventListener('click', (e) => {
    if (e.target.closest('a, pre, table')) return;
    show(e.clientX > window.innerWidth / 3 ? i + 1 : i - 1);
  });
  show(i);
})();
"""


def split_slides(nb: nbformat.NotebookNode) -> list[list[str]]:
    """HTML fragments per slide: rendered markdown, tagged code, and the figures of the cells in between."""
    slides: list[list[str]] = []
    figures: list[str] = []

    def flush_figures():
        if figures and slides:
            slides[-1].append('<div class="figures">' + "".join(figures) + "</div>")
        figures.clear()

    for cell in nb.cells:
        tags = cell.metadata.get("tags", [])
        if "colab-badge" in tags or "slide-skip" in tags:
            continue
        if cell.cell_type == "markdown":
            if HEADING.match(cell.source) or not slides:
                flush_figures()
                slides.append([])
            slides[-1].append(_markdown(cell.source))
        elif cell.cell_type == "code":
            if "slide" in tags:
                flush_figures()
                slides[-1].append(f"<pre><code>{html.escape(cell.source)}</code></pre>")
            if "slide-output" in tags:
                text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
                if text.strip():
                    flush_figures()
                    slides[-1].append(f'<pre class="output">{html.escape(ANSI.sub("", text.rstrip()))}</pre>')
            for out in cell.get("outputs", []):
                png = out.get("data", {}).get("image/png")
                if png:
                    alt = html.escape(out.get("data", {}).get("text/plain", "figure"), quote=True)
                    figures.append(f'<img alt="{alt}" src="data:image/png;base64,{png.strip()}">')
    flush_figures()
    return [s for s in slides if s]


def render_deck(nb: nbformat.NotebookNode, title: str) -> str:
    """The whole deck as one self-contained HTML document."""
    body = "\n".join(f'<section class="slide" id="s{k + 1}">\n' + "\n".join(parts) + "\n</section>"
                     for k, parts in enumerate(split_slides(nb)))
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{html.escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n{body}\n"
            f'<div id="bar"></div><div id="count"></div>\n<script>{JS}</script>\n</body>\n</html>\n')


def deck_title(nb: nbformat.NotebookNode, fallback: str) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.startswith("# "):
            return cell.source.split("\n", 1)[0][2:].strip()
    return fallback


def build(names: list[str], *, check: bool, solutions: Path = SOLUTIONS, out_dir: Path = SLIDES) -> int:
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="decks to build (e.g. 01); default: all")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a deck is stale")
    parser.add_argument("--out", type=Path, default=SLIDES, help="output folder (default: slides/)")
    args = parser.parse_args(argv)
    return build(args.names, check=args.check, out_dir=args.out)


if __name__ == "__main__":
    sys.exit(main())
