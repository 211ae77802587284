"""The fidelity/acceptance sweep of the relaxed verifiers: what each setting gains, and what it loses.

`run_sweep` runs speculative decoding on the same prompts with one drafter and each verifier setting, the lossless
one first (exact verification, whose output is plain greedy output; rejection sampling under sampling), and measures per setting: mean acceptance
length, tokens/s, the target's mean log-likelihood of the produced tokens relative to the exact output's, and the
share of tokens identical to the exact output (position by position).

Record format (with `out_path`, one JSON object per (prompt, setting), written as soon as it is measured):

    prompt_index, verifier                    which prompt (0-based) and which setting (the verifier's repr)
    new_tokens, seconds                       tokens generated and wall-clock seconds of the generate call
    num_drafts, num_accepted_tokens           from `SpeculativeStats`
    log_likelihood                            sum of the target's log-probabilities of the new tokens (nats)
    identical_tokens, exact_tokens            positions equal to the reference output's, and its length
    batch_index, batch_rows, provenance       the prompt again and 1 (as `RecordWriter` resumes), and the run:
                                              settings, verifiers, drafter and prompts' fingerprint
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..decoding import generate
from ..drafters import Drafter
from ..prompts import Prompt, encode_truncated, prompt_budget, prompts_fingerprint, use_chat_template
from .bench import BenchSettings, RecordWriter
from .bench.timing import timed_generate_one, torch_threads
from ..verifiers import ExactVerifier, RejectionVerifier, TopKVerifier, TypicalVerifier, Verifier
from .plots import pyplot

SUMMED_FIELDS = ("new_tokens", "seconds", "num_drafts", "num_accepted_tokens", "log_likelihood", "identical_tokens",
                 "exact_tokens")
DEFAULT_TYPICAL_EPSILONS = (0.01, 0.03, 0.09, 0.2, 0.4)
DEFAULT_TOP_K_SETTINGS = ((2, 0.5), (2, 1.0), (3, 1.0), (3, 2.0), (5, 3.0))
_AXIS_LABELS = {
    "mean_acceptance_length": "mean acceptance length (tokens per draft)",
    "tokens_per_s": "tokens/s",
    "relative_log_likelihood": "target log-likelihood vs exact output (nats/token)",
    "identical_share": "share of tokens identical to the exact output",
}


def default_verifiers(typical_settings: Sequence[float | tuple[float, float]] = DEFAULT_TYPICAL_EPSILONS,
                      top_k_settings: Sequence[tuple[int, float]] = DEFAULT_TOP_K_SETTINGS) -> list[Verifier]:
    """Exact verification, then `TypicalVerifier` per typical setting and `TopKVerifier(k, tolerance)` per pair.

    A typical setting is `epsilon` (delta = sqrt(epsilon), Medusa's default) or an `(epsilon, delta)` pair.
    """
    typical = [TypicalVerifier(*setting) if isinstance(setting, tuple) else TypicalVerifier(setting)
               for setting in typical_settings]
    return [ExactVerifier(), *typical, *(TopKVerifier(top_k, tolerance) for top_k, tolerance in top_k_settings)]


@dataclass(frozen=True)
class SweepPoint:
    """The figures of one verifier setting, pooled over all prompts.

    Attributes:
        verifier (`str`): the setting, e.g. `"TypicalVerifier(epsilon=0.09, delta=0.3)"`.
        mean_acceptance_length (`float`): tokens per draft, bonus included (`SpeculativeStats` convention).
        tokens_per_s (`float`): total new tokens over total seconds.
        log_likelihood (`float`): the target's mean log-probability per produced token, in nats.
        relative_log_likelihood (`float`): `log_likelihood` minus the exact output's (0 for exact; < 0: less likely).
        identical_share (`float`): share of the exact output's positions where this output has the same token.
    """

    verifier: str
    mean_acceptance_length: float
    tokens_per_s: float
    log_likelihood: float
    relative_log_likelihood: float
    identical_share: float


@torch.no_grad()
def _log_likelihood(target, input_ids: torch.LongTensor, new_ids: torch.LongTensor) -> float:
    """Sum of the target's log-probabilities of `new_ids` `(n,)` after `input_ids` `(1, prompt_tokens)`."""
    sequence = torch.cat([input_ids, new_ids[None].to(input_ids.device)], dim=-1)
    logits = target(input_ids=sequence).logits[0, input_ids.shape[1] - 1 : -1].float()  # [n, vocab]
    log_probs = torch.log_softmax(logits, dim=-1)
    return float(log_probs.gather(-1, new_ids[:, None].to(log_probs.device)).sum())


def _record(index: int, verifier: Verifier, run, reference_ids: torch.LongTensor, log_likelihood: float,
            run_key: dict) -> dict:
    length = min(len(run.new_ids), len(reference_ids))
    return {
        "prompt_index": index,
        "verifier": repr(verifier),
        "new_tokens": len(run.new_ids),
        "seconds": run.seconds,
        "num_drafts": run.stats.num_drafts,
        "num_accepted_tokens": run.stats.num_accepted_tokens,
        "log_likelihood": log_likelihood,
        "identical_tokens": int((run.new_ids[:length] == reference_ids[:length]).sum()),
        "exact_tokens": len(reference_ids),
        "batch_index": index,  # one prompt per generate call; RecordWriter resumes by batch
        "batch_rows": 1,
        "provenance": {"run": run_key},
    }


def _point(records: list[dict], exact_log_likelihood: float | None) -> SweepPoint:
    total = {key: sum(r[key] for r in records) for key in SUMMED_FIELDS}
    log_likelihood = total["log_likelihood"] / max(total["new_tokens"], 1)
    reference = log_likelihood if exact_log_likelihood is None else exact_log_likelihood
    return SweepPoint(
        verifier=records[0]["verifier"],
        mean_acceptance_length=1 + total["num_accepted_tokens"] / total["num_drafts"] if total["num_drafts"] else 1.0,
        tokens_per_s=total["new_tokens"] / total["seconds"],
        log_likelihood=log_likelihood,
        relative_log_likelihood=log_likelihood - reference,
        identical_share=total["identical_tokens"] / max(total["exact_tokens"], 1),
    )


def run_sweep(
    target,
    tokenizer,
    prompts: Sequence[Prompt | str],
    drafter: Drafter,
    verifiers: Sequence[Verifier] | None = None,
    settings: BenchSettings | None = None,
) -> list[SweepPoint]:
    """Runs speculative decoding with `drafter` and each verifier on every prompt and pools the figures.

    Each setting is warmed up once on the first prompt; then, prompt by prompt, the settings run back to back from
    the same seed, and each record is written as soon as it is measured (`settings.out_path`; `settings.resume`
    continues an interrupted sweep). Log-likelihoods come from one extra target forward per output, outside the
    timed call. The reference is the lossless verifier of the decoding mode: exact verification (plain greedy
    output) or, under `settings.do_sample`, rejection sampling.

    Args:
        target (`PreTrainedModel`): the causal LM.
        tokenizer (`PreTrainedTokenizerBase`): its tokenizer.
        prompts (`Sequence[Prompt | str]`): the prompts (e.g. from `load_prompts`).
        drafter (`Drafter`): the drafter every setting uses (e.g. `make_drafter("draft-model-tree", draft)`).
        verifiers (`Sequence[Verifier]`, *optional*): the settings; defaults to `default_verifiers()`. The
            reference verifier is put first (added if missing).
        settings (`BenchSettings`, *optional*): lengths, sampling, prompts, threads and records, as for
            `run_benchmark` (`batch_size` must be 1); defaults to `BenchSettings()`.

    Returns:
        `list[SweepPoint]`, one per setting, the reference first.

    Raises:
        `ValueError`: no prompts, `batch_size` above 1, `chat_template=True` or `system_prompt` without a chat
            template, `resume` with the records of another sweep, or what `generate` raises for the drafter or a
            setting.
    """
    settings = BenchSettings() if settings is None else settings
    if settings.batch_size != 1:
        raise ValueError(f"the sweep runs prompt by prompt: batch_size must be 1, got {settings.batch_size}.")
    reference = RejectionVerifier if settings.do_sample else ExactVerifier
    verifiers = list(default_verifiers() if verifiers is None else verifiers)
    verifiers = [v for v in verifiers if not isinstance(v, ExactVerifier) or not settings.do_sample]
    if not any(isinstance(v, reference) for v in verifiers):
        verifiers.insert(0, reference())
    verifiers.sort(key=lambda v: not isinstance(v, reference))  # the reference output: first
    chat_template = use_chat_template(tokenizer, settings.chat_template, settings.system_prompt)
    prompts = [Prompt(p) if isinstance(p, str) else p for p in prompts]
    if not prompts:
        raise ValueError("No prompts to sweep: pass at least one (see load_prompts).")
    budget = prompt_budget((target,), settings.max_prompt_tokens, settings.max_new_tokens)
    encoded = [encode_truncated(tokenizer, p.text, chat_template, budget, target.device, settings.system_prompt)[0]
               for p in prompts]
    kwargs = {v: {"custom_generate": generate, "candidate_generator": drafter, "verifier": v} for v in verifiers}
    run_key = json.loads(json.dumps({
        "settings": settings.recorded(), "methods": {repr(v): {} for v in verifiers}, "drafter": repr(drafter),
        "prompts": prompts_fingerprint(prompts), "skipped_methods": {}}))
    with torch_threads(settings.num_threads), RecordWriter(settings.out_path, run_key, settings.resume) as writer:
        done = {r["prompt_index"] for r in writer.done}
        records: dict[str, list[dict]] = {repr(v): [r for r in writer.done if r["verifier"] == repr(v)]
                                          for v in verifiers}
        todo = [index for index in range(len(prompts)) if index not in done]
        for verifier_kwargs in kwargs.values() if todo else ():  # warm-up, untimed
            timed_generate_one(target, encoded[todo[0]], verifier_kwargs, settings)
        for index in todo:
            reference_ids = None
            for verifier, verifier_kwargs in kwargs.items():
                run = timed_generate_one(target, encoded[index], verifier_kwargs, settings)
                reference_ids = run.new_ids if reference_ids is None else reference_ids
                log_likelihood = _log_likelihood(target, encoded[index], run.new_ids)
                record = _record(index, verifier, run, reference_ids, log_likelihood, run_key)
                writer.write(record)
                records[repr(verifier)].append(record)
    first = _point(records[repr(verifiers[0])], None)
    return [first] + [_point(records[repr(v)], first.log_likelihood) for v in verifiers[1:]]


def sweep_table(points: Sequence[SweepPoint]) -> str:
    """The sweep as a plain-text table, one row per setting."""
    header = (f"{'verifier':<48}{'accept len':>11}{'tokens/s':>10}{'log-lik':>9}{'vs exact':>10}"
              f"{'identical':>11}")
    rows = [header] + [
        f"{p.verifier:<48}{p.mean_acceptance_length:>11.2f}{p.tokens_per_s:>10.1f}{p.log_likelihood:>9.3f}"
        f"{p.relative_log_likelihood:>+10.3f}{p.identical_share:>11.1%}" for p in points
    ]
    return "\n".join(rows)


def plot_sweep(points: Sequence[SweepPoint], path: str | Path) -> None:
    """Saves the trade-off as a figure: fidelity (log-likelihood vs exact, identical share) against acceptance length.

    Raises:
        `ImportError`: without matplotlib (`pip install "hf_speculators[plot]"`).
    """
    plt = pyplot()
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    panels = [("mean_acceptance_length", "relative_log_likelihood"), ("mean_acceptance_length", "identical_share"),
              ("tokens_per_s", "relative_log_likelihood")]
    for axis, (x_field, y_field) in zip(axes, panels):
        for family, marker in (("Exact", "*"), ("Typical", "o"), ("TopK", "s")):
            chosen = [p for p in points if p.verifier.startswith(family)]
            xs, ys = [getattr(p, x_field) for p in chosen], [getattr(p, y_field) for p in chosen]
            axis.scatter(xs, ys, marker=marker, label=family)
            for p, x, y in zip(chosen, xs, ys):
                label = p.verifier[p.verifier.index("(") + 1 : -1]
                axis.annotate(label, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        axis.set_xlabel(_AXIS_LABELS[x_field])
        axis.set_ylabel(_AXIS_LABELS[y_field])
        axis.grid(alpha=0.3)
    axes[0].legend()
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=150)
    plt.close(figure)
