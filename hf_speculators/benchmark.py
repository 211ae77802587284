"""Benchmarks: the same prompts through plain greedy decoding and each speculative method, in one process.

`run_benchmark` warms every method up, then runs the methods back to back on each prompt (so that machine noise
hits all of them alike), checks that every exact method reproduces plain greedy decoding token for token, writes
one JSONL record per (prompt, method) and summarises tokens/s, speedup, mean acceptance length and the
identical-output rate per category. With `batch_size=B > 1` the prompts are grouped in order into batches of B
(left padded) and every method, plain batched `generate()` included, runs once per batch (`bench_batches`).

Record format (one JSON object per line, one line per (prompt, method), every line self-contained):

    question_id, prompt_index, category, method   which prompt (`prompt_index`: 0-based position in `prompts`)
    exact                                         whether the method is meant to reproduce plain greedy output
                                                  (False under a relaxed verifier: typical, top_k)
    prompt_tokens, truncated                      prompt length in tokens after truncation; whether it was cut
    new_tokens, seconds, tokens_per_s             tokens generated, wall-clock seconds of the generate call
    identical_to_plain                            whether the generated ids equal plain greedy decoding's
    num_target_forwards                           whole-target forward calls (a hook, for every method; layer
                                                  skip's verification runs only the upper layers, not counted)
    forward_seconds                               seconds inside target and draft forwards and the target's
                                                  modules run on their own by layer skip (hooks; CPU-exact)
    mean_acceptance_length, acceptance_rate, acceptance_rate_per_position, num_drafts, num_draft_tokens,
    num_accepted_tokens, drafted_per_position, accepted_per_position, draft_time, verify_time, lossless,
    drafter, verifier, draft_lengths, num_steps_without_draft
                                                  `SpeculativeStats` figures; null for methods that give none
                                                  (plain and transformers' methods)
    provenance                                    the run: git commit, versions, device, dtype, threads, models and
                                                  their quantization configs, settings (`batch_size` among them;
                                                  `skipped_methods`: method -> why it cannot run a batch) and
                                                  timestamp (the same object on every line)

With `batch_size > 1` a record is still one row (prompt) of one method, with these changes and additions:

    new_tokens                                    the row's own new tokens, up to its first EOS (not the padding)
    seconds, forward_seconds                      the batch call's seconds divided by its number of rows, so that
                                                  sums over records give total time (tokens/s of the whole run)
    identical_to_plain                            compared with the row of plain batched generate() (same padding)
    num_target_forwards                           the batch call's forwards (shared by its rows)
    draft_time, verify_time                       the batch call's, divided by its number of rows; the other
                                                  `SpeculativeStats` figures are the row's own (`row_stats`)
    batch_index, batch_rows, batch_seconds,       the batch (0-based), its rows, the call's wall-clock seconds, its
    batch_pad_tokens                              prompts' left padding slots
"""

import json
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from itertools import zip_longest
from pathlib import Path
from typing import Sequence

import torch
import transformers
from tqdm.auto import tqdm

from . import methods as speculative_methods
from .bench_batches import Batch, batch_skip_reason, make_batches, pad_token, padding_overhead, row_new_ids, row_stats
from .chat import encode_prompt, use_chat_template
from .decoding import generate
from .drafters import LayerSkipDrafter
from .layers import DecoderLayers
from .metrics import SpeculativeStats, clock
from .quantization import quantization_settings
from .schedules import check_schedule
from .verifiers import resolve_verifier

DEFAULT_METHODS = ("plain", "hf-prompt-lookup", "prompt-lookup", "prompt-lookup-tree", "hf-assisted", "draft-model",
                   "draft-model-tree")
EXIT_LAYER_METHODS = ("hf-early-exit", "layer-skip")
# the exit-layer methods need exit_layer=, the self-draft ones a quantization library (and "self-draft-fp8" a GPU),
# the head methods a draft head checkpoint made for the target: run when asked for only
METHODS = (*DEFAULT_METHODS, *EXIT_LAYER_METHODS, *speculative_methods.SELF_DRAFT_METHODS,
           *speculative_methods.HEAD_METHODS)
