"""The documentation site: its API reference names every public name, and every page is in the navigation.
(`mkdocs build --strict`, run by .ci/run, checks links, anchors and docstrings.)"""

import re
from pathlib import Path

import pytest
import yaml

import hf_speculators

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DIRECTIVE = re.compile(r"^::: hf_speculators\.(\w+)\s*$", re.MULTILINE)


def _nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    return [page for value in nav.values() for page in _nav_pages(value)]


def test_api_reference_names_exactly_the_public_api():
    documented = [name for page in sorted((DOCS / "api").glob("*.md")) for name in DIRECTIVE.findall(page.read_text())]
    assert len(documented) == len(set(documented)), "a name is documented twice"
    missing, extra = set(hf_speculators.__all__) - set(documented), set(documented) - set(hf_speculators.__all__)
    assert not missing, f"add `::: hf_speculators.NAME` to docs/api/index.md for {sorted(missing)}"
    assert not extra, f"docs/api names what hf_speculators.__all__ does not: {sorted(extra)}"


def test_every_page_is_in_the_navigation():
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages, f"mkdocs.yml nav: missing {sorted(set(pages) - set(nav))}, " \
                                 f"not found {sorted(set(nav) - set(pages))}"


@pytest.mark.parametrize("name", ["README.md", "CHANGELOG.md"])
def test_links_point_at_files_of_the_repository(name):
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / name).read_text())
    local = [link for link in links if "://" not in link]
    assert local, f"{name} links to the documentation"
    assert [link for link in local if not (ROOT / link).exists()] == []


@pytest.mark.parametrize("page", ["README.md", "docs/guides/python.md"])
def test_stats_tables_name_fields_that_exist(page):
    """Every `name` in the first column of the `| field | meaning |` table is an attribute of SpeculativeStats."""
    lines = (ROOT / page).read_text().splitlines()
    start = lines.index("| field | meaning |")
    rows = [line for line in lines[start + 2:] if line.startswith("|")]
    rows = rows[:next((i for i, line in enumerate(lines[start + 2:]) if not line.startswith("|")), len(rows))]
    fields = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert "mean_acceptance_length" in fields, f"{page}: the speculative_stats table"
    stats = hf_speculators.SpeculativeStats()
    assert sorted(name for name in fields if not hasattr(stats, name)) == []
