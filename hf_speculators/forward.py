"""One forward of a causal LM over new tokens after its cache, as a chain or as a token tree."""

import functools
import inspect

import torch
from transformers import Cache

from .cache import RaggedCache
from .tree import TokenTree


@functools.cache
def _takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def forward_logits(
    model, cache: Cache, input_ids: torch.LongTensor, tree: TokenTree, num_prefix: int, num_logits: int
) -> torch.FloatTensor:
    """Runs `model` over `input_ids` after `cache` and returns the logits of the last `num_logits` positions.

    The fed tokens are the last `input_ids.shape[1]` entries of `num_prefix` committed tokens followed by the
    nodes of `tree`. A chain runs with the model's own causal mask; any other tree with its 4D float additive
    mask, so one forward scores every node with the attention it would have had in sequential decoding. Position
    ids are always explicit.

    Args:
        model (`PreTrainedModel`): a causal LM.
        cache (`Cache`): its cache, holding `num_prefix + tree.num_nodes - input_ids.shape[1]` tokens.
        input_ids (`torch.LongTensor` of shape `(1, num_query)`): the tokens to feed.
        tree (`TokenTree`): the draft nodes after the committed tokens (an empty chain for none).
        num_prefix (`int`): committed tokens, cached or fed.
        num_logits (`int`): how many rows of logits to return, from the end.

    Returns:
        `torch.FloatTensor` of shape `(num_logits, vocab_size)`.
    """
    num_query = input_ids.shape[1]
    mask = None if tree.is_chain else tree.attention_mask(num_prefix, num_query, model.dtype)
    extra = {"logits_to_keep": num_logits} if _takes_logits_to_keep(type(model)) else {}
    logits = model(
        input_ids=input_ids, past_key_values=cache, attention_mask=mask, use_cache=True,
        position_ids=tree.position_ids(num_prefix, num_query).to(input_ids.device), **extra,
    ).logits
    return logits[0, -num_logits:]


def forward_batch_logits(model, cache: RaggedCache, input_ids: torch.LongTensor, new_valid: torch.BoolTensor,
                         num_logits: int | None = None) -> torch.FloatTensor:
    """Runs `model` over one query of `num_query` slots per row after the ragged `cache`; returns every slot's logits.

    Slot j of row i holds a token when `new_valid[i, j]`; the others (the padding of a shorter row) are masked out
    and get positions that nothing reads. Every row sees its own tokens at its own positions (`RaggedCache.inputs`).
    The caller then says which new slots each row keeps (`RaggedCache.append`).

    Args:
        model (`PreTrainedModel`): a causal LM.
        cache (`RaggedCache`): its cache, one row per sequence.
        input_ids (`torch.LongTensor` of shape `(batch_size, num_query)`): the tokens to feed (any id in a hole).
        new_valid (`torch.BoolTensor` of shape `(batch_size, num_query)`): which slots hold a token.
        num_logits (`int`, *optional*): how many slots' logits to compute, from the end (default: all).

    Returns:
        `torch.FloatTensor` of shape `(batch_size, num_logits or num_query, vocab_size)`.
    """
    attention_mask, position_ids = cache.inputs(new_valid)
    extra = {"logits_to_keep": num_logits or input_ids.shape[1]} if _takes_logits_to_keep(type(model)) else {}
    return model(
        input_ids=input_ids, past_key_values=cache.cache, attention_mask=attention_mask.to(input_ids.device),
        position_ids=position_ids.to(input_ids.device), use_cache=True, **extra,
    ).logits