DRAFT_MODEL_METHODS = ("hf-assisted", *speculative_methods.DRAFT_MODEL_METHODS)
# where our drafters keep the module that drafts: DraftModelDrafter's draft model, EagleDrafter's head, MedusaDrafter's
DRAFT_MODULE_ATTRIBUTES = ("draft_model", "head", "heads")
# transformers reads these from the ASSISTANT's generation_config; generate() keywords for them are ignored (5.23)
PINNED_ASSISTANT_CONFIG = {"num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
# record fields copied from SpeculativeStats.to_dict(); null for methods that report no stats
STATS_FIELDS = (
    "mean_acceptance_length", "acceptance_rate", "acceptance_rate_per_position", "num_drafts", "num_draft_tokens",
    "num_accepted_tokens", "drafted_per_position", "accepted_per_position", "draft_time", "verify_time", "lossless",
    "drafter", "verifier", "draft_lengths", "num_steps_without_draft",
)


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt.

    Attributes:
        text (`str`): the prompt text (for multi-turn records, the first user turn).
        category (`str`, defaults to `"all"`): the category the summary groups it under.
        question_id (`int` or `str`, *optional*): the id from the prompts file (`question_id` or `task_id`).
    """

    text: str
    category: str = "all"
    question_id: int | str | None = None


def load_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """Reads benchmark prompts from a JSONL file (`.jsonl`) or a plain-text file (any other suffix).

    JSONL records give the prompt as `turns[0]` (Spec-Bench, MT-bench), `prompt` (HumanEval) or `question`
    (GSM8K), the category as `category` (default `"all"`) and the id as `question_id` or `task_id`. A plain-text
    file holds one prompt per non-blank line. Blank lines are skipped in both.

    Args:
        path (`str` or `Path`): the prompts file.
        limit (`int`, *optional*): keep `limit` prompts, taken round-robin over the categories in the order they
            first appear (each category's prompts in file order), so that a limit covers every category.

    Returns:
        `list[Prompt]`, at least one.

    Raises:
        `FileNotFoundError`: if `path` does not exist.
        `ValueError`: for `limit < 1`, an empty file, a line that is not JSON, or a JSONL record with none of the
            fields above.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"Prompts file {path} not found: pass a JSONL file (e.g. Spec-Bench question.jsonl) or a text file."
        )
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}.")
    lines = [(n, line) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if line.strip()]
    read = _prompt_from_json_line if path.suffix.lower() == ".jsonl" else _prompt_from_text_line
    prompts = [read(line, f"{path}:{n}") for n, line in lines]
    if not prompts:
        raise ValueError(f"Prompts file {path} has no prompts: write one JSON record or one prompt per line.")
    return _round_robin(prompts, limit)


def _round_robin(prompts: list[Prompt], limit: int | None) -> list[Prompt]:
    """The first `limit` prompts of the categories interleaved (all of them, in file order, if `limit` is None)."""
    if limit is None:
        return prompts
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    interleaved = [p for group in zip_longest(*by_category.values()) for p in group if p is not None]
    return interleaved[:limit]


def _prompt_from_json_line(line: str, where: str) -> Prompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON ({error}); a .jsonl file needs one JSON object per line.") from None
    text = _prompt_text(record) if isinstance(record, dict) else None
    if text is None:
        found = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(
            f"{where}: unknown JSONL format (found {found}); a record needs a non-empty 'turns' list (Spec-Bench, "
            "MT-bench), a 'prompt' string (HumanEval) or a 'question' string (GSM8K)."
        )
    question_id = record.get("question_id", record.get("task_id"))
    return Prompt(text, str(record.get("category", "all")), question_id)


def _prompt_text(record: dict) -> str | None:
    """`turns[0]` (Spec-Bench, MT-bench), else `prompt` (HumanEval), else `question` (GSM8K); `None` if none."""
    turns = record.get("turns")
    text = turns[0] if isinstance(turns, list) and turns else record.get("prompt", record.get("question"))
    return text if isinstance(text, str) and text else None


def _prompt_from_text_line(line: str, where: str) -> Prompt:
    if line.lstrip().startswith("{") and line.rstrip().endswith("}"):
        raise ValueError(f"{where}: this line looks like JSON; name the file *.jsonl to read it as JSONL records.")
    return Prompt(line)


