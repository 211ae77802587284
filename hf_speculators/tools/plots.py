"""Figures of benchmark runs: speedup and mean acceptance length per method and category, drawn from the JSONL
records that `run_benchmark` writes, so that a saved run can be plotted again later (`hf-speculators plot`)."""

import math
from pathlib import Path
from typing import Sequence

from .bench import summarize

PANELS = (("speedup", "speedup vs plain greedy (ratio of tokens/s)"),
          ("mean_acceptance_length", "mean acceptance length (tokens per draft, bonus included)"))


def pyplot():
    """matplotlib's `pyplot` with the file-only Agg backend, imported on first use.

    Raises:
        `ImportError`: without matplotlib (`pip install "hf_speculators[plot]"`).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError('Plotting needs matplotlib: pip install "hf_speculators[plot]".') from error
    return plt


def plot_benchmark(records: Sequence[dict], path: str | Path) -> None:
    """Saves a figure of a benchmark run: grouped bars per category (and `"all"`), one bar per speculative method,
    of its speedup over plain greedy decoding (top, with a line at 1) and its mean acceptance length (bottom; none
    for transformers' methods, which report none). The run's device, dtype and threads are in the title.

    Args:
        records (`Sequence[dict]`): `run_benchmark`'s records (`BenchmarkResult.records` or `read_records(path)`).
        path (`str` or `Path`): the image file (PNG, SVG or PDF, by its suffix); its folder is created.

    Raises:
        `ImportError`: without matplotlib (`pip install "hf_speculators[plot]"`).
    """
    plt = pyplot()
    summary = summarize(records)
    categories = list(summary)
    methods = [m for m in summary["all"] if m != "plain"]
    width = 0.8 / max(len(methods), 1)
    figure, axes = plt.subplots(2, 1, figsize=(max(6.0, 1.0 + 0.4 * len(categories) * max(len(methods), 1)), 7))
    for axis, (key, label) in zip(axes, PANELS):
        for i, method in enumerate(methods):
            values = [summary[c].get(method, {}).get(key) for c in categories]
            xs = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(categories))]
            axis.bar(xs, [math.nan if v is None else v for v in values], width, label=method)
        axis.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
        axis.set_ylabel(label, fontsize=8)
        axis.grid(axis="y", alpha=0.3)
    axes[0].axhline(1.0, color="gray", linestyle="--", linewidth=1)
    axes[0].legend(fontsize=7, ncol=min(len(methods), 4))
    figure.suptitle(_title(records[0].get("provenance", {})), fontsize=9)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=150)
    plt.close(figure)


def _title(provenance: dict) -> str:
    target = provenance.get("target") or "target"
    new_tokens = provenance.get("run", {}).get("settings", {}).get("max_new_tokens", "?")
    return (f"{Path(target).name} on {provenance.get('device', '?')}, {provenance.get('dtype', '?')}, "
            f"{provenance.get('num_threads', '?')} thread(s), {new_tokens} new tokens")
