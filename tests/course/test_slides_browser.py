"""The committed decks render in a real browser: every slide shows something, nothing overflows the 1280 × 720
slide, every figure loads, no text is set under 18 px, and no slide carries more than ~60 words of prose
(course/slides.py's rule; printed outputs, tables and diagrams are evidence, not prose).

Chromium runs headless on each deck (`chromium --headless --dump-dom`) with a probe script appended to a copy of
the deck: on load the probe walks the deck with the deck's own keyboard navigation (ArrowRight), measures every
element's box with getBoundingClientRect, and writes its findings as JSON into the DOM that Chromium dumps. No
Python browser driver is needed; the browser does the layout, the test reads the numbers.

Skips with a message when no Chromium is installed (Debian: `apt-get install chromium`; or point
MINILLM_CHROMIUM at a Chrome/Chromium binary). `.ci/run` installs Debian's package and sets
MINILLM_REQUIRE_BROWSER=1, which turns the skip into a failure, so CI cannot pass without the check running.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DECKS = sorted((ROOT / "slides").glob("[0-9][0-9]_*.html"))
WIDTH, HEIGHT = 1280, 720  # the viewport the decks are checked at (and their stage size)
MAX_WORDS = 62  # course/slides.py allows 60 words of prose per slide; rendering may split a token in two
MIN_FIGURE_SHARE = 0.2  # a figure covers at least this share of the slide, or it is too small to read
MIN_FONT_PX = 18  # body text a projector shows: outputs and tables too (course/slides.py sets none smaller)

PROBE = """
<script>
window.addEventListener('load', () => {
  const out = {viewport: [innerWidth, innerHeight], slides: []};
  const slides = Array.from(document.querySelectorAll('.slide'));
  const key = (k) => document.dispatchEvent(new KeyboardEvent('keydown', {key: k, bubbles: true}));
  key('Home');
  slides.forEach((_, k) => {
    if (k > 0) key('ArrowRight');
    const active = Array.from(document.querySelectorAll('.slide.active'));
    const slide = slides[k], box = slide.getBoundingClientRect(), problems = [];
    if (active.length !== 1 || active[0] !== slide)
      problems.push('navigation did not make this slide the only active one');
    if (box.left < -0.5 || box.top < -0.5 || box.right > innerWidth + 0.5 || box.bottom > innerHeight + 0.5)
      problems.push('slide box outside the viewport: ' + JSON.stringify(box));
    if (slide.scrollHeight > slide.clientHeight + 1 || slide.scrollWidth > slide.clientWidth + 1)
      problems.push('slide content scrolls: ' + slide.scrollWidth + 'x' + slide.scrollHeight);
    let minFont = 1e9;
    slide.querySelectorAll('*').forEach((el) => {
      if (el.closest('.notes')) return;
      const r = el.getBoundingClientRect(), name = el.tagName.toLowerCase() + (el.className ? '.' + el.className : '');
      if (r.width === 0 && r.height === 0) return;
      if (r.left < box.left - 1 || r.top < box.top - 1 || r.right > box.right + 1 || r.bottom > box.bottom + 1)
        problems.push(name + ' outside the slide: ' + [r.left, r.top, r.right, r.bottom].map(Math.round));
      if (el.scrollWidth > el.clientWidth + 1 && el.clientWidth > 0 && getComputedStyle(el).overflowX !== 'visible')
        problems.push(name + ' clips its content horizontally');
      if (el.scrollHeight > el.clientHeight + 1 && el.clientHeight > 0 && getComputedStyle(el).overflowY !== 'visible')
        problems.push(name + ' clips its content vertically');
      if (el.childNodes.length && Array.from(el.childNodes).some((n) => n.nodeType === 3 && n.textContent.trim()))
        minFont = Math.min(minFont, parseFloat(getComputedStyle(el).fontSize));
    });
    const images = Array.from(slide.querySelectorAll('img')).map((img) => {
      const r = img.getBoundingClientRect();
      // object-fit: contain draws the picture as large as the box allows at its own aspect ratio
      const s = Math.min(r.width / img.naturalWidth, r.height / img.naturalHeight);
      const drawn = img.naturalWidth * img.naturalHeight * s * s;
      return {loaded: img.complete && img.naturalWidth > 0, share: drawn / (box.width * box.height)};
    });
    const prose = slide.cloneNode(true);
    prose.querySelectorAll('pre, table, svg, .notes').forEach((el) => el.remove());
    const notes = slide.querySelector('.notes');
    out.slides.push({problems, images, minFont, text: slide.innerText.trim().length,
                     words: prose.textContent.split(/\\s+/).filter((w) => /\\w/.test(w)).length,
                     notes: notes ? notes.textContent.trim().length : 0});
  });
  key('n');  // the speaker notes open under the slide, showing the active slide's notes
  const panel = document.getElementById('notes');
  out.notesPanel = {shown: getComputedStyle(panel).display !== 'none', text: panel.textContent.trim().length,
                    expected: slides[slides.length - 1].querySelector('.notes')?.textContent.trim().length || 0};
  const pre = document.createElement('pre');
  pre.id = 'probe-result';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>
"""


def find_chromium() -> str | None:
    """A Chrome/Chromium binary: MINILLM_CHROMIUM, else the usual names on PATH."""
    if os.environ.get("MINILLM_CHROMIUM"):
        return os.environ["MINILLM_CHROMIUM"]
    names = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
    return next((path for name in names if (path := shutil.which(name))), None)


@pytest.fixture(scope="module")
def chromium(tmp_path_factory) -> tuple[str, int]:
    """The browser, and the window height that gives a 1280 × 720 viewport (headless Chromium's window
    includes bars whose height depends on the version and the flags: measured once, here)."""
    path = find_chromium()
    if path is None:
        message = ("no Chromium found: the decks are not checked in a browser (Debian: `apt-get install chromium`, "
                   "as .ci/run does; or set MINILLM_CHROMIUM=/path/to/chrome)")
        if os.environ.get("MINILLM_REQUIRE_BROWSER"):
            pytest.fail(message)
        pytest.skip(message)
    folder = tmp_path_factory.mktemp("calibrate")
    page = folder / "viewport.html"
    page.write_text("<!DOCTYPE html><html><body><script>addEventListener('load', () => {"
                    "const p = document.createElement('pre'); p.id = 'probe-result';"
                    "p.textContent = JSON.stringify([innerWidth, innerHeight]); document.body.appendChild(p);"
                    "});</script></body></html>")
    _, inner = run_probe(path, HEIGHT, page, folder)
    return path, 2 * HEIGHT - inner


def run_probe(chromium: str, window_height: int, page: Path, tmp_path: Path):
    """Open ``page`` in headless Chromium and return what its probe wrote (JSON) into the DOM."""
    command = [chromium, "--headless", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
               "--no-sandbox",  # CI runs as root in a container, where Chromium's sandbox cannot start
               "--force-device-scale-factor=1", f"--window-size={WIDTH},{window_height}",
               f"--user-data-dir={tmp_path / 'profile'}",  # its own profile: parallel workers must not share one
               "--virtual-time-budget=5000", "--dump-dom", page.as_uri()]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="probe-result">(.*?)</pre>', result.stdout, re.S)
    assert found, f"the probe wrote nothing (exit {result.returncode}): {result.stderr[-2000:]}"
    return json.loads(html.unescape(found[1]))


def probe(chromium: tuple[str, int], deck: Path, tmp_path: Path) -> dict:
    """Render ``deck`` in headless Chromium at 1280 × 720 and return the probe's measurements."""
    page = tmp_path / deck.name
    page.write_text(deck.read_text().replace("</body>", PROBE + "</body>"))
    return run_probe(*chromium, page, tmp_path)


def test_there_are_decks_to_check():
    assert DECKS, "slides/ holds no decks: run `python course/slides.py`"


@pytest.mark.parametrize("deck", DECKS, ids=[d.stem for d in DECKS])
def test_every_slide_renders_inside_the_slide_with_its_figures_loaded(chromium, deck, tmp_path):
    result = probe(chromium, deck, tmp_path)
    assert result["viewport"] == [WIDTH, HEIGHT], "Chromium did not open the requested window size"
    assert len(result["slides"]) == deck.read_text().count('<section class="slide'), "not every slide was visited"
    failures = []
    for k, slide in enumerate(result["slides"], start=1):
        where = f"{deck.name}#{k}"
        failures += [f"{where}: {p}" for p in slide["problems"]]
        if not slide["text"] and not slide["images"]:
            failures.append(f"{where}: renders empty")
        if slide["words"] > MAX_WORDS:
            failures.append(f"{where}: {slide['words']} words of prose (at most {MAX_WORDS})")
        if slide["text"] and slide["minFont"] < MIN_FONT_PX:
            failures.append(f"{where}: text at {slide['minFont']} px")
        for image in slide["images"]:
            if not image["loaded"]:
                failures.append(f"{where}: an image did not load")
            elif image["share"] < MIN_FIGURE_SHARE:
                failures.append(f"{where}: a figure covers only {image['share']:.0%} of the slide")
    assert not failures, "\n".join(failures)
    assert any(s["images"] for s in result["slides"]), f"{deck.name} shows none of its notebook's figures"
    assert any(s["notes"] for s in result["slides"]), f"{deck.name} has no speaker notes"
    panel = result["notesPanel"]
    assert panel["shown"] and panel["text"] >= panel["expected"], f"'n' did not show the notes: {panel}"


def test_the_probe_reports_an_overflowing_slide(chromium, tmp_path):
    """The check can fail: a slide holding a 2000-px-tall block is reported, a plain slide is not, and 12-px text
    in an SVG diagram is measured at 12 px."""
    deck = tmp_path / "deck" / "00_overflow.html"
    deck.parent.mkdir()
    template = DECKS[0].read_text()
    head, rest = template.split('<div id="stage">', 1)
    tail = rest[rest.index('<div id="notes">') - len("</div>\n"):]
    deck.write_text(head + '<div id="stage">\n<section class="slide text" id="s1"><h2>Fine</h2><div class="body">'
                    '<p>Short.</p></div></section>\n<section class="slide text" id="s2"><h2>Too tall</h2>'
                    '<div class="body"><div style="height: 2000px; flex: none">x</div></div></section>\n'
                    '<section class="slide text" id="s3"><h2>Small</h2><div class="body"><svg width="400" '
                    'height="100"><text x="0" y="50" font-size="12">tiny</text></svg></div></section>\n' + tail)
    fine, tall, small = probe(chromium, deck, tmp_path)["slides"]
    assert fine["problems"] == [] and fine["minFont"] >= MIN_FONT_PX
    assert any("outside the slide" in p for p in tall["problems"])
    assert small["minFont"] == 12, "text inside a diagram is measured like any other"
