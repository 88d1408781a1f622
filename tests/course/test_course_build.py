"""The course stays in one piece: generated notebooks are up to date, student notebooks fail only on unfinished
exercises, solutions are clean, slides build offline.

Executing the student notebooks takes ~1 minute each on a 2-core CPU; they run with MINILLM_COURSE_FAST=1, which
the notebooks read to shrink their sizes (same cells, same code paths). The solutions are executed by nbval in
CI (see course/INSTRUCTORS.md):
    pytest --nbval-lax --nbval-current-env --nbval-sanitize-with course/nbval_sanitize.cfg solutions/
"""

from __future__ import annotations

import base64
import copy
import html
import importlib.util
import re
import struct
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from minillm.course.checks import EXERCISES

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def _load(name: str):
    """course/<name>.py as module ``course_<name>`` (registered first: dataclasses look their module up)."""
    key = f"course_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "course" / f"{name}.py")
        sys.modules[key] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[key]


build, slides = _load("build"), _load("slides")
sys.path.insert(0, str(ROOT / "course"))  # grade.py imports build as a sibling
grade = _load("grade")
SOURCES = build.sources()
NAMES = [p.stem for p in SOURCES]
STUB_ERROR = re.compile(r"^Exercise (\d+\.\d+): ")


def test_there_are_notebook_sources():
    assert {"01_prefill_decode", "02_kv_cache"} <= set(NAMES)


def test_generated_notebooks_are_up_to_date():
    """`course/build.py --check`: run `python course/build.py` after editing a source or a fenced function."""
    result = subprocess.run([PYTHON, "course/build.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_change_to_the_colab_cells_alone_keeps_the_stored_outputs():
    """The install source is an instructor's setting: changing it must not force forty minutes of re-execution,
    since the Colab cells do nothing outside Colab; any other changed cell still does."""
    new = build.render(SOURCES[0]).solution
    old = copy.deepcopy(new)
    for i, cell in enumerate(old.cells):
        if cell.cell_type == "code":
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"cell {i}\n")]
        if "colab-install" in cell.metadata.get("tags", []):
            cell.source = cell.source.replace("pip", "pip3")  # an older install source
    kept = build.with_stored_outputs(new, old)
    assert kept is not None and build.cell_sources(kept) == build.cell_sources(new)
    outputs = [(c.source, c.outputs) for c in kept.cells if c.cell_type == "code" and "colab-install" not in
               c.metadata.get("tags", [])]
    assert outputs and all(out and out[0].text.startswith("cell ") for _, out in outputs)
    code = next(c for c in old.cells if c.cell_type == "code" and "colab-install" not in c.metadata.get("tags", []))
    code.source += "\nprint('changed')"
    assert build.with_stored_outputs(new, old) is None


