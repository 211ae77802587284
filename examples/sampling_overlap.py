"""What a draft can be accepted at under sampling: the demo draft model against the demo target, offline.

At each position of texts sampled from the target at `--temperature`, with p the target's distribution and q the
draft's (both at that temperature unless said otherwise), prints the mean over positions of:

- the acceptance of one sampled draft token, `sum(min(p, q))` (Leviathan et al. 2023), and of the same with the
  draft's logits at other temperatures (any q keeps rejection sampling lossless: the draft temperature is a free
  choice);
- the acceptance of two sampled candidates at one position, the second drawn from q without the first, verified by
  recursive rejection sampling (`RejectionVerifier` over siblings; Jeon et al. 2024): the first is accepted with
  `min(1, p/q)`, else the second with `min(1, r/q')`, r the residual `norm(max(0, p - q))`, q' = q without the first;
- the acceptance of the draft's k most likely tokens as deterministic siblings (EAGLE's and `TreeDrafter`'s): the
  target's mass on them, `sum(p[top_k(q)])`.

    python examples/sampling_overlap.py --prompts 13 --max-new-tokens 64 --temperature 0.7 [--draft FOLDER]
"""

import argparse

import torch

from hf_speculators.loading import load_model, load_tokenizer, resolve_model_id
from hf_speculators.prompts import load_prompts

DRAFT_TEMPERATURE_FACTORS = (0.8, 0.9, 1.0, 1.1, 1.2)  # the draft's temperature over the target's
FIRST_CANDIDATES = 64  # the first candidate is summed over q's most likely tokens (most of its mass)


def two_candidate_acceptance(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> float:
    """The chance that one of two candidates drawn from `draft_probs` `(vocab,)` without replacement is accepted by
    recursive rejection sampling against `target_probs` `(vocab,)`, the first summed over its likeliest values."""
    first_accept = (target_probs / draft_probs).clamp(max=1.0)  # [vocab]
    residual = (target_probs - draft_probs).clamp(min=0.0)
    residual = residual / residual.sum() if residual.sum() > 0 else residual
    firsts = draft_probs.topk(FIRST_CANDIDATES).indices
    total = mass = 0.0
    for first in firsts.tolist():
        second_probs = draft_probs.clone()
        second_probs[first] = 0.0
        second_probs = second_probs / second_probs.sum()
        second_accept = torch.minimum(residual, second_probs).sum()
        total += float(draft_probs[first] * (first_accept[first] + (1 - first_accept[first]) * second_accept))
        mass += float(draft_probs[first])
    return total / mass


def position_figures(target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float) -> dict:
    """Per position (rows of the logits `(positions, vocab)`), the acceptance figures of the module docstring."""
    target_probs = (target_logits / temperature).softmax(-1)
    draft_probs = (draft_logits / temperature).softmax(-1)
    figures = {f"one sampled, draft temperature {factor:.1f}x": torch.minimum(
        target_probs, (draft_logits / (temperature * factor)).softmax(-1)).sum(-1) for factor in
        DRAFT_TEMPERATURE_FACTORS}
    figures["two sampled without replacement"] = torch.tensor(
        [two_candidate_acceptance(p, q) for p, q in zip(target_probs, draft_probs)])
    top = draft_probs.topk(4, dim=-1).indices
    for k in (1, 2, 4):
        figures[f"top {k} of the draft, deterministic"] = target_probs.gather(-1, top[:, :k]).sum(-1)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=13, help="Spec-Bench prompts, round-robin over the categories")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--draft", default="hf_speculators/demo-draft", help="the draft model (an id or a folder)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    target = load_model(resolve_model_id("hf_speculators/demo-target"))
    draft = load_model(resolve_model_id(args.draft))
    tokenizer = load_tokenizer(resolve_model_id("hf_speculators/demo-target"))
    sums, count = {}, 0
    for question in load_prompts("spec-bench", args.prompts):  # the bench's --limit prompts
        prompt = tokenizer(question.text, return_tensors="pt").input_ids[:, -300:]
        with torch.no_grad():
            text = target.generate(prompt, do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
                                   max_new_tokens=args.max_new_tokens, pad_token_id=0)
            span = slice(prompt.shape[1] - 1, -1)  # the logits that predicted each new token
            figures = position_figures(target(text).logits[0, span], draft(text).logits[0, span], args.temperature)
        for name, values in figures.items():
            sums[name] = sums.get(name, 0.0) + float(values.sum())
        count += len(next(iter(figures.values())))
    print(f"{count} positions, temperature {args.temperature}: acceptance at one position")
    for name, total in sums.items():
        print(f"  {name:45s} {total / count:.3f}")


if __name__ == "__main__":
    main()
