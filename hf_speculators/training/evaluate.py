"""Measured acceptance: a drafter run through `model.generate(custom_generate=hf_speculators.generate)` on prompts.

Training chooses its checkpoints with this (acceptance, not loss: EAGLE-3 over-trains, its acceptance peaks while the
loss keeps falling, deepseek-ai/DeepSpec#84) and `hf-speculators evaluate` reports it.
"""

from dataclasses import dataclass

import torch

from ..decoding import generate as speculative_generate
from ..metrics import SpeculativeStats


def pad_id(tokenizer) -> int:
    """The id that pads batches: the tokenizer's padding token, else its EOS token, else 0 (padded positions are
    masked out of attention and of the loss, so any id serves)."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return token_id
    return 0


@dataclass(frozen=True)
class Acceptance:
    """Acceptance of a drafter over prompts, pooled over every verification step.

    Attributes:
        mean_acceptance_length (`float`): tokens per draft, the bonus token included (vLLM's convention; at most
            k + 1 for a chain of k).
        per_position (`list[float]`): entry i: how often a draft token at position (tree: depth) i was accepted.
        num_prompts (`int`), num_generated_tokens (`int`): what was measured.
    """

    mean_acceptance_length: float
    per_position: list[float]
    num_prompts: int
    num_generated_tokens: int

    def summary(self) -> str:
        positions = " ".join(f"{rate:.2f}" for rate in self.per_position)
        return (f"mean acceptance length {self.mean_acceptance_length:.2f}, acceptance per position {positions} "
                f"({self.num_prompts} prompts, {self.num_generated_tokens} tokens)")


@torch.no_grad()
def measure_acceptance(target, drafter, prompts: list[list[int]], max_new_tokens: int = 64,
                       verifier=None, **generate_kwargs) -> Acceptance:
    """Runs greedy speculative generation of `target` with `drafter` on each prompt and pools the acceptance.

    Args:
        target (`PreTrainedModel`): the target model.
        drafter (`Drafter`): e.g. `EagleDrafter(head)`, `MedusaDrafter(heads)`, `DraftModelDrafter(draft)`.
        prompts (`list[list[int]]`): prompt token ids (a chat template already applied).
        max_new_tokens (`int`, defaults to 64): tokens generated per prompt.
        verifier (`str` or `Verifier`, *optional*): default exact (greedy).
        generate_kwargs: more arguments of `generate` (e.g. `pad_token_id`).

    Returns:
        `Acceptance`.

    Raises:
        `ValueError`: no prompt.
    """
    if not prompts:
        raise ValueError("No prompt to measure acceptance on.")
    total = SpeculativeStats()
    for ids in prompts:
        input_ids = torch.tensor([ids], device=target.device)
        out = target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                              custom_generate=speculative_generate, candidate_generator=drafter, verifier=verifier,
                              max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True,
                              plain_floor=False, **generate_kwargs)  # every step drafts: acceptance, not speed
        total.add(out.speculative_stats)
    return Acceptance(total.mean_acceptance_length, total.acceptance_rate_per_position, len(prompts),
                      total.num_generated_tokens)


def acceptance_evaluator(target, make_drafter, prompts: list[list[int]], max_new_tokens: int = 64, **generate_kwargs):
    """`evaluate(model) -> Acceptance` for `hf_speculators.training.loop.fit`: `measure_acceptance` of the drafter
    `make_drafter(model)` (e.g. `lambda head: EagleDrafter(head, num_draft_tokens=3)`) on held-out `prompts`."""

    def evaluate(model):
        return measure_acceptance(target, make_drafter(model), prompts, max_new_tokens, **generate_kwargs)

    return evaluate
