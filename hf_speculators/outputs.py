"""What a speculative generate call returns, and how each step's new tokens are committed."""

from dataclasses import dataclass

import torch
from transformers import StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .metrics import SpeculativeStats

# the field under which transformers' generate outputs carry the cache in the installed version: `cache` from 5.24
# on, `past_key_values` before (5.24 still answers the old name, with a deprecation warning)
CACHE_FIELD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


@dataclass
class SpeculativeGenerateOutput(GenerateDecoderOnlyOutput):
    """transformers' `GenerateDecoderOnlyOutput` with the speculative figures of the call added.

    The cache (one row only) is in the field transformers' own outputs use in the installed version,
    `CACHE_FIELD`: `output.cache` from transformers 5.24 on, `output.past_key_values` before.

    Attributes:
        speculative_stats (`SpeculativeStats`): acceptance figures, timings and whether the output is lossless
            (for a batch: the totals, with each row's figures in `speculative_stats.row_stats`).
    """

    speculative_stats: SpeculativeStats | None = None


def commit_tokens(input_ids: torch.LongTensor, new_tokens: torch.LongTensor, scores: torch.FloatTensor,
                  stopping_criteria: StoppingCriteriaList) -> tuple[torch.LongTensor, int, bool]:
    """Appends `new_tokens` one by one until a stopping criterion is met, so that EOS, max length and stop strings
    cut exactly where plain `generate` would.

    Args:
        input_ids (`torch.LongTensor` of shape `(1, sequence_length)`): the sequence so far.
        new_tokens (`torch.LongTensor` of shape `(num_new,)`): the step's accepted draft tokens and next token.
        scores (`torch.FloatTensor` of shape `(num_new, vocab_size)`): row i, the processed scores token i was
            chosen from (what the criteria receive as `scores`).
        stopping_criteria (`StoppingCriteriaList`): the call's criteria.

    Returns:
        `(input_ids, num_committed, finished)`: the longer sequence, how many of `new_tokens` it gained, and
        whether a criterion stopped it.
    """
    for i, token in enumerate(new_tokens):
        input_ids = torch.cat([input_ids, token.view(1, 1)], dim=-1)
        if stopping_criteria(input_ids, scores[i : i + 1]).any():
            return input_ids, i + 1, True
    return input_ids, len(new_tokens), False