def _with_outputs(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of ``nb`` whose code cells each hold one output naming their index."""
    nb = copy.deepcopy(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"cell {i}\n")]
    return nb


def test_a_markdown_edit_keeps_the_stored_outputs_and_a_code_edit_needs_keep_code():
    """A markdown cell runs nothing, so rewording one never needs a re-execution; a code cell's edit does, unless the
    instructor says it changes no output (``--keep-outputs``): then each stored output stays with its cell."""
    new = build.render(SOURCES[0]).solution
    old = _with_outputs(new)
    markdown = next(i for i, c in enumerate(old.cells) if c.cell_type == "markdown")
    code = next(i for i, c in enumerate(old.cells) if c.cell_type == "code" and build._runs_outside_colab(c))
    old.cells[markdown].source = "an older wording\n" + old.cells[markdown].source
    kept = build.with_stored_outputs(new, old)
    assert kept is not None and build.cell_sources(kept) == build.cell_sources(new)
    assert kept.cells[code].outputs[0].text == f"cell {code}\n"
    old.cells[code].source = "import os  # an import the lint fix removed\n" + old.cells[code].source
    assert build.with_stored_outputs(new, old) is None
    kept = build.with_stored_outputs(new, old, keep_code=True)
    assert kept is not None and build.cell_sources(kept) == build.cell_sources(new)
    ran = [i for i, c in enumerate(old.cells) if c.cell_type == "code" and build._runs_outside_colab(c)]
    assert [kept.cells[i].outputs for i in ran] == [old.cells[i].outputs for i in ran]


def test_keep_outputs_refuses_cells_added_removed_or_retyped():
    """Outputs are kept cell by cell, so only the same kinds of cells in the same order can carry them over."""
    new = build.render(SOURCES[0]).solution
    old = _with_outputs(new)
    assert build.with_stored_outputs(new, old, keep_code=True) is not None
    old.cells.append(nbformat.v4.new_code_cell("print('a cell the source no longer has')"))
    assert build.with_stored_outputs(new, old, keep_code=True) is None
    old.cells.pop()
    code = next(i for i, c in enumerate(old.cells) if c.cell_type == "code" and build._runs_outside_colab(c))
    old.cells[code] = nbformat.v4.new_markdown_cell(old.cells[code].source)
    assert build.with_stored_outputs(new, old, keep_code=True) is None


def test_check_mode_names_a_stale_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(build, "ROOT", tmp_path)  # an empty checkout: every generated file is missing
    monkeypatch.setattr(build, "NOTEBOOKS", tmp_path / "notebooks")
    monkeypatch.setattr(build, "SOLUTIONS", tmp_path / "solutions")
    monkeypatch.setattr(build, "render", lambda path: build.Rendered(path.stem, *[nbformat.v4.new_notebook()] * 2))
    assert build.build(SOURCES[:1], check=True, force_execute=False) == 1
    assert f"notebooks/{NAMES[0]}.ipynb" in capsys.readouterr().err
    assert not (tmp_path / "notebooks").exists(), "--check must not write"


def test_every_registered_exercise_is_in_exactly_one_notebook():
    seen: dict[str, str] = {}
    for path in SOURCES:
        for number in build.exercises_in(build.render(path).student):
            assert number not in seen, f"exercise {number} in both {seen[number]} and {path.stem}"
            seen[number] = path.stem
            assert number.split(".")[0] == str(int(path.stem[:2])), f"exercise {number} lives in {path.stem}"
    assert sorted(seen) == sorted(EXERCISES)


@pytest.mark.parametrize("name", NAMES)
def test_student_notebook_shows_no_solution(name):
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    text = "\n".join(c.source for c in nb.cells)
    assert "### BEGIN SOLUTION" not in text and "NBVAL_CHECK_OUTPUT" not in text
    for number in build.exercises_in(nb):
        ex = EXERCISES[number]
        solution = build.render_exercise(ex, student=False).split("\n")
        lines = build.function_source(ex).split("\n")
        begin, end = build.split_fence(lines, ex.target)
        hidden = [ln.strip() for ln in lines[begin + 1 : end] if ln.strip() and not ln.strip().startswith("#")]
        assert hidden and all(h in "\n".join(solution) for h in hidden)
        assert not any(h in text for h in hidden if len(h) > 25), f"solution of {number} leaks into {name}"
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "student notebooks ship empty"
    assert "colab-install" in nb.cells[0].metadata.get("tags", [])  # no badge before the course is published


@pytest.mark.parametrize("name", NAMES)
def test_solution_notebook_is_executed_and_clean(name):
    nb = nbformat.read(ROOT / "solutions" / f"{name}.ipynb", as_version=4)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{name}: stored errors {[(e.ename, e.evalue) for e in errors]}"
    for cell in nb.cells:
        for number in cell.metadata.get("minillm", {}).get("checks", []):
            text = "".join(o.get("text", "") for o in cell.outputs)
            assert f"✓ Exercise {number} passed" in text, f"{name}: check of {number} did not pass"
    assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def _png_header(data: bytes) -> tuple[int, int, float | None]:
    """(width px, height px, dots per inch or None) from a PNG's IHDR and pHYs chunks (matplotlib writes both)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    at = data.find(b"pHYs")
    if at < 0:
        return width, height, None
    per_x, _, unit = struct.unpack(">IIB", data[at + 4 : at + 13])
    return width, height, per_x * 0.0254 if unit == 1 else None  # unit 1: pixels per metre


@pytest.mark.parametrize("name", NAMES)
def test_solution_figures_are_stored_at_110_dpi_or_more(name):
    """Readable at a glance: every stored figure at ≥ 110 dpi (``plt.rcParams["figure.dpi"]`` in the source's
    setup cell; the inline backend saves at the figure's dpi) and at least 400 × 200 pixels."""
    nb = nbformat.read(ROOT / "solutions" / f"{name}.ipynb", as_version=4)
    pngs = [o["data"]["image/png"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "image/png" in o.get("data", {})]
    for i, data in enumerate(pngs):
        width, height, dpi = _png_header(base64.b64decode(data))
        assert dpi is not None and round(dpi) >= 110, f"{name} figure {i + 1}: {dpi} dpi, expected ≥ 110"
        assert width >= 400 and height >= 200, f"{name} figure {i + 1}: {width} × {height} px is too small to read"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_student_notebook_fails_only_on_unfinished_exercises(name):
    """Executed as a student receives it: every check cell fails with its own exercise's NotImplementedError,
    and no cell fails with anything else (a NameError here would mean a cell depends on a stub's result)."""
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    # One thread: on a shared CI runner two OpenMP threads fighting other jobs can run 5× slower than one.
    ran = build.execute(nb, cwd=ROOT / "notebooks", fast=True, allow_errors=True, timeout=600,
                        extra_env={"OMP_NUM_THREADS": "1"})
    mine = set(build.exercises_in(nb))
    checked = set()
    for i, cell in enumerate(ran.cells):
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.outputs if o.output_type == "error"]
        where = f"{name} cell {i}: {cell.source.splitlines()[0] if cell.source else ''!r}"
        for e in errors:
            ename, evalue = e.ename, e.evalue
            inner = re.match(r"NotImplementedError\('(.*)", evalue, re.S)
            if ename == "InterpreterError" and inner:  # Triton's interpreter wraps what a kernel raised
                ename, evalue = "NotImplementedError", inner[1]
            m = STUB_ERROR.match(evalue)
            assert ename == "NotImplementedError" and m and m[1] in mine, f"{where} failed with {ename}: {evalue}"
        meta = cell.metadata.get("minillm", {})
        if "exercise" in meta:
            assert not errors, f"{where}: defining the stub must not fail"
        for number in meta.get("checks", []):
            assert errors and any(f"Exercise {number}: " in e.evalue.split("\n")[0][:40] for e in errors), \
                f"{where}: the check of exercise {number} did not fail on the stub"
            checked.add(number)
    assert checked == mine, f"{name}: exercises without a failing check cell: {mine - checked}"


def test_slides_build_offline_with_headings_figures_and_notes(tmp_path):
    """Every heading titles a slide, every figure is shown, every paragraph is in the speaker notes; offline."""
    assert slides.build([], check=False, out_dir=tmp_path) == 0
    for name in NAMES:
        deck = (tmp_path / f"{name}.html").read_text()
        nb = nbformat.read(ROOT / "solutions" / f"{name}.ipynb", as_version=4)
        shown = [c for c in nb.cells if not {"slide-skip", "colab-badge"} & set(c.metadata.get("tags", []))]
        headings = [m[2] for c in shown if c.cell_type == "markdown" for ln in c.source.splitlines()
                    if (m := slides.HEADING.match(ln))]
        assert headings
        for heading in headings:  # each heading as a slide title, or as the label of a section folded into one
            title = re.escape(slides.inline(heading))
            assert re.search(f"<h[12]>{title}</h[12]>|<strong>{title}:</strong>", deck), heading
        for block in (b for c in shown if c.cell_type == "markdown" for b in slides.parse_blocks(c.source)):
            if block.kind == "para":
                assert slides._markdown(block.text) in deck, f"{name}: paragraph missing from the notes: {block.text}"
        pngs = [o["data"]["image/png"].strip() for c in shown if c.cell_type == "code"
                for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
        assert pngs and all(f"base64,{png}" in deck for png in pngs), f"{name}: a figure is missing"
        assert '<aside class="notes">' in deck
        assert not re.search(r'<(script|link|img)[^>]+(src|href)="(https?:)?//', deck), "decks must be offline"


def _visible_words(slide) -> int:
    """Prose words on a slide (title and body; outputs, tables and diagrams not counted), as a reader sees them."""
    body = re.sub(r"<pre.*?</pre>|<table.*?</table>|<svg.*?</svg>", "", "".join(slide.body), flags=re.S)
    shown = html.unescape(re.sub(r"<[^>]+>", " ", body))  # "&quot;" is one character, not a word
    return slides.words(slide.title) + sum(1 for w in shown.split() if re.search(r"\w", w))


@pytest.mark.parametrize("name", NAMES)
def test_every_slide_shows_at_most_sixty_words_of_prose(name):
    nb = nbformat.read(ROOT / "solutions" / f"{name}.ipynb", as_version=4)
    for k, slide in enumerate(slides.build_slides(nb), start=1):
        assert _visible_words(slide) <= slides.MAX_WORDS, f"{name} slide {k}: {_visible_words(slide)} words"


def test_deck_rule_leads_on_the_slide_rest_in_notes_tags_respected():
    long_para = "Batching is the main lever on throughput here. " + "Every further sentence goes to the notes. " * 6
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# 99 — Title\n\nThe subtitle states the deck's one idea. More detail here."),
        nbformat.v4.new_markdown_cell("## 1. Section\n\n" + long_para + "\n\n- **One**: first point. Detail.\n"
                                      "- **Two**: second point; with a clause\n  that continues."),
        nbformat.v4.new_markdown_cell("### Evidence\n\nThe output below supports the claim."),
        nbformat.v4.new_code_cell("print(1)", metadata={"tags": ["slide-output"]}),
        nbformat.v4.new_code_cell("secret()", metadata={"tags": ["slide-skip", "slide"]}),
        nbformat.v4.new_code_cell("print('\\n'.join(map(str, range(200))))", metadata={"tags": ["slide-output"]}),
    ])
    nb.cells[3].outputs = [nbformat.v4.new_output("stream", name="stdout", text="shown output\n")]
    nb.cells[4].outputs = [nbformat.v4.new_output("stream", name="stdout", text="skipped output\n")]
    nb.cells[5].outputs = [nbformat.v4.new_output("stream", name="stdout", text="\n".join(map(str, range(200))))]
    deck = slides.build_slides(nb)
    title, section, *rest = deck
    assert title.kind == "title" and title.body == ["<p>The subtitle states the deck's one idea.</p>"]
    assert "More detail here." in "".join(title.notes)
    assert section.title == "1. Section" and "Batching is the main lever on throughput here." in section.body[0]
    assert "Every further sentence" not in section.body[0] and "Every further sentence" in "".join(section.notes)
    assert "<strong>Two</strong>: second point; with a clause that continues." in section.body[0]
    assert "shown output" in rest[0].body[0] and rest[0].title == "Evidence", "evidence titled by its section"
    assert '<p class="caption">The output below supports the claim.</p>' in rest[0].body[0], "the claim captions it"
    assert not any("secret" in "".join(s.body) or "skipped output" in "".join(s.body) for s in deck)
    long_output = [s for s in rest if "199" in "".join(s.body) or "\n0\n" in "".join(s.body)]
    assert len(rest) > 2, "200 lines of output were not split over slides"
    assert all(int(re.search(r"font-size: (\d+)px", s.body[0])[1]) >= slides.MIN_FONT_PX for s in rest)
    assert long_output


