"""Markdown tables of a saved benchmark run (`hf-speculators report RECORDS.jsonl`), so that the benchmark pages of
the documentation are produced from the JSONL records that `run_benchmark` writes rather than copied by hand."""

from typing import Sequence

from .bench import FIGURE_FORMATS, summarize

# (column title, summary key) of the table over all prompts
COLUMNS = (
    ("prompts", "num_prompts"),
    ("tokens/s", "tokens_per_s"),
    ("speedup vs plain", "speedup"),
    ("mean acceptance length", "mean_acceptance_length"),
    ("identical to plain", "identical_rate"),
    ("draft cost ratio", "draft_cost_ratio"),
    ("mean draft length per step", "mean_draft_length"),
)


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def provenance_line(records: Sequence[dict]) -> str:
    """One sentence naming where and how the run was recorded, from the first record's provenance: date, commit,
    device, dtype, threads, library versions, prompts, new tokens and greedy or sampling decoding."""
    provenance = records[0].get("provenance", {})
    settings = provenance.get("run", {}).get("settings", {})
    decoding = (f"sampling (temperature {settings.get('temperature')}, seed {settings.get('seed')})"
                if settings.get("do_sample") else "greedy")
    prompts = len({r.get("prompt_index") for r in records})
    commit = (provenance.get("git_commit") or "unknown")[:7]
    return (f"Recorded {provenance.get('timestamp', 'at an unknown date')} at commit {commit}: "
            f"{provenance.get('device', '?')}, {provenance.get('dtype', '?')}, "
            f"{provenance.get('num_threads', '?')} thread(s), torch {provenance.get('torch_version', '?')}, "
            f"transformers {provenance.get('transformers_version', '?')}; {prompts} prompts, "
            f"{settings.get('max_new_tokens', '?')} new tokens, {decoding}.")


def markdown_report(records: Sequence[dict]) -> str:
    """The run as Markdown: a provenance line, a table over all prompts with one row per method (tokens/s, speedup
    over plain, mean acceptance length, identical-output rate (not for a sampled run), draft cost ratio, mean draft
    length per step), and a table of each method's speedup per category. The figures are `summarize(records)`'s, as `bench` prints them.

    Args:
        records (`Sequence[dict]`): `run_benchmark`'s records (e.g. `hf_speculators.tools.bench.read_records(path)`).

    Returns:
        `str`: the Markdown text, ending with a newline.

    Raises:
        `ValueError`: no records.
    """
    if not records:
        raise ValueError("No benchmark records to report: pass the JSONL file of a run (hf-speculators bench --out).")
    summary = summarize(records)
    methods = list(summary["all"])
    sampled = records[0].get("provenance", {}).get("run", {}).get("settings", {}).get("do_sample", False)
    columns = [c for c in COLUMNS if not (sampled and c[1] == "identical_rate")]  # sampled outputs differ
    lines = [provenance_line(records), "", _row(["method"] + [title for title, _ in columns]),
             _row(["---"] * (len(columns) + 1))]
    for method, figures in summary["all"].items():
        lines.append(_row([f"`{method}`"] + [_cell(figures[key], FIGURE_FORMATS[key]) for _, key in columns]))
    speculative = [m for m in methods if m != "plain"]
    lines += ["", "Speedup vs plain per category:", "", _row(["category"] + [f"`{m}`" for m in speculative]),
              _row(["---"] * (len(speculative) + 1))]
    for category, by_method in summary.items():
        speedups = [by_method.get(m, {}).get("speedup") for m in speculative]
        lines.append(_row([category] + [_cell(speedup, FIGURE_FORMATS["speedup"]) for speedup in speedups]))
    return "\n".join(lines) + "\n"
