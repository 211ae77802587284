"""Benchmarks: the same prompts through plain greedy decoding and each speculative method, in one process.

`run_benchmark` warms every method up, then runs the methods back to back on each prompt (so that machine noise
hits all of them alike), checks that every exact method reproduces plain greedy decoding token for token, writes
one JSONL record per (prompt, method) and summarises tokens/s, speedup, mean acceptance length and the
identical-output rate per category. With `batch_size=B > 1` the prompts are grouped in order into batches of B
(left padded) and every method, plain batched `generate()` included, runs once per batch (`bench_batches`).

Record format (one JSON object per line, one line per (prompt, method), every line self-contained):

    question_id, prompt_index, category, method   which prompt (`prompt_index`: 0-based position in `prompts`)
    exact                                         whether the method is meant to reproduce plain greedy output
                                                  (False under a relaxed verifier: typical, top_k, and under
                                                  sampling, where outputs are not compared)
    prompt_tokens, truncated                      prompt length in tokens after truncation; whether it was cut
    new_tokens, seconds, tokens_per_s             tokens generated, wall-clock seconds of the generate call
    identical_to_plain                            whether the generated ids equal plain greedy decoding's
    num_target_forwards                           whole-target forward calls (a hook, for every method; layer
                                                  skip's verification runs only the upper layers, not counted)
    forward_seconds                               seconds inside target and draft forwards and the target's
                                                  modules run on their own by layer skip (hooks; CPU-exact)
    mean_acceptance_length, acceptance_rate, acceptance_rate_per_position, num_drafts, num_drafted_tokens,
    num_accepted_tokens, drafted_per_position, accepted_per_position, draft_time, verify_time, lossless,
    drafter, verifier, draft_lengths, num_steps_without_draft
                                                  `SpeculativeStats` figures; null for methods that give none
                                                  (plain and transformers' methods)
    divergence                                    for an exact method whose output differs from plain greedy
                                                  decoding's: "near-tie" (half precision, the target's top-2 logits
                                                  at the first differing token closer than the dtype's resolution)
                                                  or "mismatch"; null otherwise
    batch_index, batch_rows, batch_seconds,       the batch (0-based), its rows, the call's wall-clock seconds, its
    batch_pad_tokens                              prompts' left padding slots (batch_size=1: one row, no padding)
    provenance                                    the run: git commit, versions, device, dtype, threads, models and
                                                  their quantization configs, and `run`: the methods' configs, the
                                                  settings (`BenchSettings`), the prompts' fingerprint and
                                                  `skipped_methods` (method -> why it cannot run a batch), which a
                                                  resumed run must share; timestamp (the same object on every line)

With `batch_size > 1` a record is still one row (prompt) of one method, with these changes:

    new_tokens                                    the row's own new tokens, up to its first EOS (not the padding)
    seconds, forward_seconds                      the batch call's seconds divided by its number of rows, so that
                                                  sums over records give total time (tokens/s of the whole run)
    identical_to_plain                            compared with the row of plain batched generate() (same padding)
    num_target_forwards                           the batch call's forwards (shared by its rows)
    draft_time, verify_time                       the batch call's, divided by its number of rows; the other
                                                  `SpeculativeStats` figures are the row's own (`row_stats`)

Records are written as soon as each is measured, so an interrupted run leaves a valid JSONL file of what it
measured; `BenchSettings(resume=True)` (`bench --resume`) continues it.
"""

from __future__ import annotations

import copy
import hashlib
import gzip
import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Mapping, Sequence

import torch
import transformers
from tqdm.auto import tqdm

from ..config import SpeculativeConfig
from ..config import methods as speculative_methods
from ..config.build import build_drafter, build_verifier
from ..config.methods import LOADED_DRAFT
from ..decoding import generate
from ..metrics import SpeculativeStats, clock
from ..prompts import Prompt, encode_prompt, load_prompts, use_chat_template
from ..quantization import quantization_settings
from ..schedules import check_schedule
from ..verifiers import resolve_verifier
from .bench_batches import Batch, batch_skip_reason, make_batches, pad_token, padding_overhead, row_new_ids, row_stats

DEFAULT_METHODS = ("plain", "hf-prompt-lookup", "prompt-lookup", "prompt-lookup-tree", "hf-assisted", "draft-model",
                   "draft-model-tree")
EXIT_LAYER_METHODS = ("hf-early-exit", "layer-skip")
# the model-free methods beyond prompt lookup, the exit-layer methods (they need exit_layer=), the self-draft ones
# (a quantization library; "self-draft-fp8" a GPU) and the head methods (a draft head checkpoint made for the
# target): run when asked for only
METHODS = (*DEFAULT_METHODS, "hf-universal-assisted", "suffix", "lookahead", "hybrid", *EXIT_LAYER_METHODS,
           *speculative_methods.SELF_DRAFT_METHODS, *speculative_methods.HEAD_METHODS,
           *speculative_methods.NATIVE_METHODS, "hf-mtp", "hf-dflash")
