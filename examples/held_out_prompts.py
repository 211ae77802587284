"""Writes a prompts file of held-out text: real text that is neither in this repository nor in the demo family's
training data, read from the packages hf_speculators itself depends on (so any machine that runs the project can
rebuild it, offline).

Three kinds of text, one Spec-Bench-style category each:
- `code`: the opening of a Python function from the source of huggingface_hub, accelerate, tqdm or PyYAML (its
  signature and docstring; the model continues the body). The demo family saw the Python 3.11 standard library,
  not these packages.
- `docs`: a paragraph of English prose from those packages' docstrings (its first half; the model continues it).
- `readme`: a paragraph of the packages' long descriptions (their README, in the installed `METADATA`).

The choice is seeded, so a package version gives the same file; each record's `question_id` names its source and
version. The benchmark reads the file like any JSONL prompts file:

```bash
python examples/held_out_prompts.py --out /tmp/held_out.jsonl --per-kind 10
hf-speculators bench --prompts /tmp/held_out.jsonl --max-new-tokens 96 --threads 1
```
"""

import argparse
import ast
import importlib.metadata
import json
import random
import re
from pathlib import Path

PACKAGES = {"huggingface_hub": "huggingface_hub", "accelerate": "accelerate", "tqdm": "tqdm", "yaml": "PyYAML"}
READMES = (*PACKAGES.values(), "transformers", "torch")  # the distributions whose long descriptions are read
MIN_CHARS, MAX_CHARS = 200, 1200  # a prompt's length, in characters


def package_files(module: str) -> list[Path]:
    """The `.py` files of an installed package, sorted (tests left out)."""
    root = Path(__import__(module).__file__).parent
    return sorted(path for path in root.rglob("*.py") if "test" not in path.as_posix().lower())


def function_openings(path: Path) -> list[str]:
    """Each documented function's source up to the end of its docstring: the text a code model continues."""
    source = path.read_text(encoding="utf-8", errors="replace")
    lines = source.splitlines()
    openings = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node) and len(node.body) > 1:
            text = "\n".join(lines[node.lineno - 1 : node.body[0].end_lineno])
            if MIN_CHARS <= len(text) <= MAX_CHARS:
                openings.append(text)
    return openings


def docstring_paragraphs(path: Path) -> list[str]:
    """The prose paragraphs of a file's docstrings (no code, no argument lists), halved: the model continues them."""
    tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
    docs = [ast.get_docstring(node) or "" for node in nodes]
    return [_first_half(p) for doc in docs for p in _paragraphs(doc)]


def readme_paragraphs(distribution: str) -> list[str]:
    """The prose paragraphs of a distribution's long description (its `METADATA` body), halved."""
    body = importlib.metadata.metadata(distribution).get_payload() or ""
    return [_first_half(p) for p in _paragraphs(body, markup="`_[]()")]


def _paragraphs(text: str, markup: str = "") -> list[str]:
    """Paragraphs of prose: blank-line separated, long enough, and not code, tables, lists or argument blocks (the
    characters in `markup` are allowed: Markdown's)."""
    banned = re.escape("".join(c for c in "`|<>{}=_[]()" if c not in markup))
    keep = []
    for block in re.split(r"\n\s*\n", text):
        block = " ".join(line.strip() for line in block.strip().splitlines())
        prose = re.fullmatch(rf"[A-Z][^{banned}]*[.!?]", block) is not None and not re.match(r"\w+:", block)
        if prose and MIN_CHARS <= len(block) <= MAX_CHARS and block.count(". ") >= 1:
            keep.append(block)
    return keep


def _first_half(paragraph: str) -> str:
    """The paragraph cut at the word boundary nearest its middle."""
    cut = paragraph.rfind(" ", 0, len(paragraph) // 2)
    return paragraph[: cut if cut > 0 else len(paragraph)]


def held_out_records(per_kind: int, seed: int) -> list[dict]:
    """`per_kind` records of each kind (fewer where the installed packages have fewer), seeded."""
    rng = random.Random(seed)
    pools = {"code": [], "docs": [], "readme": []}
    for module, distribution in PACKAGES.items():
        source = f"{distribution}=={importlib.metadata.version(distribution)}"
        for path in package_files(module):
            name = f"{source}:{path.name}"
            pools["code"] += [(f"{name}#{i}", text) for i, text in enumerate(function_openings(path))]
            pools["docs"] += [(f"{name}#{i}", text) for i, text in enumerate(docstring_paragraphs(path))]
    for distribution in READMES:
        source = f"{distribution}=={importlib.metadata.version(distribution)}"
        pools["readme"] += [(f"{source}:README#{i}", text) for i, text in enumerate(readme_paragraphs(distribution))]
    records = []
    for category, pool in pools.items():
        for question_id, text in rng.sample(pool, min(per_kind, len(pool))):
            records.append({"question_id": question_id, "category": category, "turns": [text]})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSONL file to write (keep it out of the repository)")
    parser.add_argument("--per-kind", type=int, default=10, help="prompts of each kind (code, docs, readme)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    records = held_out_records(args.per_kind, args.seed)
    with open(args.out, "w", encoding="utf-8") as file:
        file.writelines(json.dumps(record) + "\n" for record in records)
    counts = {kind: sum(r["category"] == kind for r in records) for kind in ("code", "docs", "readme")}
    print(f"wrote {len(records)} prompts to {args.out}: {counts}")


if __name__ == "__main__":
    main()
