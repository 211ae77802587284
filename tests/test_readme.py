"""The README's examples run, on the bundled demo models, so that the front page cannot go stale.

Every ```bash and ```python block of README.md runs, except a block right after a `<!-- not-tested: REASON -->`
line (a package install, the test suite itself). Python blocks run in order in one namespace, as a reader would
paste them; each bash line is an `hf-speculators` command, run in this process through the same `main` as the
console script (a bash line of any other kind fails the test: mark its block or make it a command)."""

import re
import shlex
from pathlib import Path

import pytest
import torch

from hf_speculators.tools import cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"(?:<!-- not-tested: (?P<reason>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.DOTALL)
MARKER = re.compile(r"<!-- not-tested: [^>]*? -->")


def readme_blocks(text: str) -> list[tuple[str, str, str | None]]:
    """`(language, body, reason)` of every fenced block; `reason` is the not-tested marker's, else `None`."""
    return [(m["lang"], m["body"], m["reason"]) for m in BLOCK.finditer(text)]


def test_every_not_tested_marker_precedes_a_block():
    text = README.read_text(encoding="utf-8")
    marked = [reason for _, _, reason in readme_blocks(text) if reason is not None]
    assert len(marked) == len(MARKER.findall(text)), "a not-tested marker must be the line right before a ``` block"
    assert all(reason.strip() for reason in marked), "a not-tested marker says why"


def test_readme_blocks_parse():
    blocks = readme_blocks("text\n<!-- not-tested: needs the Hub -->\n```python\nx = 1\n```\n```bash\nls\n```\n")
    assert blocks == [("python", "x = 1\n", "needs the Hub"), ("bash", "ls\n", None)]


def _run_bash(body: str) -> None:
    for line in body.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        assert words[0] == "hf-speculators", (
            f"README bash line {line!r} is not an hf-speculators command: mark its block <!-- not-tested: WHY -->")
        assert cli.main(words[1:]) == 0, f"README command failed: {line}"


def test_readme_examples_run(monkeypatch, capsys):
    torch.set_num_threads(1)
    monkeypatch.chdir(ROOT)
    namespace: dict = {"__name__": "__readme__"}
    ran = 0
    for language, body, reason in readme_blocks(README.read_text(encoding="utf-8")):
        if reason is not None or language not in ("bash", "python"):
            continue
        if language == "python":
            exec(compile(body, str(README), "exec"), namespace)
        else:
            _run_bash(body)
        ran += 1
    assert ran >= 2, "the README's examples were not found"
    assert "vllm serve" in capsys.readouterr().out  # the export command printed its vLLM command line


@pytest.mark.parametrize("line", ["pip install -e .", "hf-speculators no-such-command"])
def test_a_bash_line_that_cannot_run_fails(line):
    with pytest.raises((AssertionError, SystemExit)):
        _run_bash(line)
