"""course/slides.py's layout rules on small made-up notebooks: what a slide keeps, drops, splits and folds."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]


def _load_slides():
    if "course_slides" not in sys.modules:  # the name test_course_build.py registers it under: one module
        spec = importlib.util.spec_from_file_location("course_slides", ROOT / "course" / "slides.py")
        sys.modules["course_slides"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["course_slides"]


slides = _load_slides()


def _font(page: str) -> int:
    return int(re.search(r"font-size: (\d+)px", page)[1])


def _shown(page: str) -> str:
    return re.sub(r"<[^>]+>", "", page).replace("&quot;", '"').replace("&#x27;", "'")


def test_output_drops_logger_lines_and_cache_paths_and_stays_at_18_px():
    text = ("USDT:2026-11-26 23:48:02 15123:15123 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
            "roof: 17.2 GB/s (cached in /root/.cache/minillm/roofline/cpu.json); remeasure with --remeasure\n"
            "scheme   MB/token\nfp32        538.1\nint8        135.4\n")
    [(page, _)] = slides.text_pages(text, "output")
    assert "profiler_start" not in page and "/root/" not in page and "remeasure with" in page
    assert _font(page) >= slides.MIN_FONT_PX


def test_aligned_columns_narrow_without_losing_alignment():
    block = ["name          a        b", "first         1.0      22.5", "second       10.0       3.25"]
    narrow = slides.compact_columns(block)
    assert narrow == ["name     a    b", "first    1.0  22.5", "second  10.0   3.25"]  # every offset as it was
    assert slides.compact_columns(["lone   line   with gaps"]) == ["lone line with gaps"]


def test_a_table_too_wide_for_18_px_is_shown_in_column_groups_with_its_row_labels():
    header = "row    " + "  ".join(f"column{c:02d}" for c in range(12))
    rows = [header] + [f"r{r}     " + "  ".join(f"{r * c:8d}" for c in range(12)) for r in range(4)]
    width = int(slides.PRE_W / (slides.MONO_EM * slides.MIN_FONT_PX))
    assert len(header) > width
    split = slides.split_columns(rows, width)
    groups = "\n".join(split).split("\n\n")
    assert len(groups) >= 2 and all(len(ln) <= width for ln in split)
    assert all(g.splitlines()[0].startswith("row") and g.splitlines()[2].startswith("r1") for g in groups)
    assert sum(g.count("column") for g in groups) == 12, "every column is shown once"
    pages = slides.text_pages("\n".join(rows), "output")
    assert all(_font(p) >= slides.MIN_FONT_PX for p, _ in pages)


def test_a_long_table_is_split_over_slides_with_its_header_repeated():
    text = "\n".join(["step   tokens   ms"] + [f"{k:4d}   {k * 3:6d}   {k / 7:5.2f}" for k in range(80)])
    pages = slides.text_pages(text, "output")
    assert len(pages) >= 3
    assert all(_shown(p).lstrip().startswith("step") for p, _ in pages)
    shown = [ln for p, _ in pages for ln in _shown(p).splitlines() if not ln.startswith("step")]
    assert len(shown) == 80


def test_a_long_prose_line_wraps_on_the_slide_and_is_whole_in_the_notes():
    line = "▸ " + "a verdict that goes on " * 40
    [(page, notes)] = slides.text_pages(line, "output")
    assert _font(page) >= slides.MIN_FONT_PX and page.count("…") == 1 and len(_shown(page)) < len(line)
    assert line.strip() in _shown(notes)


def test_a_feature_table_too_big_for_a_slide_shows_its_marks_and_keeps_the_text_in_the_notes():
    columns = " | ".join(f"feature {c}" for c in range(8))
    rows = [f"| engine | {columns} |", "|" + "---|" * 9]
    rows += [f"| **engine {r}** | " + " | ".join(f"✓ a long note on how engine {r} does it" for _ in range(8)) + " |"
             for r in range(6)]
    pages = slides.table_pages("\n".join(rows))
    body = "".join(p for p, _ in pages)
    assert "long note" not in body and body.count("<td>✓</td>") == 48
    assert "long note" in pages[0][1], "the full table is in the notes"
    assert all(_font(p) >= slides.MIN_FONT_PX for p, _ in pages)


def test_a_one_sentence_exercise_section_folds_into_the_slide_before():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# 99 — Title\n\nThe deck's claim."),
        nbformat.v4.new_markdown_cell("## 1. Build\n\nA cache holds the keys and values of every earlier token."),
        nbformat.v4.new_markdown_cell("### Exercise 9.1 — `update`\n\nWrite `update(k, v)`."),
        nbformat.v4.new_markdown_cell("## 2. Next\n\nSomething else entirely, said at length on its own slide."),
    ])
    deck = slides.build_slides(nb)
    build = next(s for s in deck if s.title == "1. Build")
    assert "<strong>Exercise 9.1 — <code>update</code>:</strong> Write <code>update(k, v)</code>." in build.body[0]
    assert not any(s.title.startswith("Exercise") for s in deck)
    assert "Write <code>update(k, v)</code>." in "".join(build.notes)


def test_a_lead_keeps_what_its_colon_introduces():
    text = ("**Published anchors.** gpt-fast, Llama-2-7B batch 1 on an A100: bf16 105 tok/s, int8 156, int4 197 — "
            "int4 has 4× fewer bytes than bf16 but is not 4× faster, which the notebook explains at length later.")
    assert slides.lead(text) == ("**Published anchors.** gpt-fast, Llama-2-7B batch 1 on an A100: bf16 105 tok/s, "
                                 "int8 156, int4 197.")


def _load_diagrams():
    import diagrams  # course/ is on sys.path once slides.py is loaded (it imports its sibling the same way)

    return diagrams


def test_each_component_deck_has_its_diagram_drawn_at_readable_sizes_and_offline():
    diagrams = _load_diagrams()
    assert set(diagrams.DIAGRAMS) == {"05", "06", "08", "10"}
    for number, (_heading, draw) in diagrams.DIAGRAMS.items():
        caption, notes, svg = draw()
        assert caption and notes.startswith("<p>") and svg.startswith("<svg")
        sizes = [int(s) for s in re.findall(r'font-size="(\d+)"', svg)]
        assert sizes and min(sizes) >= slides.MIN_FONT_PX, f"{number}: text under {slides.MIN_FONT_PX} px"
        assert not re.search(r'(?:src|href)="(?!#)', svg), f"{number}: the diagram refers to something outside"
        assert re.search(r'width="(\d+)"', svg)[1] == str(slides.TEXT_W), "drawn at the size the slide shows it"
        deck = (ROOT / "slides").glob(f"{number}_*.html")
        assert svg in next(deck).read_text(), f"{number}: the committed deck lacks its diagram (rebuild the slides)"


def test_the_batching_diagram_shows_the_slot_models_schedule():
    from minillm.course.slot_model import slot_timeline

    caption, _, svg = _load_diagrams().batching_timeline()
    lengths = [3, 8, 4, 6, 5, 2, 4, 3]
    static, continuous = len(slot_timeline(lengths, 4, "static")), len(slot_timeline(lengths, 4, "continuous"))
    assert f"{continuous} steps instead of {static}" in caption
    assert svg.count(">R2<") == 2 * 8 and svg.count(">R1<") == 2 * 3, "each request fills its length in both panels"


def test_the_speculative_diagram_rejects_where_u_exceeds_p_over_q_and_drops_the_rest():
    _, _, svg = _load_diagrams().speculative_verification()
    verdicts = re.findall(r">(✓ accept|✗ reject|dropped)<", svg)
    assert verdicts == ["✓ accept", "✓ accept", "✗ reject", "dropped"]
    assert "yields 3 tokens" in svg


def test_a_diagram_whose_section_is_gone_is_an_error_naming_the_heading():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 05 — Title\n\nClaim.")])
    try:
        slides.build_slides(nb, "05_paged_attention")
    except ValueError as error:
        assert "3. Build: growing a sequence" in str(error)
    else:
        raise AssertionError("a deck without its diagram's section built silently")


def test_a_claim_after_a_short_output_goes_under_it_and_after_a_long_one_gets_its_own_slide():
    def deck(lines: int):
        cell = nbformat.v4.new_code_cell("print()", metadata={"tags": ["slide-output"]})
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="\n".join(["row  1.0"] * lines))]
        nb = nbformat.v4.new_notebook(cells=[
            nbformat.v4.new_markdown_cell("# 99 — Title\n\nThe deck's claim."),
            nbformat.v4.new_markdown_cell("## 1. Measure\n\nThe table below times it."), cell,
            nbformat.v4.new_markdown_cell("The cache wins by a wide margin here."),
        ])
        return [s for s in slides.build_slides(nb) if s.title == "1. Measure"]

    [short] = deck(3)
    assert '<p class="caption takeaway">The cache wins by a wide margin here.</p>' in short.body[0]
    assert "The cache wins" in "".join(short.notes)
    outcomes = set()
    for lines in range(10, 60):  # the claim goes under the last slide of output only where it fits
        *evidence, last = deck(lines)
        if last.kind == "statement":
            outcomes.add("own slide")
            assert "takeaway" not in "".join(s.body[0] for s in evidence)
        else:
            outcomes.add("under")
            assert "takeaway" in last.body[0] and slides._used_height(last.body[0]) <= slides.TEXT_H
    assert outcomes == {"own slide", "under"}