DRAFT_MODEL_METHODS = ("hf-assisted", "hf-universal-assisted", *speculative_methods.DRAFT_MODEL_METHODS)
# transformers' own methods, run as baselines: name -> the config method they correspond to
TRANSFORMERS_METHODS = {"hf-prompt-lookup": "prompt-lookup", "hf-assisted": "draft-model",
                        "hf-universal-assisted": "draft-model", "hf-early-exit": "layer-skip", "hf-mtp": "mtp",
                        "hf-dflash": "dflash"}
# transformers' methods whose draft length is the assistant's generation_config (pinned); MTP's and DFlash's is the
# model's own (its MTP layers, its block)
PINNED_TRANSFORMERS_METHODS = ("draft-model", "layer-skip")
TRANSFORMERS_KEYWORDS = tuple(TRANSFORMERS_METHODS.values())  # config methods transformers can run
ENGINES = ("hf_speculators", "transformers")
# transformers reads these from the ASSISTANT's generation_config; generate() keywords for them are ignored (5.23)
PINNED_ASSISTANT_CONFIG = {"num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
# record fields copied from SpeculativeStats.to_dict(); null for methods that report no stats
STATS_FIELDS = (
    "mean_acceptance_length", "acceptance_rate", "acceptance_rate_per_position", "num_drafts", "num_drafted_tokens",
    "num_accepted_tokens", "drafted_per_position", "accepted_per_position", "draft_time", "verify_time", "lossless",
    "drafter", "verifier", "draft_lengths", "num_steps_without_draft",
)


# how each summary figure is written, in the bench's tables and in `hf-speculators report`
FIGURE_FORMATS = {
    "num_prompts": "{}", "tokens_per_s": "{:.1f}", "speedup": "{:.2f}x", "mean_acceptance_length": "{:.2f}",
    "identical_rate": "{:.0%}", "outside_forwards": "{:.1%}", "draft_cost_ratio": "{:.3f}",
    "mean_draft_length": "{:.2f}",
}


@dataclass
class BenchmarkResult:
    """What `run_benchmark` measured.

    Attributes:
        records (`list[dict]`): one record per (prompt, method), in the format of the module docstring.
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
            ("mean acceptance length (tokens per draft, bonus included; - where none is reported)",
             "mean_acceptance_length"),
            ("identical-output rate (generated ids equal plain greedy's)", "identical_rate"),
            ("share of wall time outside model forwards", "outside_forwards"),
            ("draft cost ratio (drafting seconds per draft token / plain seconds per token)", "draft_cost_ratio"),
            ("mean draft length asked per step (the schedule's choice; 0 for a plain step)", "mean_draft_length"),
        ]
        lines = [_format_block(title, self.summary, methods, key, FIGURE_FORMATS[key]) for title, key in blocks]
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
    num_drafted_tokens = sum(r["num_drafted_tokens"] for r in with_stats)
    draft_lengths = _sum_lists(r.get("draft_lengths") or [] for r in with_stats)
    return {
        "num_prompts": len(records),
        "new_tokens": new_tokens,
        "draft_seconds_per_token": sum(r["draft_time"] for r in with_stats) / num_drafted_tokens
        if num_drafted_tokens else None,
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


def _generate_kwargs(method: BenchMethod, target, draft, do_sample: bool, tokenizer=None,
                     draft_tokenizer=None) -> dict:
    """The `model.generate` keywords that select `method` (decoding mode and lengths are added by the caller); the
    tokenizers reach our drafters (a draft of another tokenizer) and transformers' universal assisted generation."""
    config = method.config
    if method.engine == "transformers" and config.method == "dflash":  # the drafter's checkpoint as the assistant
        return {"speculation_type": "dflash", "assistant_model": build_drafter(config, target).model}
    if method.engine == "transformers":
        universal = {"tokenizer": tokenizer, "assistant_tokenizer": draft_tokenizer} if method.universal else {}
        if method.universal and do_sample:  # transformers 5.23 prunes the assistant's LM head in place: a copy
            universal["assistant_model"] = copy.deepcopy(draft)
        return {
            "prompt-lookup": {"prompt_lookup_num_tokens": config.resolved("num_draft_tokens"),
                              "max_matching_ngram_size": config.resolved("max_ngram_size")},
            # its tokens, schedule and threshold: _pinned_assistant_config
            "draft-model": {"assistant_model": draft, **universal},
            "layer-skip": {"assistant_early_exit": config.exit_layer},  # the target is its own assistant
            "mtp": {"use_mtp": True},  # the MTP layers beside the target's checkpoint
        }[config.method]
    loaded = {"draft_model": draft, "draft_tokenizer": draft_tokenizer} if config.draft_model == LOADED_DRAFT else {}
    verifier = resolve_verifier(build_verifier(config), do_sample)
    return {"custom_generate": generate, "candidate_generator": build_drafter(config, target, tokenizer, **loaded),
            "verifier": verifier, "num_draft_tokens_schedule": check_schedule(config.num_draft_tokens_schedule),
            "target_tokenizer": tokenizer}


def variant_label(method: str, num_draft_tokens: int, schedule: str) -> str:
    """The benchmark name of `method` run with `num_draft_tokens` under `schedule`, e.g. `draft-model[k=3]` or
    `draft-model[goodput,k<=6]` (the bound) or `draft-model[heuristic,k=5]` (the starting length)."""
    if schedule == "constant":
        return f"{method}[k={num_draft_tokens}]"
    return f"{method}[{schedule},k{'<=' if schedule == 'goodput' else '='}{num_draft_tokens}]"


def _variants(method: str, num_draft_tokens: int, schedule: str | None, variants) -> list[tuple[str, int, str | None]]:
    """`(label, num_draft_tokens, schedule)` of each run of our `method`: one per variant when `variants` is given,
    else the method itself with the run's settings."""
    if variants is None:
        return [(method, num_draft_tokens, schedule)]
    return [(variant_label(method, k, check_schedule(name)), k, name) for k, name in variants]


def _baseline_variants(method: str, num_draft_tokens: int, variants) -> list[tuple[str, int]]:
    """`(label, num_draft_tokens)` of each run of transformers' `method`: one per constant variant (transformers'
    methods run pinned to a constant length, so a schedule variant has no counterpart there), else the method itself
    with `num_draft_tokens`."""
    constant = [k for k, schedule in variants or () if check_schedule(schedule) == "constant"]
    if not constant:
        return [(method, num_draft_tokens)]
    return [(variant_label(method, k, "constant"), k) for k in constant]


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


def _timed_modules(target, generate_kwargs: dict) -> list:
    """The modules whose forwards count as model time for a method: the target, and transformers' assistant model
    or the modules our drafter declares (`Drafter.draft_modules`: its draft model or head, and the target's parts
    it calls outside the target's forward, e.g. layer skip's decoder layers); a model-free method hooks nothing
    more, so its timing pays for no extra hooks."""
    drafter = generate_kwargs.get("candidate_generator")
    own = () if drafter is None else drafter.draft_modules(target)
    assistant = generate_kwargs.get("assistant_model")
    return [target, *own, *(() if assistant is None else (assistant,))]


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


def _timed_generate(target, batch: Batch, generate_kwargs: dict, settings: BenchSettings) -> list[_Run]:
    """One generate call on a batch of prompts (greedy or sampled as `settings` say, from `settings.seed`), timed,
    with its model forwards measured; one `_Run` per row, each with the row's own new tokens and an even share of
    the call's seconds (`bench_batches`)."""
    rows = len(batch.indices)
    padding = {} if batch.attention_mask is None else {"attention_mask": batch.attention_mask,
                                                       "pad_token_id": batch.pad_token_id}
    torch.manual_seed(settings.seed)
    with _forward_timer(target, _timed_modules(target, generate_kwargs)) as forwards:
        start = clock(target.device)
        output = target.generate(batch.input_ids, max_new_tokens=settings.max_new_tokens, **settings.sampling(),
                                 return_dict_in_generate=True, **padding, **generate_kwargs)
        seconds = clock(target.device) - start
    stats = getattr(output, "speculative_stats", None)
    new_ids = row_new_ids(output.sequences, batch.input_ids.shape[1], target.generation_config.eos_token_id)
    return [_Run(ids, seconds / rows, forwards["num_target_forwards"], forwards["forward_seconds"] / rows,
                 row_stats(stats, row, rows)) for row, ids in enumerate(new_ids)]


def _timed_generate_one(target, input_ids: torch.LongTensor, generate_kwargs: dict, settings: BenchSettings) -> _Run:
    """`_timed_generate` on one prompt `(1, prompt_tokens)`, unpadded."""
    batch = Batch([0], input_ids, None, [input_ids.shape[1]], [False])
    return _timed_generate(target, batch, generate_kwargs, settings)[0]


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


def _provenance(target, draft, run: dict) -> dict:
    """The run's provenance, the same object on every record: versions, device, models, and `run` (the methods,
    settings and prompts' fingerprint that a resumed run must share)."""
    from .. import __version__

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
        "assistant_config": PINNED_ASSISTANT_CONFIG,
        "run": run,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _record(prompt: Prompt, index: int, method: str, run: _Run, plain: _Run, batch: Batch, row: int,
            batch_index: int, provenance: dict, sampled: bool) -> dict:
    """One (prompt, method) record (module docstring) of row `row` of batch `batch_index`."""
    stats = run.stats.to_dict() if run.stats is not None else {}
    return {
        "question_id": prompt.question_id,
        "prompt_index": index,
        "category": prompt.category,
        "method": method,
        # greedy: lossless methods must reproduce plain greedy token for token; sampled outputs are not compared
        "exact": not sampled and (run.stats is None or run.stats.lossless),
        "prompt_tokens": batch.prompt_tokens[row],
        "truncated": batch.truncated[row],
        "new_tokens": len(run.new_ids),
        "seconds": run.seconds,
        "tokens_per_s": len(run.new_ids) / run.seconds,
        "identical_to_plain": torch.equal(run.new_ids, plain.new_ids),
        "num_target_forwards": run.num_target_forwards,
        "forward_seconds": run.forward_seconds,
        **{name: stats.get(name) for name in STATS_FIELDS},
        **_batch_fields(batch_index, batch, run),
        "provenance": provenance,
    }


@torch.no_grad()
def _divergence(target, batch: Batch, row: int, run: _Run, plain: _Run, exact: bool) -> str | None:
    """Where an exact method's output differs from plain decoding's: `"near-tie"` when, at the first differing
    token, the target's top-2 logits are closer than its dtype's resolution (`torch.finfo(dtype).eps` times their
    magnitude; half precision only: a (k+1)-token forward is not bit-identical to k+1 one-token forwards there),
    else `"mismatch"`; `None` when the outputs are identical or the method is not exact."""
    if not exact or torch.equal(run.new_ids, plain.new_ids):
        return None
    if target.dtype in (torch.float32, torch.float64):
        return "mismatch"  # full precision stays exact: any difference is a mismatch
    length = min(len(run.new_ids), len(plain.new_ids))
    first = int((run.new_ids[:length] != plain.new_ids[:length]).int().argmax()) if length else 0
    if length and bool((run.new_ids[:length] == plain.new_ids[:length]).all()):
        return "mismatch"  # one output stops early (EOS) where the other goes on
    prompt = batch.input_ids[row]
    if batch.attention_mask is not None:
        prompt = prompt[batch.attention_mask[row].bool()]
    sequence = torch.cat([prompt, plain.new_ids[:first].to(prompt.device)])[None]
    logits = target(input_ids=sequence).logits[0, -1]  # [vocab], in the target's dtype
    top = logits.topk(2).values.float()
    resolution = torch.finfo(logits.dtype).eps * float(top.abs().max())
    return "near-tie" if float(top[0] - top[1]) <= resolution else "mismatch"


@dataclass(frozen=True)
class BenchMethod:
    """A method to benchmark: a `SpeculativeConfig`, run either by hf_speculators (`custom_generate`) or by
    transformers' own assisted generation (the baselines `"hf-prompt-lookup"`, `"hf-assisted"`,
    `"hf-universal-assisted"`, `"hf-early-exit"`, `"hf-mtp"`, `"hf-dflash"`).

    Attributes:
        config (`SpeculativeConfig`): the drafter, its settings, the verification and the draft-length schedule. For
            `engine="transformers"` its method is `"prompt-lookup"` (`prompt_lookup_num_tokens`,
            `max_matching_ngram_size`), `"draft-model"` (`assistant_model`) or `"layer-skip"`
            (`assistant_early_exit`), with `num_draft_tokens` pinned (`num_assistant_tokens_schedule="constant"`),
            or `"mtp"` (`use_mtp=True`) or `"dflash"` (`speculation_type="dflash"`, the DFlash checkpoint
            `draft_model` as `assistant_model`), whose draft length is the model's own.
        engine (`str`, defaults to `"hf_speculators"`): `"hf_speculators"` or `"transformers"`.
        universal (`bool`, defaults to `False`): with `engine="transformers"` and `"draft-model"`, transformers'
            universal assisted generation (a draft of another tokenizer: `tokenizer=` and `assistant_tokenizer=`
            passed; string-level exact matching when greedy, token-level intersection when sampling).

    Raises:
        `ValueError`: an unknown engine, or a transformers method it has no equivalent for.
    """

    config: SpeculativeConfig
    engine: str = "hf_speculators"
    universal: bool = False

    def __post_init__(self):
        if not isinstance(self.config, SpeculativeConfig):
            raise TypeError(f"BenchMethod.config must be a SpeculativeConfig, got {type(self.config).__name__}.")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}.")
        if self.engine == "transformers" and self.config.method not in TRANSFORMERS_KEYWORDS:
            raise ValueError(f"transformers' assisted generation has no method {self.config.method!r}: choose one of "
                             f"{sorted(TRANSFORMERS_KEYWORDS)}.")


