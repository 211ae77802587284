"""The documentation site: its API reference names every public name, and every page is in the navigation.
(`mkdocs build --strict`, run by .ci/run, checks links, anchors and docstrings.) Every `hf-speculators` command of
the pages, the bundled model cards and the README parses, and the files it reads exist.

A command is a line of a ``` block that starts with `hf-speculators` (its backslash continuations joined), or a
code span `` `hf-speculators ...` `` of four words or more (a shorter one names a command: `hf-speculators
generate`). A command holding a placeholder (a word in capitals, `K`, `MODEL`, `records/RUN.jsonl`; `...`; an
optional `[--flag]`) is a synopsis and is not parsed. A file it reads is in the repository, is a named prompt set
(`--prompts spec-bench`), a demo id or a Hub id, or is written by another command of its page (`--out`)."""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
import yaml

import hf_speculators
from hf_speculators.loading import looks_local, resolve_model_id
from hf_speculators.prompts import PROMPT_SETS
from hf_speculators.tools.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DIRECTIVE = re.compile(r"^::: hf_speculators\.(\w+)\s*$", re.MULTILINE)
PAGES = [*sorted(DOCS.rglob("*.md")), *sorted((ROOT / "model_cards").glob("*/README.md")), ROOT / "README.md"]
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
SPAN = re.compile(r"`(hf-speculators [^`]+)`")
PLACEHOLDER = re.compile(r"\.\.\.|^\[|(?:^|[/.=:,])[A-Z][A-Z0-9_]*(?:$|[/.=:,])")
# the parsed arguments that name files or folders a command reads (not those it writes: --out, --plot)
INPUTS = ("prompts", "model", "draft", "draft_vocab", "eagle_head", "medusa_head", "dflash_model", "gemma4_assistant",
          "preset", "records", "data", "init", "target", "folder")
FILE_SUFFIX = re.compile(r"\.(jsonl|json|txt|gz|safetensors)$")


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


def _block_commands(text: str) -> list[tuple[int, str]]:
    """`(line, command)` of every line of a ``` block that starts with `hf-speculators`, continuations joined."""
    commands = []
    for block in FENCE.finditer(text):
        first = text.count("\n", 0, block.start()) + 1
        lines = block.group().split("\n")
        for n, line in enumerate(lines):
            if line.lstrip().startswith("hf-speculators ") and not lines[n - 1].endswith("\\"):
                rest = iter(lines[n + 1:])
                while line.endswith("\\"):
                    line = line[:-1] + " " + next(rest, "")
                commands.append((first + n, line.strip()))
    return commands


def _span_commands(text: str) -> list[tuple[int, str]]:
    """`(line, command)` of every code span outside the ``` blocks that holds a command of four words or more."""
    prose = FENCE.sub(lambda block: "\n" * block.group().count("\n"), text)
    spans = [(prose.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())) for m in SPAN.finditer(prose)]
    return [(n, command) for n, command in spans if len(command.split()) >= 4]


def page_commands(text: str) -> list[tuple[int, list[str]]]:
    """`(line, words)` of every `hf-speculators` command of a Markdown text that is not a synopsis (module doc)."""
    commands = sorted(_block_commands(text) + _span_commands(text))
    parsed = [(n, shlex.split(command, comments=True)) for n, command in commands]
    return [(n, words) for n, words in parsed if not any(PLACEHOLDER.search(word) for word in words)]


def _missing_inputs(args, written: set[str]) -> list[str]:
    """The files and folders that the parsed command reads and that are neither in the repository nor `written` by
    a command of its page (named sets, Hub ids and demo ids resolved)."""
    values = [v for name in INPUTS for v in _as_list(getattr(args, name, None)) if isinstance(v, str)]
    values = [resolve_model_id(v) for v in values if v not in PROMPT_SETS.keys() | written]
    return [v for v in values if (looks_local(v) or FILE_SUFFIX.search(v)) and not _in_repository(ROOT / v)]


def _in_repository(path: Path) -> bool:
    """Whether `path` exists inside the repository (not beside it: `../shared/data/` is no user's)."""
    return path.exists() and path.resolve().is_relative_to(ROOT)


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def test_page_commands_are_found_and_synopses_skipped():
    text = ("`hf-speculators generate` and `hf-speculators bench --limit 3`\n```bash\nhf-speculators bench \\\n"
            "    --limit 2  # two\nhf-speculators bench --num-draft-tokens K\n"
            "hf-speculators export x [--out DIR]\n```\n")
    assert page_commands(text) == [(1, ["hf-speculators", "bench", "--limit", "3"]),
                                   (3, ["hf-speculators", "bench", "--limit", "2"])]


def test_a_file_beside_the_repository_is_missing():
    args = build_parser().parse_args(["bench", "--prompts", "../shared/data/spec_bench_question.jsonl"])
    assert _missing_inputs(args, written=set()) == ["../shared/data/spec_bench_question.jsonl"]
    args = build_parser().parse_args(["report", "bench_results/bench.jsonl"])
    assert _missing_inputs(args, written={"bench_results/bench.jsonl"}) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_command_of_the_page_parses_and_its_files_exist(page):
    """The argument parsing of `hf-speculators` only (nothing runs): a command a user copies from the page runs."""
    parser, parsed, failures = build_parser(), [], []
    for line, words in page_commands(page.read_text(encoding="utf-8")):
        where = f"{page.relative_to(ROOT)}:{line}: {shlex.join(words)}"
        with contextlib.redirect_stderr(io.StringIO()) as stderr:
            try:
                parsed.append((where, parser.parse_args(words[1:])))
            except SystemExit:
                failures.append(f"{where}\n    {stderr.getvalue().strip()}")
    written = {getattr(args, "out", None) for _, args in parsed} - {None}  # e.g. bench's records, read by report
    failures += [f"{where}\n    {path} is not in the repository" for where, args in parsed
                 for path in _missing_inputs(args, written)]
    assert not failures, "\n".join(failures)


def test_the_pages_hold_commands():
    assert sum(len(page_commands(page.read_text(encoding="utf-8"))) for page in PAGES) >= 50
