"""The README stays a ten-minute read and the rest lives in docs/, a mkdocs site whose every page is
in the navigation and whose API page covers every export (``mkdocs build --strict`` runs in CI)."""

from __future__ import annotations

import pathlib
import re

import pytest

import autoddp

pytestmark = pytest.mark.unit  # every test here starts no process

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MAX_README_LINES = 300


def _nav() -> list[str]:
    """The pages mkdocs.yml's ``nav:`` names, in order (read as text: no YAML parser needed)."""
    config = (ROOT / "mkdocs.yml").read_text()
    nav = config.partition("\nnav:\n")[2]
    assert nav, "mkdocs.yml has no nav"
    return re.findall(r"^\s+- (?:[^\n]*?: )?([\w./-]+\.md)\s*$", nav, flags=re.M)


def test_the_readme_is_at_most_300_lines_and_links_to_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= MAX_README_LINES
    assert "<!-- ci:test-command -->" in readme and "<!-- ci:demo-command -->" in readme
    linked = set(re.findall(r"\]\((docs/[\w./-]+\.md)\)", readme))
    missing = [p for p in linked if not (ROOT / p).exists()]
    assert missing == [], f"the README links to pages that do not exist: {missing}"
    pages = {f"docs/{p}" for p in _nav()}
    assert pages - linked <= {"docs/index.md"}, f"pages the README does not link: {pages - linked}"


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    nav = _nav()
    assert len(nav) == len(set(nav)), f"a page twice in the nav: {nav}"
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages


def test_the_site_is_material_with_api_pages_from_the_docstrings():
    config = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^theme:\n\s+name: material$", config, flags=re.M)
    assert "- mkdocstrings:" in config and "python:" in config
    api = (DOCS / "api.md").read_text()
    documented = set(re.findall(r"^::: autoddp\.(\w+)$", api, flags=re.M))
    assert set(autoddp.__all__) | {"print"} == documented


def test_the_docs_extra_installs_the_site_tools():
    config = (ROOT / "setup.cfg").read_text()
    extra = config.partition("\ndocs =\n")[2].partition("\n\n")[0]
    names = {line.strip().split(">")[0].split("=")[0] for line in extra.splitlines() if line.strip()}
    assert {"mkdocs", "mkdocs-material", "mkdocstrings[python]"} <= names


def test_the_readme_names_the_torch_releases_ci_tests_and_its_parallel_test_command():
    """The versions in .ci/run are the ones the README names; its test command is the one CI runs,
    on pytest-xdist's workers with the serial groups kept (``--dist loadgroup``)."""
    ci = (ROOT / ".ci" / "run").read_text()
    tested = dict(re.findall(r"^TORCH_(PINNED|FLOOR|NEWEST)=([\d.]+)", ci, flags=re.M))
    assert tested.keys() == {"PINNED", "FLOOR", "NEWEST"}
    readme = " ".join((ROOT / "README.md").read_text().split())
    pinned, floor, newest = tested["PINNED"], tested["FLOOR"], tested["NEWEST"]
    assert f"CI tests torch {pinned} (the whole suite), {floor} and {newest} (the smoke tests" in readme
    floor_spec = re.search(r"^\s+torch\s*>=\s*([\d.]+)", (ROOT / "setup.cfg").read_text(), flags=re.M)
    assert floor_spec and floor.startswith(floor_spec.group(1) + ".")
    command = readme.partition("<!-- ci:test-command -->")[2].partition("```bash ")[2].partition(" ```")[0]
    assert command.endswith("python -m pytest -q -n 3 --dist loadgroup"), command