@dataclass(frozen=True)
class BenchSettings:
    """How `run_benchmark` runs every method: lengths, sampling, prompts, threads and where records go.

    Args:
        max_new_tokens (`int`, defaults to 128): tokens to generate per call (fewer if EOS comes first), >= 1.
        max_prompt_tokens (`int`, defaults to 1024): longer prompts keep their last tokens (lowered further so that
            prompt plus `max_new_tokens` fit the models' `max_position_embeddings`); recorded as `truncated`.
        batch_size (`int`, defaults to 1): prompts per generate call (see `run_benchmark`), >= 1.
        do_sample (`bool`, defaults to `False`): sample instead of greedy decoding, every method alike. Under
            sampling no output is compared token for token (records have `exact=False`): speed and acceptance are
            what is measured.
        temperature (`float`, defaults to 1.0), top_p (`float`, defaults to 1.0), top_k (`int`, defaults to 0: off):
            the sampling warpers, as for `generate` (> 0, in (0, 1], >= 0).
        seed (`int`, defaults to 0): `torch.manual_seed(seed)` before every generate call, so that every method of
            a prompt starts from the same random state.
        chat_template (`bool`, *optional*, defaults to `False`): wrap each prompt as a user turn with the
            tokenizer's chat template (`add_generation_prompt=True`); `None`: when the tokenizer has one.
        system_prompt (`str`, *optional*): a system turn before each prompt (needs the chat template).
        num_threads (`int`, *optional*, defaults to 1): torch CPU threads during the run (restored afterwards);
            `None` leaves the setting alone.
        verbose (`bool`, defaults to `True`): a tqdm progress bar, and the summary table and any mismatches printed.
        out_path (`str` or `Path`, *optional*): JSONL file of the records, each written (and flushed) as soon as it
            is measured, so that an interrupted run leaves a valid file of everything measured so far.
        resume (`bool`, defaults to `False`): continue the run recorded in `out_path` (same methods, settings and
            prompts): batches whose records are all there are kept and skipped, a batch cut short is run again.

    Raises:
        `ValueError`: a value out of range or of the wrong type, naming the field.
    """

    max_new_tokens: int = 128
    max_prompt_tokens: int = 1024
    batch_size: int = 1
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    chat_template: bool | None = False
    system_prompt: str | None = None
    num_threads: int | None = 1
    verbose: bool = True
    out_path: str | Path | None = None
    resume: bool = False

    def __post_init__(self):
        for name in ("max_new_tokens", "max_prompt_tokens", "batch_size", "num_threads"):
            value = getattr(self, name)
            if (value is not None or name != "num_threads") and not _is_int(value, low=1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if not _is_int(self.top_k, low=0) or not _is_int(self.seed, low=0):
            raise ValueError(f"top_k and seed must be integers >= 0, got {self.top_k!r} and {self.seed!r}.")
        if not _is_number(self.temperature) or not self.temperature > 0:
            raise ValueError(f"temperature must be a number > 0, got {self.temperature!r}.")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}.")
        for name in ("do_sample", "verbose", "resume"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if self.resume and self.out_path is None:
            raise ValueError("resume=True continues the records of out_path: set out_path as well.")

    def sampling(self) -> dict:
        """The `generate` keywords of the decoding mode: greedy, or sampling with its warpers."""
        if not self.do_sample:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    def recorded(self) -> dict:
        """The settings that define the measurements (those a resumed run must share), for the provenance."""
        return {name: value for name, value in asdict(self).items() if name not in ("verbose", "out_path", "resume")}


def _is_int(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def named_methods(
    names: Sequence[str],
    *,
    variants: Sequence[tuple[int, str]] | None = None,
    num_draft_tokens: int = 5,
    max_ngram_size: int = 2,
    verification: str | None = None,
    num_draft_tokens_schedule: str | None = None,
    draft_model: str | None = None,
    **options,
) -> dict[str, BenchMethod]:
    """The benchmark methods of the command line's names: `"plain"` (skipped: `run_benchmark` always runs it),
    transformers' baselines (`TRANSFORMERS_METHODS`) and the named methods of `hf_speculators.config.methods.METHODS`.

    Args:
        names (`Sequence[str]`): method names from `METHODS`, run in that canonical order.
        variants (`Sequence[tuple[int, str]]`, *optional*): `(num_draft_tokens, schedule)` pairs: each of our methods
            then runs once per pair, named by `variant_label` (e.g. `draft-model[k=3]`); transformers' baselines run
            once per constant pair (`hf-prompt-lookup[k=3]`), or with `num_draft_tokens` when there is none.
        num_draft_tokens (`int`, defaults to 5): draft tokens per step (k), the same for every method.
        max_ngram_size (`int`, defaults to 2, transformers' default): longest n-gram of both prompt lookups.
        verification (`str`, *optional*): our methods' verifier (a key of `VERIFIERS`); default: exact for greedy
            decoding, rejection when sampling.
        num_draft_tokens_schedule (`str`, *optional*): our methods' draft-length schedule (default `"constant"`).
        draft_model (`str`, *optional*): the draft model's name or path (`run_benchmark(draft=...)` passes the loaded
            one); default `"<loaded draft model>"`.
        **options: the other arguments of `hf_speculators.config.methods.method_config` (`prefer`, `num_candidates`,
            `tree_top_k`, `tree_nodes`, `exit_layer`, `confidence_threshold`, `draft_vocab`, `draft_vocab_size`,
            `eagle_head`, `medusa_head`).

    Returns:
        `dict[str, BenchMethod]`: benchmark label -> method.

    Raises:
        `ValueError`: an unknown name (listing `METHODS`), an exit-layer method without `exit_layer`, a head method
            without its checkpoint, or settings a config refuses (naming the field).
    """
    unknown = sorted(set(names) - set(METHODS))
    if unknown:
        raise ValueError(f"Unknown benchmark methods {unknown}; choose from {', '.join(METHODS)}.")
    draft_model = draft_model or LOADED_DRAFT
    needs_exit = [m for m in names if m in EXIT_LAYER_METHODS]
    if needs_exit and options.get("exit_layer") is None:
        raise ValueError(f"Methods {needs_exit} need an exit layer: pass exit_layer= or drop them from methods.")
    for method in names:
        option = speculative_methods.CHECKPOINT_OPTIONS.get(method.removeprefix("hf-"))
        if option is not None and options.get(option) is None:
            raise ValueError(f"Method {method!r} needs a draft head checkpoint: pass {option}= or drop it from methods.")
    chosen = {}
    for method in (m for m in METHODS if m in names and m != "plain"):
        if method in TRANSFORMERS_METHODS:
            for label, k in _baseline_variants(method, num_draft_tokens, variants):
                config = _transformers_config(method, k, max_ngram_size, draft_model, options)
                chosen[label] = BenchMethod(config, engine="transformers", universal=method == "hf-universal-assisted")
            continue
        for label, k, schedule in _variants(method, num_draft_tokens, num_draft_tokens_schedule, variants):
            config = speculative_methods.method_config(method, draft_model=draft_model, num_draft_tokens=k,
                                                       max_ngram_size=max_ngram_size, **options)
            extra = {"verification": verification, "num_draft_tokens_schedule": schedule}
            chosen[label] = BenchMethod(config.override(**{n: v for n, v in extra.items() if v is not None}))
    return chosen


def _transformers_config(method: str, num_draft_tokens: int, max_ngram_size: int, draft_model: str,
                         options: dict) -> SpeculativeConfig:
    """The config of one of transformers' baselines (`BenchMethod(engine="transformers")`)."""
    if method == "hf-prompt-lookup":
        return SpeculativeConfig("prompt-lookup", num_draft_tokens=num_draft_tokens, max_ngram_size=max_ngram_size)
    if method in ("hf-assisted", "hf-universal-assisted"):
        return SpeculativeConfig("draft-model", num_draft_tokens=num_draft_tokens, draft_model=draft_model)
    if method == "hf-mtp":
        return SpeculativeConfig("mtp")
    if method == "hf-dflash":
        return SpeculativeConfig("dflash", draft_model=options["dflash_model"])
    return SpeculativeConfig("layer-skip", num_draft_tokens=num_draft_tokens, exit_layer=options["exit_layer"],
                             confidence_threshold=options.get("confidence_threshold"))


def run_benchmark(
    target,
    tokenizer,
    prompts: Sequence[Prompt | str],
    methods: Mapping[str, BenchMethod | SpeculativeConfig],
    settings: BenchSettings | None = None,
    draft=None,
    draft_tokenizer=None,
) -> BenchmarkResult:
    """Runs plain decoding and each method on the same prompts and compares them.

    Each method is warmed up once on the first batch; then, batch by batch (prompt by prompt for `batch_size=1`),
    all methods run back to back, plain first, each generate call timed with `time.perf_counter` (after a CUDA
    synchronize on GPU) from the same seed. Under greedy decoding every lossless method must reproduce plain
    greedy decoding token for token; in half precision a first divergence at a near-tie (the target's top-2
    logits there closer than the dtype's resolution) is reported apart from a real mismatch (`BenchmarkResult`).
    `named_methods` gives the methods of the command line's names.

    Methods given as a `SpeculativeConfig` (or `BenchMethod(config)`) run through `custom_generate` with the
    drafter `build_drafter` makes (a draft-model method uses `draft` when given, else loads `config.draft_model`),
    the config's verification (default: exact for greedy decoding, rejection when sampling) and its draft-length
    schedule (default constant). `BenchMethod(config, engine="transformers")` runs transformers' assisted
    generation with the config's `num_draft_tokens`, pinned to the `"constant"` schedule and confidence threshold
    0 (on `draft.generation_config`, restored after) so that the comparison is fair.

    Args:
        target (`PreTrainedModel`): the causal LM whose output every lossless method must reproduce.
        tokenizer (`PreTrainedTokenizerBase`): the target's tokenizer.
        prompts (`Sequence[Prompt | str]`): the prompts, e.g. from `load_prompts`; a string is `Prompt(text)`.
        methods (`Mapping[str, BenchMethod | SpeculativeConfig]`): label -> method; `"plain"` is added first.
        settings (`BenchSettings`, *optional*): lengths, sampling, prompts, threads and records; defaults to
            `BenchSettings()`.
        draft (`PreTrainedModel`, *optional*): a loaded draft model with the target's vocabulary, on the target's
            device, for the draft-model methods and transformers' `"hf-assisted"` and `"hf-universal-assisted"`.
        draft_tokenizer (`PreTrainedTokenizerBase`, *optional*): `draft`'s tokenizer: needed for a draft of another
            tokenizer (our draft-model methods translate; `"hf-universal-assisted"` passes it as
            `assistant_tokenizer=`).

    Returns:
        `BenchmarkResult`: the records (those of a resumed run included), the per-category summary, the mismatches
        and near-ties; `result.ok` is `False` when a lossless method's greedy output really differed.

    Raises:
        `ImportError`: a method whose quantization library is not installed.
        `ValueError`: no prompts, a label `"plain"`, a method that is not a config, a method whose `draft_model` is
            `LOADED_DRAFT` or transformers' assisted method without `draft`, what `build_drafter` and `resolve_verifier` raise for a config, a batch size above 1
            with a tokenizer that has neither a pad nor an EOS token, `chat_template=True` or `system_prompt`
            without a chat template, a prompt of no tokens, `max_new_tokens` at or over the position limit, or
            `resume` with a records file of another run.
    """
    settings = BenchSettings() if settings is None else settings
    methods = {label: m if isinstance(m, BenchMethod) else BenchMethod(m) for label, m in methods.items()}
    if "plain" in methods:
        raise ValueError("'plain' is always run as the baseline: do not pass it among the methods.")
    needs_draft = [label for label, m in methods.items() if m.config.draft_model == LOADED_DRAFT
                   or (m.engine == "transformers" and m.config.method == "draft-model")]
    if needs_draft and draft is None:
        raise ValueError(f"Methods {needs_draft} need a draft model: pass draft= (the loaded model) or drop them.")
    chat_template = use_chat_template(tokenizer, settings.chat_template, settings.system_prompt)
    prompts = [Prompt(p) if isinstance(p, str) else p for p in prompts]
    if not prompts:
        raise ValueError("No prompts to benchmark: pass at least one (see load_prompts).")
    if settings.batch_size > 1 and pad_token(tokenizer) is None:
        raise ValueError("batch_size > 1 pads the prompts: give the tokenizer a pad_token or an eos_token.")
    budget = _prompt_budget((target, draft), settings.max_prompt_tokens, settings.max_new_tokens)
    encoded = [_encode(tokenizer, p.text, chat_template, budget, target.device, settings.system_prompt)
               for p in prompts]
    batches = make_batches(encoded, settings.batch_size, pad_token(tokenizer))
    kwargs = {"plain": {}} | {
        label: _generate_kwargs(m, target, draft, settings.do_sample, tokenizer, draft_tokenizer)
        for label, m in methods.items()}
    skipped = {label: reason for label, kw in kwargs.items() if settings.batch_size > 1
               for reason in [batch_skip_reason(kw)] if reason is not None}
    kwargs = {label: kw for label, kw in kwargs.items() if label not in skipped}
    run = {"settings": {**settings.recorded(), "max_prompt_tokens": budget, "chat_template": chat_template},
           "methods": {label: {"engine": m.engine, **m.config.to_dict()} for label, m in methods.items()},
           "prompts": _digest(prompts), "skipped_methods": skipped}
    with ExitStack() as stack:
        stack.enter_context(_num_threads(settings.num_threads))
        for label, m in methods.items():
            if m.engine == "transformers" and m.config.method in PINNED_TRANSFORMERS_METHODS:
                # the assistant the method runs (its own copy for universal speculative decoding), else the target
                assistant = kwargs.get(label, {}).get("assistant_model", target)
                stack.enter_context(_pinned_assistant_config(assistant, m.config.resolved("num_draft_tokens"),
                                                             m.config.confidence_threshold or 0.0))
        provenance = _provenance(target, draft, json.loads(json.dumps(run)))
        writer = stack.enter_context(RecordWriter(settings.out_path, provenance["run"], settings.resume))
        records = _run_batches(target, prompts, batches, kwargs, settings, provenance, writer)
    return _finish(records, settings.verbose, skipped)


def _digest(prompts: list[Prompt]) -> str:
    """A fingerprint of the prompts (texts, categories, ids), so that a resumed run checks it has the same."""
    text = json.dumps([[p.text, p.category, p.question_id] for p in prompts])
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def read_records(path: str | Path) -> list[dict]:
    """The records of a benchmark run, one per (prompt, method), from its JSONL file (`hf-speculators bench --out`),
    or that file gzip-compressed (a name ending in `.gz`).

    Raises:
        `FileNotFoundError`: a file that does not exist.
        `ValueError`: a line that is not a JSON record of `run_benchmark`, or a file without records.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Records file {path} not found: pass the JSONL file of a run (hf-speculators bench "
                                "--out FILE).")
    records = []
    text = gzip.decompress(path.read_bytes()).decode("utf-8") if path.suffix == ".gz" else path.read_text("utf-8")
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error}).") from None
        if not isinstance(record, dict) or not {"method", "category", "new_tokens", "seconds"} <= set(record):
            raise ValueError(f"{path}:{number}: not a benchmark record (hf-speculators bench writes them; a sweep's "
                             "records have no method).")
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no records.")
    return records


class RecordWriter:
    """Writes benchmark records to a JSONL file one by one, each flushed as soon as it is written, and reads back
    the complete batches of an earlier run of the same settings to resume it (a context manager).

    Args:
        path (`str` or `Path`, *optional*): the JSONL file; `None` keeps the records in memory only.
        run (`dict`): the run's identity (methods, settings, prompts' fingerprint), the provenance's `run`.
        resume (`bool`): keep the complete batches of the records already in `path`; otherwise `path` is
            overwritten.

    Raises:
        `ValueError`: resuming a file written by another run (naming what differs), or one that holds lines that
            are not records (a cut last line, as a killed process leaves, is dropped).
    """

    def __init__(self, path: str | Path | None, run: dict, resume: bool):
        self.path, self.run, self.resume = None if path is None else Path(path), run, resume
        self.done: list[dict] = []
        self._file = None

    def __enter__(self) -> "RecordWriter":
        if self.path is None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.resume and self.path.is_file():
            self.done = self._complete_batches(self._read())
        text = "".join(json.dumps(record) + "\n" for record in self.done)
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, self.path)  # the kept records replace the file at once: never half of them
        self._file = open(self.path, "a", encoding="utf-8")
        return self

    def __exit__(self, *exc_info) -> None:
        if self._file is not None:
            self._file.close()

    def write(self, record: dict) -> None:
        """Appends one record and flushes it to the file."""
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def _read(self) -> list[dict]:
        lines = self.path.read_text(encoding="utf-8").splitlines()
        records = []
        for number, line in enumerate(lines, 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if number == len(lines):  # the line a killed process was writing
                    break
                raise ValueError(f"{self.path}:{number}: not a JSON record; cannot resume from this file: pass "
                                 "another --out (out_path) or drop --resume.") from None
        for record in records:
            theirs = record.get("provenance", {}).get("run") if isinstance(record, dict) else None
            if theirs != self.run:
                differs = sorted(k for k in self.run if not isinstance(theirs, dict) or theirs.get(k) != self.run[k])
                raise ValueError(
                    f"{self.path} was written by another run (its {', '.join(differs) or 'records'} differ): resume "
                    "with the same methods, settings and prompts, or pass another --out (out_path)."
                )
        return records

    @staticmethod
    def _complete_batches(records: list[dict]) -> list[dict]:
        """The records of the batches for which every method has a record of every row."""
        expected = {label for label in records[0]["provenance"]["run"]["methods"]} | {"plain"} if records else set()
        expected -= set(records[0]["provenance"]["run"]["skipped_methods"]) if records else set()
        by_batch: dict[int, list[dict]] = {}
        for record in records:
            by_batch.setdefault(record["batch_index"], []).append(record)
        return [r for group in by_batch.values() if len(group) == len(expected) * group[0]["batch_rows"]
                for r in group]


def _run_batches(target, prompts, batches: list[Batch], kwargs, settings: BenchSettings, provenance,
                 writer: RecordWriter) -> list[dict]:
    """Warms every method up on the first batch, then runs all methods back to back on each batch not recorded yet,
    writing each record as soon as it is measured; returns the resumed records and the new ones."""
    records = list(writer.done)
    done = {r["batch_index"] for r in records}
    todo = [(index, batch) for index, batch in enumerate(batches) if index not in done]
    if todo:
        for method_kwargs in kwargs.values():  # warm-up, untimed and unrecorded
            _timed_generate(target, todo[0][1], method_kwargs, settings)
    progress = tqdm(todo, desc="bench", unit="batch" if settings.batch_size > 1 else "prompt",
                    disable=not settings.verbose)
    for batch_index, batch in progress:
        plain = None
        for label, method_kwargs in kwargs.items():
            rows = _timed_generate(target, batch, method_kwargs, settings)
            plain = rows if plain is None else plain
            for row, index in enumerate(batch.indices):
                record = _record(prompts[index], index, label, rows[row], plain[row], batch, row, batch_index,
                                 provenance, settings.do_sample)
                record["divergence"] = _divergence(target, batch, row, rows[row], plain[row], record["exact"])
                writer.write(record)
                records.append(record)
    return records


def _batch_fields(batch_index: int, batch: Batch, run: _Run) -> dict:
    """The batch fields of a record of a batched run (module docstring)."""
    return {"batch_index": batch_index, "batch_rows": len(batch.indices),
            "batch_seconds": run.seconds * len(batch.indices), "batch_pad_tokens": batch.num_pad_tokens}


def _finish(records: list[dict], verbose: bool, skipped: dict[str, str]) -> BenchmarkResult:
    mismatches = [r for r in records if r["divergence"] == "mismatch"]
    near_ties = [r for r in records if r["divergence"] == "near-tie"]
    result = BenchmarkResult(records, summarize(records), mismatches, skipped, near_ties)
    if verbose:
        print(result.table())
        for r in mismatches + near_ties:
            kind = "MISMATCH" if r in mismatches else "NEAR-TIE (not a failure)"
            print(f"{kind}: {r['method']} differs from plain greedy on prompt {r['prompt_index']} "
                  f"(question_id={r['question_id']}, category={r['category']})")
    return result
