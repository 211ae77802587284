"""The benchmark's run: `run_benchmark` warms every method up, then runs all of them back to back on each batch of
prompts, checks every exact method against plain greedy decoding and writes each record as soon as it is measured."""

import json
from contextlib import ExitStack, nullcontext
from typing import Mapping, Sequence

import torch
import transformers
from packaging import version
from torch._dynamo.utils import counters
from tqdm.auto import tqdm

from ...config import SpeculativeConfig
from ...config.methods import LOADED_DRAFT
from ...config.registry import METHOD_SPECS
from ...prompts import Prompt, encode_truncated, prompt_budget, prompts_fingerprint, use_chat_template
from .batches import Batch, batch_skip_reason, make_batches, pad_token
from .engines import compiled_kwargs, generate_kwargs, pinned_assistant_config
from .records import RecordWriter, build_record, run_provenance
from .settings import BenchMethod, BenchSettings, baseline_of
from .summaries import BenchmarkResult, summarize
from .timing import TimedRun, timed_generate, torch_threads


COMPILED_PLAIN = "plain-compiled"  # transformers' plain decoding, compiled (`BenchSettings.compile`)
# whether transformers' assisted decoding takes a static cache (from 5.24 on; 5.23 raises a ValueError)
STATIC_ASSISTED = version.parse(transformers.__version__) >= version.parse("5.24")
MAX_WARM_UPS = 3  # untimed calls per compiled method and batch, at most (`_compiled_warm_up`)


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
            `LOADED_DRAFT` or transformers' assisted method without `draft`, what `build_drafter` and
            `resolve_verifier` raise for a config, a batch size above 1 with a tokenizer that has neither a pad nor an
            EOS token, `chat_template=True` or `system_prompt` without a chat template, a prompt of no tokens,
            `max_new_tokens` at or over the position limit, or `resume` with a records file of another run.
    """
    settings = BenchSettings() if settings is None else settings
    methods = {label: m if isinstance(m, BenchMethod) else BenchMethod(m) for label, m in methods.items()}
    if {"plain", COMPILED_PLAIN} & set(methods):
        raise ValueError(f"'plain' (and '{COMPILED_PLAIN}' with compile=True) always run as the baselines: do not "
                         "pass them among the methods.")
    needs_draft = [label for label, m in methods.items() if m.config.draft_model == LOADED_DRAFT
                   or (m.engine == "transformers" and METHOD_SPECS[m.config.method].loads == "draft-model")]
    if needs_draft and draft is None:
        raise ValueError(f"Methods {needs_draft} need a draft model: pass draft= (the loaded model) or drop them.")
    chat_template = use_chat_template(tokenizer, settings.chat_template, settings.system_prompt)
    prompts = [Prompt(p) if isinstance(p, str) else p for p in prompts]
    if not prompts:
        raise ValueError("No prompts to benchmark: pass at least one (see load_prompts).")
    if settings.batch_size > 1 and pad_token(tokenizer) is None:
        raise ValueError("batch_size > 1 pads the prompts: give the tokenizer a pad_token or an eos_token.")
    budget = prompt_budget((target, draft), settings.max_prompt_tokens, settings.max_new_tokens)
    encoded = [encode_truncated(tokenizer, p.text, chat_template, budget, target.device, settings.system_prompt)
               for p in prompts]
    batches = make_batches(encoded, settings.batch_size, pad_token(tokenizer))
    compiled = compiled_kwargs(target) if settings.compile else None
    kwargs = {"plain": {}} | ({COMPILED_PLAIN: compiled} if compiled else {}) | {
        label: generate_kwargs(m, target, draft, settings.do_sample, tokenizer, draft_tokenizer)
        | ({} if m.eager else compiled or {}) for label, m in methods.items()}
    skipped = {label: reason for label, kw in kwargs.items() if settings.batch_size > 1
               for reason in [batch_skip_reason(kw)] if reason is not None}
    if compiled and not STATIC_ASSISTED:
        skipped |= {label: "transformers before 5.24 refuses static caches in assisted decoding (--compile)"
                    for label, m in methods.items() if m.engine == "transformers"}
    kwargs = {label: kw for label, kw in kwargs.items() if label not in skipped}
    run = {"settings": {**settings.recorded(), "max_prompt_tokens": budget, "chat_template": chat_template},
           "methods": {label: {"engine": m.engine, **({} if m.plain_floor is None else {"plain_floor": m.plain_floor}),
                               **({"eager": True} if m.eager else {}),
                               **m.config.to_dict()} for label, m in methods.items()},
           "prompts": prompts_fingerprint(prompts), "skipped_methods": skipped}
    with ExitStack() as stack:
        stack.enter_context(torch_threads(settings.num_threads))
        for label, m in methods.items():
            if m.engine == "transformers" and baseline_of(m).pinned:
                # the assistant the method runs (its own copy for universal speculative decoding), else the target
                assistant = kwargs.get(label, {}).get("assistant_model", target)
                stack.enter_context(pinned_assistant_config(assistant, m.config.resolved("num_draft_tokens"),
                                                            m.config.confidence_threshold or 0.0))
        provenance = run_provenance(target, draft, json.loads(json.dumps(run)))
        writer = stack.enter_context(RecordWriter(settings.out_path, provenance["run"], settings.resume))
        records = _run_batches(target, prompts, batches, kwargs, settings, provenance, writer)
    return _finish(records, settings.verbose, skipped)


def _run_batches(target, prompts, batches: list[Batch], kwargs, settings: BenchSettings, provenance,
                 writer: RecordWriter) -> list[dict]:
    """Warms every method up on the first batch, then runs all methods back to back on each batch not recorded yet,
    writing each record as soon as it is measured; returns the resumed records and the new ones.

    With `settings.compile` every method is warmed up on every batch (untimed, `_compiled_warm_up`), so that the
    timed calls measure compiled decoding, not compilation."""
    records = list(writer.done)
    done = {r["batch_index"] for r in records}
    todo = [(index, batch) for index, batch in enumerate(batches) if index not in done]
    if todo and not settings.compile:  # compiled runs warm up on every batch (below)
        for method_kwargs in kwargs.values():  # warm-up, untimed and unrecorded
            timed_generate(target, todo[0][1], method_kwargs, settings)
            if "candidate_generator" in method_kwargs:  # the first batch must not draft from its own warm-up output
                method_kwargs["candidate_generator"].clear_cache()
    progress = tqdm(todo, desc="bench", unit="batch" if settings.batch_size > 1 else "prompt",
                    disable=not settings.verbose)
    for batch_index, batch in progress:
        if settings.compile:
            for method_kwargs in kwargs.values():
                _compiled_warm_up(target, batch, method_kwargs, settings)
        plain = None
        for label, method_kwargs in kwargs.items():
            rows = timed_generate(target, batch, method_kwargs, settings)
            plain = rows if plain is None else plain
            for row, index in enumerate(batch.indices):
                record = build_record(prompts[index], index, label, rows[row], plain[row], batch, row, batch_index,
                                      provenance, settings.do_sample)
                record["divergence"] = _divergence(target, batch, row, rows[row], plain[row], record["exact"])
                writer.write(record)
                records.append(record)
    return records


def _compiled_warm_up(target, batch: Batch, method_kwargs: dict, settings: BenchSettings) -> None:
    """Untimed calls of a compiled method on `batch` itself until one compiles no new graph (at most
    `MAX_WARM_UPS`), so that its timed call on the batch compiles none either: transformers' plain compiled decoding
    compiles again whenever a longer prompt grows its static cache, its assisted decoding for every new verify
    length, ours once per cache length bucket, and a drafter for each kind of step it takes (a full greedy chain,
    a shorter draft, a catch-up): which it takes reads the clock (the plain-speed floor), so a warm-up whose own
    steps compiled may take other steps than the timed call, and random tokens, which no draft matches, take few.
    The calls leave the drafters' memory across calls as it was (`Drafter.memory_kept`: neither the batch's text for
    suffix decoding nor, for the hybrid, their model floor's measurements): no drafter has seen the text before its
    timed call."""
    drafter = method_kwargs.get("candidate_generator")
    for _ in range(MAX_WARM_UPS):
        graphs = counters["stats"]["unique_graphs"]
        with nullcontext() if drafter is None else drafter.memory_kept():
            timed_generate(target, batch, method_kwargs, settings)
        if counters["stats"]["unique_graphs"] == graphs:
            return


@torch.no_grad()
def _divergence(target, batch: Batch, row: int, run: TimedRun, plain: TimedRun, exact: bool) -> str | None:
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
