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
FLOOR_COLUMN = ("steps the floor ran plain", "floor_share")  # only for runs whose records carry num_floor_steps


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _linear(provenance: dict) -> str:
    """", oneDNN linear layers" for a run whose target ran them (`use_onednn_linear`); nothing for torch's."""
    return ", oneDNN linear layers" if provenance.get("cpu_linear") == "onednn" else ""


def provenance_line(records: Sequence[dict]) -> str:
    """One sentence naming where and how the run was recorded, from the first record's provenance: date, commit,
    device, dtype, threads, oneDNN linear layers if used, library versions, prompts, new tokens and greedy or
    sampling decoding."""
    provenance = records[0].get("provenance", {})
    settings = provenance.get("run", {}).get("settings", {})
    decoding = (f"sampling (temperature {settings.get('temperature')}, seed {settings.get('seed')})"
                if settings.get("do_sample") else "greedy")
    prompts = len({r.get("prompt_index") for r in records})
    commit = (provenance.get("git_commit") or "unknown")[:7]
    return (f"Recorded {provenance.get('timestamp', 'at an unknown date')} at commit {commit}: "
            f"{provenance.get('device', '?')}, {provenance.get('dtype', '?')}, "
            f"{provenance.get('num_threads', '?')} thread(s){_linear(provenance)}, "
            f"torch {provenance.get('torch_version', '?')}, "
            f"transformers {provenance.get('transformers_version', '?')}; {prompts} prompts, "
            f"{settings.get('max_new_tokens', '?')} new tokens, {decoding}.")


def markdown_report(records: Sequence[dict]) -> str:
    """The run as Markdown: a provenance line, a table over all prompts with one row per method (tokens/s, speedup
    over plain, mean acceptance length, identical-output rate (not for a sampled run), draft cost ratio, mean draft
    length per step; for a run recorded with the plain-speed floor, the share of steps it ran plain), and a table of each
    method's speedup per category (and of the floor's share, for such a run). The figures are `summarize(records)`'s, as `bench` prints them.

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
    floor = any("num_floor_steps" in r for r in records)  # runs recorded before the floor keep their tables
    columns = [c for c in COLUMNS + (FLOOR_COLUMN,) * floor
               if not (sampled and c[1] == "identical_rate")]  # sampled outputs differ
    lines = [provenance_line(records), "", _row(["method"] + [title for title, _ in columns]),
             _row(["---"] * (len(columns) + 1))]
    for method, figures in summary["all"].items():
        lines.append(_row([f"`{method}`"] + [_cell(figures[key], FIGURE_FORMATS[key]) for _, key in columns]))
    speculative = [m for m in methods if m != "plain"]
    lines += ["", "Speedup vs plain per category:", ""]
    lines += _per_category(summary, speculative, "speedup")
    if floor:
        lines += ["", "Share of steps the floor ran plain per category:", ""]
        lines += _per_category(summary, [m for m in speculative if summary["all"][m]["floor_share"] is not None],
                               "floor_share")
    return "\n".join(lines) + "\n"


def _per_category(summary: dict, methods: list[str], key: str) -> list[str]:
    """A Markdown table of figure `key`, one row per category, one column per method."""
    lines = [_row(["category"] + [f"`{m}`" for m in methods]), _row(["---"] * (len(methods) + 1))]
    for category, by_method in summary.items():
        values = [by_method.get(m, {}).get(key) for m in methods]
        lines.append(_row([category] + [_cell(value, FIGURE_FORMATS[key]) for value in values]))
    return lines