def test_a_lead_is_one_sentence_without_asides_and_keeps_formulas():
    long = ("A machine rented by the hour (an aside that goes) that produces tokens every second costs "
            "$/h ÷ (tok/s × 3600) × 10⁶ per million tokens, which is the number the finance people ask for. Next.")
    assert slides.lead(long).startswith("A machine rented by the hour that produces")
    assert "(tok/s × 3600)" in slides.lead(long) and "Next" not in slides.lead(long)
    assert slides.words(slides.lead(long)) <= slides.MAX_LEAD_WORDS
    assert slides.lead("Two rules. The first one says this. The third is too much for one lead, far too much "
                       "to fit.") == "Two rules. The first one says this."
    assert slides.lead("See e.g. `x.y` and **bold: cut** here. Then more.") == "See e.g. `x.y` and **bold: cut** here."


def test_committed_slides_are_up_to_date():
    """`python course/slides.py --check`: rebuild the decks after re-executing the solutions."""
    result = subprocess.run([PYTHON, "course/slides.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_grader_classifies_passed_unfinished_and_wrong():
    def check_cell(number, *outputs):
        cell = nbformat.v4.new_code_cell("checks.check_something(f)", metadata={"minillm": {"checks": [number]}})
        cell.outputs = list(outputs)
        return cell

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        check_cell("1.1", nbformat.v4.new_output("stream", name="stdout", text="✓ Exercise 1.1 passed: x\n")),
        check_cell("1.2", nbformat.v4.new_output("error", ename="NotImplementedError", evalue="Exercise 1.2: t — h",
                                                 traceback=[])),
        check_cell("1.3", nbformat.v4.new_output("error", ename="AssertionError", evalue="goodput(...) returned 2",
                                                 traceback=[])),
        nbformat.v4.new_code_cell("checks.check_apply_rope(apply_rope)"),  # no metadata
    ]
    assert grade.judge(nb) == {"1.1": ("passed", ""), "1.2": ("unfinished", ""),
                               "1.3": ("wrong", "AssertionError: goodput(...) returned 2"),
                               "1.4": ("wrong", "the check printed no pass message")}

