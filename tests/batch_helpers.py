"""Helpers shared by the batch tests: left-padded batches, batched speculative generate, expected row layouts."""

from collections.abc import Sequence

import torch

import hf_speculators as hs
from tiny_models import VOCAB_SIZE

PAD = VOCAB_SIZE - 1  # the pad token of every batch test (no tiny model has one of its own)
MAX_NEW_TOKENS = 24


def left_padded(prompts: Sequence[Sequence[int]]) -> tuple[torch.LongTensor, torch.LongTensor]:
    """`(input_ids, attention_mask)`, both `(len(prompts), longest)`: the token lists `prompts` left-padded with PAD."""
    width = max(map(len, prompts))
    input_ids = torch.tensor([[PAD] * (width - len(p)) + list(p) for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return input_ids, attention_mask


def batched_generate(model, drafter, prompts: Sequence[Sequence[int]], **kwargs):
    """Speculative greedy `generate` on the left-padded `prompts` (a `SpeculativeGenerateOutput`); `kwargs` win."""
    input_ids, attention_mask = left_padded(prompts)
    kwargs = {"do_sample": False, "max_new_tokens": MAX_NEW_TOKENS, "pad_token_id": PAD, **kwargs}
    return model.generate(input_ids, attention_mask=attention_mask, custom_generate=hs.generate,
                          candidate_generator=drafter, return_dict_in_generate=True, **kwargs)


def laid_out(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> torch.LongTensor:
    """Each prompt's own output (prompt and new tokens) laid out as plain batched `generate` lays rows out: left
    padding, the output, then PAD after a row that stopped early."""
    width = max(map(len, prompts))
    length = max(width - len(p) + len(out) for p, out in zip(prompts, outputs))
    return torch.tensor([[PAD] * (width - len(p)) + list(out) + [PAD] * (length - width + len(p) - len(out))
                         for p, out in zip(prompts, outputs)])


def two_token_joint(model, prompt: torch.LongTensor, warpers) -> torch.FloatTensor:
    """P(first two tokens) `(vocab, vocab)` of plain sampling after `prompt` `(1, length)` with `warpers`."""

    def distribution(input_ids):
        logits = model(input_ids).logits[:, -1].float()
        return torch.softmax(warpers(input_ids, logits), dim=-1)[0]

    with torch.no_grad():
        first = distribution(prompt)
        joint = torch.zeros(len(first), len(first))
        for token in first.nonzero().flatten().tolist():
            joint[token] = first[token] * distribution(torch.cat([prompt, torch.tensor([[token]])], dim=-1))
    return joint
