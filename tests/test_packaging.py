"""The two install paths (pip extras and conda's environment.yml) list the same packages; the README's commands
are what CI runs."""

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!;\[ ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_lists_exactly_the_pyproject_packages():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"]}
    for extra in ("dev", "course"):
        wanted |= {_name(r) for r in project["optional-dependencies"][extra]}
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = lines.index("  - pip:")
    pip_reqs = [ln.strip()[2:] for ln in lines[start + 1 :] if ln.strip().startswith("- ")]
    listed = {_name(r) for r in pip_reqs if not r.startswith("-e")}
    assert listed == wanted, f"only in environment.yml: {listed - wanted}; only in pyproject: {wanted - listed}"


def test_environment_yml_versions_match_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in ("dev", "course"):
        reqs += project["optional-dependencies"][extra]
    text = (ROOT / "environment.yml").read_text()
    for r in reqs:
        assert f"- {r}" in text, f"environment.yml lacks the exact requirement {r!r}"


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
