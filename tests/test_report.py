"""`hf-speculators report`: Markdown tables of a saved bench run, and the benchmark pages that embed them."""

import json
import re
from pathlib import Path

import pytest

from hf_speculators.tools import cli
from hf_speculators.tools.bench import read_records
from hf_speculators.tools.report import markdown_report

BENCHMARKS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
# a page embeds a report between these markers; the path is relative to docs/benchmarks/
EMBEDDED = re.compile(r"<!-- report: (\S+) -->\n(.*?)<!-- /report -->", re.DOTALL)


def _record(category, method, tokens, seconds, accepted=None, identical=True):
    keys = ("num_drafts", "num_accepted_tokens", "drafted_per_position", "accepted_per_position",
            "num_drafted_tokens", "draft_time", "draft_lengths")
    values = (2, accepted, [2, 1], [accepted, 0], 3, 0.03, [0, 0, 2]) if accepted is not None else (None,) * 7
    provenance = {"git_commit": "0123456789abcdef", "device": "cpu", "dtype": "float32", "num_threads": 1,
                  "torch_version": "2.13.0+cpu", "transformers_version": "5.23.0", "timestamp": "2026-11-23T23:00:00",
                  "run": {"settings": {"max_new_tokens": 16, "do_sample": False}}}
    return {"category": category, "method": method, "new_tokens": tokens, "seconds": seconds,
            "prompt_index": {"a": 0, "b": 1}[category], "forward_seconds": 0.9 * seconds,
            "identical_to_plain": identical, "provenance": provenance, **dict(zip(keys, values))}


RECORDS = [_record("a", "plain", 10, 1.0), _record("b", "plain", 30, 1.0),
           _record("a", "prompt-lookup", 10, 0.5, accepted=2), _record("b", "prompt-lookup", 30, 1.5, accepted=0,
                                                                       identical=False)]


def test_report_tables_hold_the_summary_figures():
    lines = markdown_report(RECORDS).splitlines()
    assert lines[0] == ("Recorded 2026-11-23T23:00:00 at commit 0123456: cpu, float32, 1 thread(s), torch 2.13.0+cpu, "
                        "transformers 5.23.0; 2 prompts, 16 new tokens, greedy.")
    # all prompts: 40 tokens in 2 s each; 1 + 2 accepted / 4 drafts; 0.01 s per draft token over 1/20 s per token
    assert "| `plain` | 2 | 20.0 | 1.00x | - | 100% | - | - |" in lines
    assert "| `prompt-lookup` | 2 | 20.0 | 1.00x | 1.50 | 50% | 0.200 | 2.00 |" in lines
    per_category = lines[lines.index("Speedup vs plain per category:") + 2:]
    assert per_category == ["| category | `prompt-lookup` |", "| --- | --- |", "| a | 2.00x |", "| b | 0.67x |",
                            "| all | 1.00x |"]


def test_report_of_a_sampled_run_has_no_identical_output_column():
    sampled = [{**r, "provenance": {**r["provenance"], "run": {"settings": {"max_new_tokens": 16, "do_sample": True,
                                                                            "temperature": 0.7, "seed": 0}}}}
               for r in RECORDS]
    lines = markdown_report(sampled).splitlines()
    assert lines[0].endswith("16 new tokens, sampling (temperature 0.7, seed 0).")
    assert "identical to plain" not in lines[2]
    assert "| `prompt-lookup` | 2 | 20.0 | 1.00x | 1.50 | 0.200 | 2.00 |" in lines


def test_report_without_records_raises():
    with pytest.raises(ValueError, match="No benchmark records"):
        markdown_report([])


def test_report_command_prints_the_tables(tmp_path, capsys):
    path = tmp_path / "bench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    assert cli.main(["report", str(path)]) == 0
    assert capsys.readouterr().out == markdown_report(RECORDS)


def test_report_command_names_a_missing_file(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl not found" in capsys.readouterr().err


def test_benchmark_pages_embed_the_report_of_their_records():
    """Every table a benchmark page embeds is what `hf-speculators report` gives for its saved records today, so a
    page cannot drift from its records (regenerate with `hf-speculators report docs/benchmarks/records/X.jsonl`)."""
    embedded = [(page, match) for page in sorted(BENCHMARKS.glob("*.md")) for match in EMBEDDED.finditer(page.read_text())]
    assert embedded, "no benchmark page embeds a report"
    for page, match in embedded:
        expected = markdown_report(read_records(BENCHMARKS / match.group(1)))
        assert match.group(2).strip() == expected.strip(), f"{page.name}: the report of {match.group(1)} is stale"
