"""The benchmark's summaries: records pooled into figures per category and method (`summarize`), and what
`run_benchmark` returns (`BenchmarkResult`) with its plain-text tables."""

from dataclasses import dataclass, field
from typing import Sequence

from ...metrics import SpeculativeStats
from .batches import padding_overhead
from .settings import EAGER

# how each summary figure is written, in the bench's tables and in `hf-speculators report`
FIGURE_FORMATS = {
    "num_prompts": "{}", "tokens_per_s": "{:.1f}", "speedup": "{:.2f}x", "speedup_vs_compiled": "{:.2f}x", "mean_acceptance_length": "{:.2f}",
    "identical_rate": "{:.0%}", "outside_forwards": "{:.1%}", "draft_cost_ratio": "{:.3f}",
    "mean_draft_length": "{:.2f}", "floor_share": "{:.0%}", "model_held_share": "{:.0%}", "lead_kept": "{:.2f}",
}
BEST_K = "[best k]"  # the label suffix of a method's best constant length in a category (`best_of_k`)


@dataclass
class BenchmarkResult:
    """What `run_benchmark` measured.

    Attributes:
        records (`list[dict]`): one record per (prompt, method), in the format of `hf_speculators.tools.bench.records`.
        summary (`dict[str, dict[str, dict]]`): `summarize(records)`: category (and `"all"`) -> method -> figures.
        mismatches (`list[dict]`): the records of exact methods whose output differs from plain greedy decoding.
        skipped (`dict[str, str]`): methods that did not run, and why (with `batch_size > 1`: those that cannot
            run a batch).
        near_ties (`list[dict]`): the records of exact methods whose half-precision output first differs from plain
            greedy decoding's at a near-tie of the target's top-2 logits (not failures).
    """

    records: list[dict]
    summary: dict[str, dict[str, dict]]
    mismatches: list[dict]
    skipped: dict[str, str] = field(default_factory=dict)
    near_ties: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """`True` when every exact method reproduced plain greedy decoding on every prompt, near-ties in half
        precision aside (exit status 0)."""
        return not self.mismatches

    def table(self) -> str:
        """The summary as plain-text tables, one block per figure, rows per category, columns per method."""
        methods = list(self.summary["all"])
        blocks = [
            ("tokens/s (total new tokens / total seconds)", "tokens_per_s"),
            ("speedup vs plain (ratio of tokens/s)", "speedup"),
            ("speedup vs plain-compiled (static cache + torch.compile; ratio of tokens/s)", "speedup_vs_compiled"),
            ("compiled lead kept ((ours / plain-compiled) / (ours[eager] / plain); with --compare-eager)",
             "lead_kept"),
            ("mean acceptance length (tokens per draft, bonus included; - where none is reported)",
             "mean_acceptance_length"),
            ("identical-output rate (generated ids equal plain greedy's)", "identical_rate"),
            ("share of wall time outside model forwards", "outside_forwards"),
            ("draft cost ratio (drafting seconds per draft token / plain seconds per token)", "draft_cost_ratio"),
            ("mean draft length asked per step (the schedule's choice; 0 for a plain step)", "mean_draft_length"),
            ("share of row-steps the plain-speed floor ran plain (floor.py)", "floor_share"),
            ("share of the hybrid's model row-steps its floor held back (suffix draft or plain step instead)",
             "model_held_share"),
        ]
        # speedup_vs_compiled and lead_kept: with plain-compiled; the hybrid's held share: with a hybrid
        shown = [(title, key) for title, key in blocks if key in self.summary["all"][methods[0]] and (
            key != "model_held_share" or any(self.summary["all"][m][key] is not None for m in methods))]
        lines = [_format_block(title, self.summary, methods, key, FIGURE_FORMATS[key]) for title, key in shown]
        per_position = {m: s["acceptance_rate_per_position"] for m, s in self.summary["all"].items()}
        lines += ["acceptance rate per draft position (all prompts)"] + [
            f"  {m:<16} " + " ".join(f"{rate:.2f}" for rate in rates) for m, rates in per_position.items() if rates
        ]
        padding = padding_overhead(self.records)
        if padding is not None:
            lines.append(f"padding (plain batched): {padding['prompt_padding']:.1%} of prompt slots are left padding, "
                         f"{padding['finished_rows']:.1%} of decoding row-steps run rows that had finished")
        lines += [f"skipped {method}: {reason}" for method, reason in self.skipped.items()]
        return "\n".join(lines)


def _format_block(title: str, summary: dict, methods: list[str], key: str, fmt: str) -> str:
    width = max(len(c) for c in summary) + 2
    columns = [max(len(m), 8) + 2 for m in methods]
    rows = [title, "category".ljust(width) + "".join(m.rjust(w) for m, w in zip(methods, columns))]
    for category, by_method in summary.items():
        cells = [by_method[m][key] for m in methods]
        rows.append(category.ljust(width) + "".join(
            ("-" if v is None else fmt.format(v)).rjust(w) for v, w in zip(cells, columns)))
    return "\n".join(rows) + "\n"


def summarize(records: Sequence[dict]) -> dict[str, dict[str, dict]]:
    """Pools per-(prompt, method) records into figures per category and method.

    Throughput is total new tokens over total seconds (not a mean of per-prompt rates); speedup is a method's
    throughput over plain's in the same category; acceptance figures pool the counts of all prompts
    (`SpeculativeStats` formulas).

    Args:
        records (`Sequence[dict]`): records as `run_benchmark` writes them (e.g. read back from its JSONL file).

    Returns:
        `dict`: category -> method -> `{"num_prompts", "new_tokens", "seconds", "outside_forwards",
        "tokens_per_s", "speedup", "draft_cost_ratio", "mean_acceptance_length", "acceptance_rate_per_position",
        "mean_draft_length", "identical_rate", "floor_share", "model_held_share"}` (plus `best_of_k` entries),
        categories sorted and `"all"` (every record) last. `speedup` is `None` without plain records;
        acceptance figures are `None` for methods that report none. `draft_cost_ratio` is the drafting time per
        draft token over plain decoding's time per token (Leviathan et al.'s c).
    """
    categories = sorted({r["category"] for r in records} - {"all"})
    groups = {c: [r for r in records if r["category"] == c] for c in categories} | {"all": list(records)}
    return {category: best_of_k(_summarize_group(group)) for category, group in groups.items()}


