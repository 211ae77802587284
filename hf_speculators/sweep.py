"""The fidelity/acceptance sweep of the relaxed verifiers: what each setting gains, and what it loses.

`run_sweep` runs greedy speculative decoding on the same prompts with one drafter and each verifier setting, the
exact verifier first (its output is plain greedy output, the reference), and measures per setting: mean acceptance
length, tokens/s, the target's mean log-likelihood of the produced tokens relative to the exact output's, and the
share of tokens identical to the exact output (position by position).

Record format (with `out_path`, one JSON object per (prompt, setting)):

    prompt_index, verifier                    which prompt (0-based) and which setting (the verifier's repr)
    new_tokens, seconds                       tokens generated and wall-clock seconds of the generate call
    num_drafts, num_accepted_tokens           from `SpeculativeStats`
    log_likelihood                            sum of the target's log-probabilities of the new tokens (nats)
    identical_tokens, exact_tokens            positions equal to the exact output's, and its length
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .benchmark import Prompt, _encode, _num_threads, _prompt_budget, _timed_generate_one
from .chat import use_chat_template
from .decoding import generate
from .drafters import Drafter
from .plotting import pyplot
from .verifiers import ExactVerifier, TopKVerifier, TypicalVerifier, Verifier

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


def _record(index: int, verifier: Verifier, run, exact_ids: torch.LongTensor, log_likelihood: float) -> dict:
    length = min(len(run.new_ids), len(exact_ids))
    return {
        "prompt_index": index,
        "verifier": repr(verifier),
        "new_tokens": len(run.new_ids),
        "seconds": run.seconds,
        "num_drafts": run.stats.num_drafts,
        "num_accepted_tokens": run.stats.num_accepted_tokens,
        "log_likelihood": log_likelihood,
        "identical_tokens": int((run.new_ids[:length] == exact_ids[:length]).sum()),
        "exact_tokens": len(exact_ids),
    }


def _point(records: list[dict], exact_log_likelihood: float | None) -> SweepPoint:
    total = {key: sum(r[key] for r in records) for key in records[0] if key not in ("prompt_index", "verifier")}
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
    max_new_tokens: int = 128,
    out_path: str | Path | None = None,
    *,
    max_prompt_tokens: int = 1024,
    chat_template: bool | None = False,
    system_prompt: str | None = None,
    num_threads: int | None = 1,
) -> list[SweepPoint]:
    """Runs greedy speculative decoding with `drafter` and each verifier on every prompt and pools the figures.

    Each setting is warmed up once on the first prompt; then, prompt by prompt, the settings run back to back.
    Log-likelihoods come from one extra target forward per output, outside the timed call.

    Args:
        target (`PreTrainedModel`): the causal LM.
        tokenizer (`PreTrainedTokenizerBase`): its tokenizer.
        prompts (`Sequence[Prompt | str]`): the prompts (e.g. from `load_prompts`).
        drafter (`Drafter`): the drafter every setting uses (e.g. `make_drafter("draft-model-tree", draft)`).
        verifiers (`Sequence[Verifier]`, *optional*): the settings; defaults to `default_verifiers()`. An
            `ExactVerifier` is put first if missing: its output is the reference.
        max_new_tokens (`int`, defaults to 128): tokens per call.
        out_path (`str` or `Path`, *optional*): JSONL file for the per-(prompt, setting) records.
        max_prompt_tokens, chat_template, system_prompt, num_threads: as for `run_benchmark`.

    Returns:
        `list[SweepPoint]`, one per setting, exact first.

    Raises:
        `ValueError`: no prompts, `chat_template=True` or `system_prompt` without a chat template, or what
            `generate` raises for the drafter or a setting.
    """
    verifiers = list(default_verifiers() if verifiers is None else verifiers)
    if not any(isinstance(v, ExactVerifier) for v in verifiers):
        verifiers.insert(0, ExactVerifier())
    verifiers.sort(key=lambda v: not isinstance(v, ExactVerifier))  # the exact output is the reference: first
    chat_template = use_chat_template(tokenizer, chat_template, system_prompt)
    prompts = [Prompt(p) if isinstance(p, str) else p for p in prompts]
    if not prompts:
        raise ValueError("No prompts to sweep: pass at least one (see load_prompts).")
    budget = _prompt_budget((target,), max_prompt_tokens, max_new_tokens)
    encoded = [_encode(tokenizer, p.text, chat_template, budget, target.device, system_prompt)[0] for p in prompts]
    kwargs = {v: {"custom_generate": generate, "candidate_generator": drafter, "verifier": v} for v in verifiers}
    records: dict[Verifier, list[dict]] = {v: [] for v in verifiers}
    with _num_threads(num_threads):
        for verifier_kwargs in kwargs.values():  # warm-up, untimed
            _timed_generate_one(target, encoded[0], verifier_kwargs, max_new_tokens)
        for index, input_ids in enumerate(encoded):
            runs = {v: _timed_generate_one(target, input_ids, kw, max_new_tokens) for v, kw in kwargs.items()}
            exact_ids = runs[verifiers[0]].new_ids
            for verifier, run in runs.items():
                records[verifier].append(
                    _record(index, verifier, run, exact_ids, _log_likelihood(target, input_ids, run.new_ids)))
    if out_path is not None:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps(record) + "\n" for runs in records.values() for record in runs]
        Path(out_path).write_text("".join(lines), encoding="utf-8")
    exact = _point(records[verifiers[0]], None)
    return [exact] + [_point(records[v], exact.log_likelihood) for v in verifiers[1:]]


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