@dataclass
class BenchmarkResult:
    """What `run_benchmark` measured.

    Attributes:
        records (`list[dict]`): one record per (prompt, method), in the format of the module docstring.
        summary (`dict[str, dict[str, dict]]`): `summarize(records)`: category (and `"all"`) -> method -> figures.
        mismatches (`list[dict]`): the records of exact methods whose output differs from plain greedy decoding.
        skipped (`dict[str, str]`): methods that did not run, and why (with `batch_size > 1`: those that cannot
            run a batch).
    """

    records: list[dict]
    summary: dict[str, dict[str, dict]]
    mismatches: list[dict]
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """`True` when every exact method reproduced plain greedy decoding on every prompt (exit status 0)."""
        return not self.mismatches

    def table(self) -> str:
        """The summary as plain-text tables, one block per figure, rows per category, columns per method."""
        methods = list(self.summary["all"])
        blocks = [
            ("tokens/s (total new tokens / total seconds)", "tokens_per_s", "{:.1f}"),
            ("speedup vs plain (ratio of tokens/s)", "speedup", "{:.2f}x"),
            ("mean acceptance length (tokens per draft, bonus included; - where none is reported)",
             "mean_acceptance_length", "{:.2f}"),
            ("identical-output rate (generated ids equal plain greedy's)", "identical_rate", "{:.0%}"),
            ("share of wall time outside model forwards", "outside_forwards", "{:.1%}"),
            ("draft cost ratio (drafting seconds per draft token / plain seconds per token)", "draft_cost_ratio",
             "{:.3f}"),
            ("mean draft length asked per step (the schedule's choice; 0 for a plain step)", "mean_draft_length",
             "{:.2f}"),
        ]
        lines = [_format_block(title, self.summary, methods, key, fmt) for title, key, fmt in blocks]
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
        "mean_draft_length", "identical_rate"}`, categories sorted and `"all"` (every record) last. `speedup` is `None` without plain
        records; acceptance figures are `None` for methods that report none. `draft_cost_ratio` is the drafting
        time per draft token over plain decoding's time per token (Leviathan et al.'s c).
    """
    categories = sorted({r["category"] for r in records} - {"all"})
    groups = {c: [r for r in records if r["category"] == c] for c in categories} | {"all": list(records)}
    return {category: _summarize_group(group) for category, group in groups.items()}


def _summarize_group(records: list[dict]) -> dict[str, dict]:
    methods = list(dict.fromkeys(r["method"] for r in records))
    summary = {m: _summarize_method([r for r in records if r["method"] == m]) for m in methods}
    plain = summary.get("plain", {}).get("tokens_per_s")
    for figures in summary.values():
        figures["speedup"] = figures["tokens_per_s"] / plain if plain else None
        per_token = figures.pop("draft_seconds_per_token")
        figures["draft_cost_ratio"] = per_token * plain if plain and per_token is not None else None
    return summary


def _summarize_method(records: list[dict]) -> dict:
    new_tokens, seconds = sum(r["new_tokens"] for r in records), sum(r["seconds"] for r in records)
    with_stats = [r for r in records if r["num_drafts"] is not None]
    pooled = SpeculativeStats(
        num_drafts=sum(r["num_drafts"] for r in with_stats),
        num_accepted_tokens=sum(r["num_accepted_tokens"] for r in with_stats),
        drafted_per_position=_sum_lists(r["drafted_per_position"] for r in with_stats),
        accepted_per_position=_sum_lists(r["accepted_per_position"] for r in with_stats),
    )
    num_draft_tokens = sum(r["num_draft_tokens"] for r in with_stats)
    draft_lengths = _sum_lists(r.get("draft_lengths") or [] for r in with_stats)
    return {
        "num_prompts": len(records),
        "new_tokens": new_tokens,
        "draft_seconds_per_token": sum(r["draft_time"] for r in with_stats) / num_draft_tokens
        if num_draft_tokens else None,
        "seconds": seconds,
        "outside_forwards": 1 - sum(r["forward_seconds"] for r in records) / seconds if seconds > 0 else None,
        "tokens_per_s": new_tokens / seconds if seconds > 0 else None,
        "mean_acceptance_length": pooled.mean_acceptance_length if with_stats else None,
        "acceptance_rate_per_position": pooled.acceptance_rate_per_position if with_stats else None,
        "mean_draft_length": sum(k * n for k, n in enumerate(draft_lengths)) / sum(draft_lengths)
        if draft_lengths else None,
        "identical_rate": sum(r["identical_to_plain"] for r in records) / len(records),
    }


def _sum_lists(lists) -> list[int]:
    """Element-wise sum of integer lists of different lengths."""
    total: list[int] = []
    for values in lists:
        total += [0] * (len(values) - len(total))
        for i, value in enumerate(values):
            total[i] += value
    return total


def _check_methods(methods: Sequence[str], draft, exit_layer: int | None, heads: dict) -> list[str]:
    """Returns the methods to run in canonical order, `plain` included; raises `ValueError` for bad names or
    methods without what they need (`heads`: option name -> draft head checkpoint)."""
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"Unknown benchmark methods {unknown}; choose from {', '.join(METHODS)}.")
    chosen = [m for m in METHODS if m == "plain" or m in methods]
    needs_draft = [m for m in chosen if m in DRAFT_MODEL_METHODS]
    if needs_draft and draft is None:
        raise ValueError(f"Methods {needs_draft} need a draft model: pass draft= or drop them from methods.")
    needs_exit = [m for m in chosen if m in EXIT_LAYER_METHODS]
    if needs_exit and exit_layer is None:
        raise ValueError(f"Methods {needs_exit} need an exit layer: pass exit_layer= or drop them from methods.")
    for method in chosen:
        option = speculative_methods.HEAD_METHODS.get(method)
        if option is not None and heads.get(option) is None:
            raise ValueError(f"Method {method!r} needs a draft head checkpoint: pass {option}= or drop it from methods.")
    return chosen


def _generate_kwargs(method: str, target, draft, num_draft_tokens: int, max_ngram_size: int, verifier, schedule,
                     drafter_options) -> dict:
    """The `model.generate` keywords that select `method` (greedy decoding and lengths are added by the caller)."""
    if method == "hf-prompt-lookup":
        return {"prompt_lookup_num_tokens": num_draft_tokens, "max_matching_ngram_size": max_ngram_size}
    if method == "hf-assisted":
        return {"assistant_model": draft}  # its number of tokens, schedule and threshold: _pinned_assistant_config
    if method == "hf-early-exit":  # the target is its own assistant: pinned on the target's config
        return {"assistant_early_exit": drafter_options["exit_layer"]}
    if method in speculative_methods.METHODS:
        drafter = speculative_methods.make_drafter(method, draft, num_draft_tokens=num_draft_tokens,
                                                   max_ngram_size=max_ngram_size, target=target, **drafter_options)
        return {"custom_generate": generate, "candidate_generator": drafter, "verifier": verifier,
                "num_draft_tokens_schedule": schedule}
    return {}


def variant_label(method: str, num_draft_tokens: int, schedule: str) -> str:
    """The benchmark name of `method` run with `num_draft_tokens` under `schedule`, e.g. `draft-model[k=3]` or
    `draft-model[goodput,k<=6]` (the bound) or `draft-model[heuristic,k=5]` (the starting length)."""
    if schedule == "constant":
        return f"{method}[k={num_draft_tokens}]"
    return f"{method}[{schedule},k{'<=' if schedule == 'goodput' else '='}{num_draft_tokens}]"


def _variants(method: str, num_draft_tokens: int, schedule: str, variants) -> list[tuple[str, int, str]]:
    """`(name, num_draft_tokens, schedule)` of each run of `method`: one per variant for our methods when
    `variants` is given, else the method itself with the run's settings."""
    if variants is None or method not in speculative_methods.METHODS:
        return [(method, num_draft_tokens, schedule)]
    return [(variant_label(method, k, check_schedule(name)), k, name) for k, name in variants]


@contextmanager
def _pinned_assistant_config(draft, num_draft_tokens: int, confidence_threshold: float = 0.0):
    """Pins transformers' assisted generation to `num_draft_tokens` per step, constant, and the confidence cut-off
    (none by default).

    transformers 5.23 reads these settings from the assistant's own `generation_config` (defaults: 20 tokens,
    threshold 0.4) and ignores them as `generate()` keywords, so they are set there and restored afterwards.
    """
    config = draft.generation_config
    pinned = {"num_assistant_tokens": num_draft_tokens, **PINNED_ASSISTANT_CONFIG,
              "assistant_confidence_threshold": confidence_threshold}
    saved = {key: getattr(config, key, None) for key in pinned}
    try:
        for key, value in pinned.items():
            setattr(config, key, value)
        yield
    finally:
        for key, value in saved.items():
            setattr(config, key, value)


@contextmanager
def _num_threads(num_threads: int | None):
    saved = torch.get_num_threads()
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        yield
    finally:
        torch.set_num_threads(saved)


@dataclass
class _Run:
    new_ids: torch.LongTensor  # [new_tokens]
    seconds: float
    num_target_forwards: int
    forward_seconds: float
    stats: SpeculativeStats | None


def _draft_model(generate_kwargs: dict):
    """The draft model a method's `generate` keywords run (transformers' assistant, our drafter's draft model or
    learned head), if any."""
    drafter = generate_kwargs.get("candidate_generator")
    own = next((getattr(drafter, name) for name in DRAFT_MODULE_ATTRIBUTES if getattr(drafter, name, None) is not None),
               None)
    return generate_kwargs.get("assistant_model", own)


def _timed_modules(target, generate_kwargs: dict) -> list:
    """The modules whose forwards count as model time for a method: the target, its draft model (`_draft_model`),
    and for layer skip the target's parts it calls outside the target's forward (embeddings, decoder layers,
    final norm, LM head); other methods hook no layer, so their timing pays for no extra hooks."""
    modules = [m for m in (target, _draft_model(generate_kwargs)) if m is not None]
    if isinstance(generate_kwargs.get("candidate_generator"), LayerSkipDrafter):
        parts = DecoderLayers(target)
        positions = [m for m in (parts.rotary, parts.learned_positions) if m is not None]
        modules += [parts.embeddings, *positions, *parts.layers, parts.final_norm, parts.head]
    return modules


@contextmanager
def _forward_timer(target, modules: list):
    """Counts target forwards and adds up the seconds spent inside the forwards of `modules` (module hooks).

    A module that runs inside another timed module's forward is counted with it. Yields a dict with
    `num_target_forwards` (whole-target forwards) and `forward_seconds`; on CUDA the hooks time kernel launches
    and waits, not the GPU work, so `forward_seconds` is exact on CPU only.
    """
    totals = {"num_target_forwards": 0, "forward_seconds": 0.0}
    starts = []

    def before(module, args):
        starts.append(time.perf_counter())
        totals["num_target_forwards"] += module is target

    def after(module, args, output):
        start = starts.pop()
        if not starts:  # the outermost timed module
            totals["forward_seconds"] += time.perf_counter() - start

    hooks = [h for m in modules for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]
    try:
        yield totals
    finally:
        for hook in hooks:
            hook.remove()


def _timed_generate(target, batch: Batch, generate_kwargs: dict, max_new_tokens: int) -> list[_Run]:
    """One greedy generate call on a batch of prompts, timed, with its model forwards measured; one `_Run` per row,
    each with the row's own new tokens and an even share of the call's seconds (`bench_batches`)."""
    rows = len(batch.indices)
    padding = {} if batch.attention_mask is None else {"attention_mask": batch.attention_mask,
                                                       "pad_token_id": batch.pad_token_id}
    with _forward_timer(target, _timed_modules(target, generate_kwargs)) as forwards:
        start = clock(target.device)
        output = target.generate(batch.input_ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 return_dict_in_generate=True, **padding, **generate_kwargs)
        seconds = clock(target.device) - start
    stats = getattr(output, "speculative_stats", None)
    new_ids = row_new_ids(output.sequences, batch.input_ids.shape[1], target.generation_config.eos_token_id)
    return [_Run(ids, seconds / rows, forwards["num_target_forwards"], forwards["forward_seconds"] / rows,
                 row_stats(stats, row, rows)) for row, ids in enumerate(new_ids)]


def _timed_generate_one(target, input_ids: torch.LongTensor, generate_kwargs: dict, max_new_tokens: int) -> _Run:
    """`_timed_generate` on one prompt `(1, prompt_tokens)`, unpadded."""
    batch = Batch([0], input_ids, None, [input_ids.shape[1]], [False])
    return _timed_generate(target, batch, generate_kwargs, max_new_tokens)[0]


def _encode(tokenizer, text: str, chat_template: bool, max_prompt_tokens: int, device,
            system_prompt: str | None = None) -> tuple[torch.LongTensor, bool]:
    """Tokenizes `text` (through the chat template if asked); keeps the last `max_prompt_tokens` tokens."""
    input_ids = encode_prompt(tokenizer, text, chat_template, system_prompt).input_ids
    if input_ids.shape[1] == 0:
        raise ValueError(f"Prompt {text!r} tokenizes to no tokens; remove it from the prompts file.")
    return input_ids[:, -max_prompt_tokens:].to(device), input_ids.shape[1] > max_prompt_tokens


def _prompt_budget(models, max_prompt_tokens: int, max_new_tokens: int) -> int:
    """The longest prompt (tokens) that leaves room for `max_new_tokens` within every model's position limit."""
    limits = [getattr(m.config, "max_position_embeddings", None) for m in models if m is not None]
    budget = min([max_prompt_tokens] + [limit - max_new_tokens for limit in limits if limit])
    if budget < 1:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt within the models' position limit "
            f"({min(limit for limit in limits if limit)} tokens): lower max_new_tokens."
        )
    return budget


def _git_commit() -> str | None:
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                                text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = result.stdout.strip()
    return commit if result.returncode == 0 and commit else None


def _model_name(model) -> str | None:
    return None if model is None else (getattr(model, "name_or_path", "") or type(model).__name__)


def _provenance(target, draft, methods, settings: dict) -> dict:
    from . import __version__

    return {
        "git_commit": _git_commit(),
        "hf_speculators_version": __version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": sys.version.split()[0],
        "device": str(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "num_threads": torch.get_num_threads(),
        "target": _model_name(target),
        "draft": _model_name(draft),
        "target_quantization": quantization_settings(target),
        "draft_quantization": None if draft is None else quantization_settings(draft),
        "methods": methods,
        **settings,
        "hf_assisted_config": {"num_assistant_tokens": settings["num_draft_tokens"], **PINNED_ASSISTANT_CONFIG},
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _record(prompt: Prompt, index: int, method: str, run: _Run, plain: _Run, prompt_tokens: int, truncated: bool,
            provenance: dict, batch: dict) -> dict:
    """One (prompt, method) record (module docstring); `batch`: the batch fields (empty for batch size 1)."""
    stats = run.stats.to_dict() if run.stats is not None else {}
    return {
        "question_id": prompt.question_id,
        "prompt_index": index,
        "category": prompt.category,
        "method": method,
        "exact": run.stats is None or run.stats.lossless,  # greedy: lossless methods must reproduce plain greedy
        "prompt_tokens": prompt_tokens,
        "truncated": truncated,
        "new_tokens": len(run.new_ids),
        "seconds": run.seconds,
        "tokens_per_s": len(run.new_ids) / run.seconds,
        "identical_to_plain": torch.equal(run.new_ids, plain.new_ids),
        "num_target_forwards": run.num_target_forwards,
        "forward_seconds": run.forward_seconds,
        **{name: stats.get(name) for name in STATS_FIELDS},
        **batch,
        "provenance": provenance,
    }


def run_benchmark(
    target,
    draft,
    tokenizer,
    prompts: Sequence[Prompt | str],
    methods: Sequence[str] = DEFAULT_METHODS,
    max_new_tokens: int = 128,
    num_draft_tokens: int = 5,
    out_path: str | Path | None = None,
    *,
    max_ngram_size: int = 2,
    max_prompt_tokens: int = 1024,
    chat_template: bool | None = False,
    system_prompt: str | None = None,
    num_threads: int | None = 1,
    verbose: bool = True,
    verifier: str | None = None,
    prefer: str | None = None,
    num_candidates: int | None = None,
    tree_top_k: int | None = None,
    tree_nodes: int | None = None,
    exit_layer: int | None = None,
    confidence_threshold: float | None = None,
    draft_vocab=None,
    eagle_head: str | None = None,
    medusa_head: str | None = None,
    num_draft_tokens_schedule: str | None = None,
    variants: Sequence[tuple[int, str]] | None = None,
    batch_size: int = 1,
) -> BenchmarkResult:
    """Runs plain greedy decoding and speculative methods on the same prompts and compares them.

    Each method is warmed up once on the first prompt; then, prompt by prompt, all methods run back to back,
    each generate call timed with `time.perf_counter` (after a CUDA synchronize on GPU). Methods:

    - `"plain"`: `target.generate(do_sample=False)`, the baseline, always run.
    - `"hf-prompt-lookup"`: transformers' `prompt_lookup_num_tokens=num_draft_tokens`, `max_matching_ngram_size`.
    - `"prompt-lookup"`: `PromptLookupDrafter(num_draft_tokens, max_ngram_size=max_ngram_size)` via `custom_generate`.
    - `"prompt-lookup-tree"`: the same with `num_candidates` continuations merged into a token tree.
    - `"hf-assisted"`: transformers' `assistant_model=draft` with `num_assistant_tokens=num_draft_tokens`, the
      `"constant"` schedule and confidence threshold 0 (pinned on `draft.generation_config`, restored after).
    - `"draft-model"`: `DraftModelDrafter(draft, num_draft_tokens)` via `custom_generate`.
    - `"draft-model-tree"`: `TreeDrafter(draft, DynamicTree(depth=num_draft_tokens, top_k=tree_top_k,
      num_nodes=tree_nodes))` via `custom_generate` (EAGLE-2 dynamic tree).
    - `"hf-early-exit"`: transformers' `assistant_early_exit=exit_layer`: the target drafts with its first
      `exit_layer` layers and a separate draft cache, pinned like `"hf-assisted"` (on the target's config).
    - `"layer-skip"`: `LayerSkipDrafter(exit_layer, num_draft_tokens)` via `custom_generate`: the same early
      exit, writing into the target's own cache.
    - `"self-draft-int8"`, `"self-draft-nf4"`, `"self-draft-int4"`, `"self-draft-fp8"`: `DraftModelDrafter.from_target(
      target, quantization, num_draft_tokens=num_draft_tokens)` via `custom_generate`, a quantized copy of the
      target as its draft (made once, before the warm-up; not in `DEFAULT_METHODS`).
    - `"eagle3"`, `"eagle3-tree"`, `"medusa"`, `"medusa-tree"`: learned draft heads on the target's hidden states
      from the checkpoints `eagle_head` and `medusa_head` (`EagleDrafter`, `MedusaDrafter`), a chain of
      `num_draft_tokens` or a `DynamicTree` as for `"draft-model-tree"` (not in `DEFAULT_METHODS`).

    Our methods verify with `verifier`; under a relaxed one (`"typical"`, `"top_k"`) their records have
    `exact=False` and a differing output is not a mismatch.

    Args:
        target (`PreTrainedModel`): the causal LM whose greedy output every method must reproduce.
        draft (`PreTrainedModel`, *optional*): a smaller LM with the target's vocabulary, on the target's device;
            needed by `"hf-assisted"` and `"draft-model"`.
        tokenizer (`PreTrainedTokenizerBase`): the target's tokenizer.
        prompts (`Sequence[Prompt | str]`): the prompts, e.g. from `load_prompts`; a string is `Prompt(text)`.
        methods (`Sequence[str]`, defaults to `DEFAULT_METHODS`, all of `METHODS` but the exit-layer and self-draft
            ones): the methods to compare; `"plain"` is added.
        max_new_tokens (`int`, defaults to 128): tokens to generate per call (fewer if EOS comes first).
        num_draft_tokens (`int`, defaults to 5): draft tokens per step (k), the same for every method.
        out_path (`str` or `Path`, *optional*): JSONL file for the records (overwritten, one line per record,
            written as each prompt finishes).
        max_ngram_size (`int`, defaults to 2, transformers' default): longest n-gram matched by both prompt lookups.
        max_prompt_tokens (`int`, defaults to 1024): longer prompts keep their last tokens (lowered further so
            that prompt plus `max_new_tokens` fit the models' `max_position_embeddings`); recorded as `truncated`.
        chat_template (`bool`, *optional*, defaults to `False`): wrap each prompt as a user turn with the
            tokenizer's chat template (`add_generation_prompt=True`); `None`: when the tokenizer has one.
        system_prompt (`str`, *optional*): a system turn before each prompt (needs the chat template).
        num_threads (`int`, *optional*, defaults to 1): torch CPU threads during the run (restored afterwards);
            `None` leaves the setting alone.
        verbose (`bool`, defaults to `True`): show a tqdm progress bar and print the summary table and any
            mismatches to stdout.
        verifier (`str`, *optional*): a name from `VERIFIERS` for our methods; default `"exact"`.
        prefer (`str`, *optional*): our prompt lookups' match rule, `"latest"` or `"earliest"` (`None`: the
            drafter's default, `"latest"`).
        num_candidates, tree_top_k, tree_nodes (`int`, *optional*): `"prompt-lookup-tree"`'s continuations and
            `"draft-model-tree"`'s `DynamicTree(top_k, num_nodes)`; `None` keeps the defaults (4; 4 and 24).
        exit_layer (`int`, *optional*): the layers that draft for `"hf-early-exit"` and `"layer-skip"` (required
            by them).
        confidence_threshold (`float`, *optional*): adaptive draft length for the same two methods: drafting stops
            after a token of lower draft probability (`LayerSkipDrafter(confidence_threshold=...)` and
            transformers' `assistant_confidence_threshold`); `None` or 0 always drafts `num_draft_tokens`.
        draft_vocab (`torch.LongTensor`, *optional*): `"layer-skip"`'s reduced draft vocabulary
            (`LayerSkipDrafter(draft_vocab=...)`, e.g. from `hf_speculators.vocab.frequent_tokens`); records
            give its size as `draft_vocab_size`.
        eagle_head, medusa_head (`str`, *optional*): the draft head checkpoints (folder, demo id or Hub id) of
            `"eagle3"` / `"eagle3-tree"` and `"medusa"` / `"medusa-tree"` (required by them).
        num_draft_tokens_schedule (`str`, *optional*): our methods' draft-length schedule (`"constant"`, the
            default, `"heuristic"` or `"goodput"`, which takes `num_draft_tokens` as its bound); see
            `hf_speculators.generate`.
        variants (`Sequence[tuple[int, str]]`, *optional*): `(num_draft_tokens, schedule)` pairs: each of our
            methods then runs once per pair, side by side, named by `variant_label` (e.g. `draft-model[k=3]`,
            `draft-model[goodput,k<=6]`); transformers' methods keep `num_draft_tokens`.
        batch_size (`int`, defaults to 1): prompts per generate call. With B > 1 the prompts are grouped in order
            into batches of B, left padded with the tokenizer's pad token (else its EOS token), and every method
            runs once per batch against plain batched `generate()` on the same padded batch; methods that cannot
            run a batch (transformers' assisted generation, drafters whose `check_batch_support` raises) are
            skipped, with the reason in `BenchmarkResult.skipped`. Records stay one per (prompt, method) (see the
            module docstring for the batch fields).

    Returns:
        `BenchmarkResult`: the records, the per-category summary and the mismatches; `result.ok` is `False` when
        an exact method's output differed from plain greedy decoding (the CLI then exits non-zero).

    Raises:
        `ImportError`: a self-draft method whose quantization library is not installed.
        `ValueError`: for an unknown method or verifier, a draft method without `draft`, an exit-layer method
            without `exit_layer`, an unknown `num_draft_tokens_schedule`, a self-draft method that cannot quantize
            `target` (see
            `DraftModelDrafter.from_target`), no prompts, a size below 1
            (`max_new_tokens`, `num_draft_tokens`, `max_prompt_tokens`, `max_ngram_size`, `batch_size`), a batch
            size above 1 with a tokenizer that has neither a pad nor an EOS token, `chat_template=True`
            or `system_prompt` without a chat template (see `hf_speculators.chat.use_chat_template`), a prompt of no tokens, or `max_new_tokens` at or over the position limit.
    """
    methods = _check_methods(methods, draft, exit_layer, {"eagle_head": eagle_head, "medusa_head": medusa_head})
    chat_template = use_chat_template(tokenizer, chat_template, system_prompt)
    prompts = [Prompt(p) if isinstance(p, str) else p for p in prompts]
    if not prompts:
        raise ValueError("No prompts to benchmark: pass at least one (see load_prompts).")
    sizes = [("max_new_tokens", max_new_tokens), ("num_draft_tokens", num_draft_tokens),
             ("max_prompt_tokens", max_prompt_tokens), ("max_ngram_size", max_ngram_size), ("batch_size", batch_size)]
    for name, value in sizes + [("num_draft_tokens", k) for k, _ in variants or ()]:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    if batch_size > 1 and pad_token(tokenizer) is None:
        raise ValueError("batch_size > 1 pads the prompts: give the tokenizer a pad_token or an eos_token.")
    budget = _prompt_budget((target, draft), max_prompt_tokens, max_new_tokens)
    verifier = resolve_verifier(verifier, do_sample=False)
    schedule = check_schedule(num_draft_tokens_schedule)
    drafter_options = {"prefer": prefer, "num_candidates": num_candidates, "tree_top_k": tree_top_k,
                       "tree_nodes": tree_nodes, "exit_layer": exit_layer, "confidence_threshold": confidence_threshold,
                       "draft_vocab": draft_vocab, "eagle_head": eagle_head, "medusa_head": medusa_head}
    recorded_options = {name: value for name, value in drafter_options.items() if name != "draft_vocab"}
    settings = {"num_draft_tokens": num_draft_tokens, "max_new_tokens": max_new_tokens,
                "max_ngram_size": max_ngram_size, "max_prompt_tokens": budget, "chat_template": chat_template,
                "system_prompt": system_prompt,
                "verifier": repr(verifier), "num_draft_tokens_schedule": schedule,
                "variants": None if variants is None else [list(v) for v in variants], **recorded_options,
                "draft_vocab_size": None if draft_vocab is None else len(draft_vocab), "batch_size": batch_size}
    encoded = [_encode(tokenizer, p.text, chat_template, budget, target.device, system_prompt) for p in prompts]
    batches = make_batches(encoded, batch_size, pad_token(tokenizer))
    kwargs = {label: _generate_kwargs(m, target, draft, k, max_ngram_size, verifier, name, drafter_options)
              for m in methods for label, k, name in _variants(m, num_draft_tokens, schedule, variants)}
    skipped = {label: reason for label, kw in kwargs.items() if batch_size > 1
               for reason in [batch_skip_reason(kw)] if reason is not None}
    kwargs = {label: kw for label, kw in kwargs.items() if label not in skipped}
    settings["skipped_methods"] = skipped
    with ExitStack() as stack:
        stack.enter_context(_num_threads(num_threads))
        if "hf-assisted" in methods:
            stack.enter_context(_pinned_assistant_config(draft, num_draft_tokens))
        if "hf-early-exit" in methods:
            stack.enter_context(_pinned_assistant_config(target, num_draft_tokens, confidence_threshold or 0.0))
        if out_path is not None:
            Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        out = stack.enter_context(open(out_path, "w", encoding="utf-8")) if out_path is not None else None
        provenance = _provenance(target, draft, methods, settings)
        records = _run_prompts(target, prompts, batches, kwargs, max_new_tokens, provenance, out, verbose,
                               batched=batch_size > 1)
    return _finish(records, verbose, skipped)


def _run_prompts(target, prompts, batches: list[Batch], kwargs, max_new_tokens, provenance, out, verbose,
                 batched: bool) -> list[dict]:
    """Warms every method up on the first batch, then runs all methods back to back on each batch (of one prompt
    unless `batched`, whose records get the batch fields)."""
    for method_kwargs in kwargs.values():  # warm-up, untimed and unrecorded
        _timed_generate(target, batches[0], method_kwargs, max_new_tokens)
    records = []
    progress = tqdm(batches, desc="bench", unit="batch" if batched else "prompt", disable=not verbose)
    for batch_index, batch in enumerate(progress):
        runs = {m: _timed_generate(target, batch, kw, max_new_tokens) for m, kw in kwargs.items()}
        new = [_record(prompts[index], index, m, rows[row], runs["plain"][row], batch.prompt_tokens[row],
                       batch.truncated[row], provenance, _batch_fields(batch_index, batch, rows[row]) if batched else {})
               for row, index in enumerate(batch.indices) for m, rows in runs.items()]
        if out is not None:  # written as each batch finishes, so an interrupted run keeps what it measured
            out.writelines(json.dumps(record) + "\n" for record in new)
            out.flush()
        records += new
    return records


def _batch_fields(batch_index: int, batch: Batch, run: _Run) -> dict:
    """The batch fields of a record of a batched run (module docstring)."""
    return {"batch_index": batch_index, "batch_rows": len(batch.indices),
            "batch_seconds": run.seconds * len(batch.indices), "batch_pad_tokens": batch.num_pad_tokens}


def _finish(records: list[dict], verbose: bool, skipped: dict[str, str]) -> BenchmarkResult:
    mismatches = [r for r in records if r["exact"] and not r["identical_to_plain"]]
    result = BenchmarkResult(records, summarize(records), mismatches, skipped)
    if verbose:
        print(result.table())
        for r in mismatches:
            print(f"MISMATCH: {r['method']} differs from plain greedy on prompt {r['prompt_index']} "
                  f"(question_id={r['question_id']}, category={r['category']})")
    return result