def best_of_k(summary: dict[str, dict]) -> dict[str, dict]:
    """`summary` (method -> figures, one category) plus, for each method run at several constant lengths
    (`hf-prompt-lookup[k=3]`, `hf-prompt-lookup[k=8]`, ...), `hf-prompt-lookup[best k]`: the figures of the length
    with the most tokens/s in this category, with `best_k` naming it."""
    runs: dict[str, list[tuple[int, str]]] = {}
    for label in summary:
        base, _, rest = label.partition("[k=")
        if rest.endswith("]") and rest[:-1].isdigit():
            runs.setdefault(base, []).append((int(rest[:-1]), label))
    best = {}
    for base, labels in runs.items():
        if len(labels) > 1:
            k, label = max(labels, key=lambda item: summary[item[1]]["tokens_per_s"] or 0.0)
            best[base + BEST_K] = {**summary[label], "best_k": k}
    return {**summary, **best}


def _summarize_group(records: list[dict]) -> dict[str, dict]:
    methods = list(dict.fromkeys(r["method"] for r in records))
    summary = {m: _summarize_method([r for r in records if r["method"] == m]) for m in methods}
    plain = summary.get("plain", {}).get("tokens_per_s")
    compiled = summary.get("plain-compiled", {}).get("tokens_per_s")  # `run.COMPILED_PLAIN`, with compile=True
    for label, figures in summary.items():
        figures["speedup"] = figures["tokens_per_s"] / plain if plain else None
        if compiled:
            figures["speedup_vs_compiled"] = figures["tokens_per_s"] / compiled
            figures["lead_kept"] = _lead_kept(summary, label, plain, compiled)
        per_token = figures.pop("draft_seconds_per_token")
        figures["draft_cost_ratio"] = per_token * plain if plain and per_token is not None else None
    return summary


def _lead_kept(summary: dict[str, dict], label: str, plain: float | None, compiled: float) -> float | None:
    """The share of its eager lead a method keeps compiled: `(tokens/s of label / plain-compiled's) / (tokens/s of
    label[eager] / plain's)`; `None` without `label[eager]` (`settings.EAGER`) or plain in the group."""
    eager = summary.get(label + EAGER, {}).get("tokens_per_s")
    if not eager or not plain:
        return None
    return (summary[label]["tokens_per_s"] / compiled) / (eager / plain)


def _summarize_method(records: list[dict]) -> dict:
    new_tokens, seconds = sum(r["new_tokens"] for r in records), sum(r["seconds"] for r in records)
    with_stats = [r for r in records if r["num_drafts"] is not None]
    pooled = SpeculativeStats(
        num_drafts=sum(r["num_drafts"] for r in with_stats),
        num_accepted_tokens=sum(r["num_accepted_tokens"] for r in with_stats),
        drafted_per_position=_sum_lists(r["drafted_per_position"] for r in with_stats),
        accepted_per_position=_sum_lists(r["accepted_per_position"] for r in with_stats),
    )
    num_drafted_tokens = sum(r["num_drafted_tokens"] for r in with_stats)
    draft_lengths = _sum_lists(r.get("draft_lengths") or [] for r in with_stats)
    floor_steps = sum(r.get("num_floor_steps") or 0 for r in with_stats)
    return {
        "num_prompts": len(records),
        "new_tokens": new_tokens,
        "draft_seconds_per_token": sum(r["draft_time"] for r in with_stats) / num_drafted_tokens
        if num_drafted_tokens else None,
        "seconds": seconds,
        "outside_forwards": 1 - sum(r["forward_seconds"] for r in records) / seconds
        if seconds > 0 and all(r["forward_seconds"] is not None for r in records) else None,  # None: compiled runs
        "tokens_per_s": new_tokens / seconds if seconds > 0 else None,
        "mean_acceptance_length": pooled.mean_acceptance_length if with_stats else None,
        "acceptance_rate_per_position": pooled.acceptance_rate_per_position if with_stats else None,
        "mean_draft_length": sum(k * n for k, n in enumerate(draft_lengths)) / sum(draft_lengths)
        if draft_lengths else None,
        "identical_rate": sum(r["identical_to_plain"] for r in records) / len(records),
        "floor_share": floor_steps / sum(draft_lengths) if draft_lengths else None,
        "model_held_share": _model_held_share(with_stats),
    }


def _model_held_share(records: list[dict]) -> float | None:
    """The hybrid's held model row-steps over those and its model-drafted ones (`HybridDrafter`'s `drafter_stats`);
    `None` for other drafters."""
    figures = [(r.get("drafter_stats") or {}).get("model") or {} for r in records]
    figures = [f for f in figures if "held_steps" in f]
    if not figures:
        return None
    held = sum(f["held_steps"] for f in figures)
    return held / max(1, held + sum(f["steps"] for f in figures))


def _sum_lists(lists) -> list[int]:
    """Element-wise sum of integer lists of different lengths."""
    total: list[int] = []
    for values in lists:
        total += [0] * (len(values) - len(total))
        for i, value in enumerate(values):
            total[i] += value
    return total
