"""What a speculative generate call returns, and how each step's new tokens are committed."""

from dataclasses import dataclass

import torch
from transformers import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList
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
    cut exactly where plain `generate` would. When the criteria are only the ones `generate` builds from
    `max_length` and `eos_token_id` (`_known_stop`), the cut is found for all new tokens at once: the same cut, with
    one read of the tokens instead of a criteria call and a read per token (each read waits for a GPU).

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
    known = _known_stop(input_ids.shape[1], new_tokens, stopping_criteria)
    if known is not None:
        committed, finished = known
        return torch.cat([input_ids, new_tokens[None, :committed]], dim=-1), committed, finished
    for i, token in enumerate(new_tokens):
        input_ids = torch.cat([input_ids, token.view(1, 1)], dim=-1)
        if stopping_criteria(input_ids, scores[i : i + 1]).any():
            return input_ids, i + 1, True
    return input_ids, len(new_tokens), False


def _known_stop(length: int, new_tokens: torch.LongTensor,
                stopping_criteria: StoppingCriteriaList) -> tuple[int, bool] | None:
    """`(num_committed, finished)` of `commit_tokens` for a sequence of `length` tokens, when every criterion is
    exactly transformers' `MaxLengthCriteria` (its length reached after new token i: `length + i + 1 >= max_length`)
    or `EosTokenCriteria` (new token i is an EOS token), whose rules are read here; `None` for any other criterion,
    and for a length past `max_position_embeddings`, where `MaxLengthCriteria` itself warns."""
    num_new = len(new_tokens)
    if not all(type(criterion) in (MaxLengthCriteria, EosTokenCriteria) for criterion in stopping_criteria):
        return None
    stops = []  # for each criterion that holds after some new token, how many new tokens that is
    for criterion in stopping_criteria:
        if type(criterion) is EosTokenCriteria:
            hits = torch.isin(new_tokens, criterion.eos_token_id.to(new_tokens.device)).tolist()
            stops += [hits.index(True) + 1] if True in hits else []
        elif criterion.max_position_embeddings is not None and length + num_new > criterion.max_position_embeddings:
            return None
        elif criterion.max_length - length <= num_new:
            stops.append(max(criterion.max_length - length, 1))
    return (min(stops), True) if stops else (num_new, False)
