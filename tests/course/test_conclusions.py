"""Generated conclusions: ``conclude`` prints the branch its numbers bear out, and every ▸ line stored in an
executed solution notebook agrees with the numbers printed in it (no sentence contradicts its own values)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from minillm.course.conclusions import MARK, conclude, parse_conclusion

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value, reference, expect, holds", [
    (1.75, 1.0, ">", True), (0.49, 1.0, ">", False), (0.8, 1.0, "<", True), (1.2, 1.0, "<", False),
    (2.71, 3.75, "≈", False), (3.6, 3.75, "≈", True), (1.0, 1.0, ">", False),
])
def test_conclude_prints_the_branch_the_numbers_bear_out(value, reference, expect, holds, capsys):
    c = conclude("x ÷ y", value, reference, expect=expect, held="HELD", missed="MISSED", unit="×")
    out = capsys.readouterr().out.strip()
    assert bool(c) is holds and out == c.line
    assert out.startswith(MARK) and (("HELD" in out) is holds) and (("MISSED" in out) is not holds)
    parsed = parse_conclusion(out)
    assert parsed is not None and parsed.holds is holds
    assert (parsed.value, parsed.reference, parsed.expect) == (c.value, c.reference, expect)


def test_the_verdict_is_taken_on_the_printed_numbers():
    # 1.0004 prints as 1 with three digits: "1 vs 1, expected >" must not claim it holds
    c = conclude("a", 1.0004, 1.0, expect=">", held="h", missed="m", show=False)
    assert not c.holds and "1 vs 1" in c.line


@pytest.mark.parametrize("kwargs", [{"expect": "="}, {"unit": "tok / s"}, {"value": float("nan")}])
def test_conclude_rejects_bad_arguments(kwargs):
    args = {"value": 1.0, "expect": ">", "unit": ""} | kwargs
    with pytest.raises(ValueError):
        conclude("a", args["value"], 1.0, expect=args["expect"], held="h", missed="m", unit=args["unit"], show=False)


def _stored_lines(nb_path: Path) -> list[str]:
    nb = nbformat.read(nb_path, as_version=4)
    return [ln for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "stream"
            for ln in o.get("text", "").splitlines() if ln.startswith(MARK)]


SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_no_stored_conclusion_contradicts_its_numbers(path):
    for line in _stored_lines(path):
        c = parse_conclusion(line)
        assert c is not None, f"{path.name}: a ▸ line that is not a generated conclusion: {line!r}"
        again = conclude(c.claim, c.value, c.reference, expect=c.expect, tolerance=c.tolerance, held="", missed="",
                         show=False)
        assert again.holds is c.holds, f"{path.name}: {line!r} states the opposite of its own numbers"


def test_the_notebooks_that_state_measured_relations_generate_them():
    sources = {p.stem: p.read_text() for p in (ROOT / "course").glob("[0-9][0-9]_*.py")}
    for name in ("06_batching", "07_quantization", "08_speculative_decoding", "09_serving", "10_scaling_out"):
        assert "conclude(" in sources[name], f"{name} states measured relations without generating them"


def test_a_cell_ending_in_conclude_shows_the_line_once():
    """IPython shows a cell's last value; a Conclusion must not print its record under the line already printed."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    shell = InteractiveShell.instance()
    with capture_output() as out:
        shell.run_cell("from minillm.course.conclusions import conclude\n"
                       "conclude('x ÷ y', 2.0, 1, expect='>', held='x wins', missed='y wins')")
    assert out.stdout.count("x wins") == 1, out.stdout
    assert "Conclusion(" not in out.stdout and not out.outputs, (out.stdout, out.outputs)
