"""The only module that touches transformers `Cache` objects: checks, rollback, truncation and tree compaction."""

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


def prepare_cache(cache: Cache | None, config) -> DynamicCache:
    """Returns a cache that speculative decoding can roll back, creating one if `cache` is `None`.

    Args:
        cache: the `past_key_values` of the generate call, or `None`.
        config: the model's config, used to create a new `DynamicCache`.

    Raises:
        `ValueError`: for a static or otherwise fixed-size cache, which cannot drop rejected draft tokens.
    """
    if cache is None:
        cache = DynamicCache(config=config)
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"Speculative decoding needs a DynamicCache, got {type(cache).__name__}: rejected draft tokens must be "
            "dropped from the cache. Remove cache_implementation='static' (or the cache you passed) and retry."
        )
    cache.activate_past_recording()  # sliding-window and linear-attention layers keep what a rollback needs
    return cache


def rollback(cache: Cache, num_tokens: int) -> None:
    """Drops the last `num_tokens` tokens (>= 0) from every layer of `cache`."""
    if num_tokens > 0:
        cache.crop(-num_tokens)


def truncate_layers(cache: Cache, length: int) -> None:
    """Keeps the first `length` tokens in every layer of `cache`, whatever each layer holds (layers may differ).

    Unlike `truncate`, which crops every layer by the first layer's excess, this reads each layer's own length:
    for attention layers only (layer skip, its one user, checks that with `check_layerwise_support`).
    """
    for layer in cache.layers:
        excess = layer.get_seq_length() - length
        if excess > 0:
            layer.crop(-excess)


def truncate(cache: Cache, length: int) -> None:
    """Keeps the first `length` tokens of `cache` (no-op if it holds `length` or fewer)."""
    rollback(cache, cache.get_seq_length() - length)


def check_tree_support(cache: Cache) -> None:
    """Raises `ValueError` unless every layer of `cache` is a full-attention `DynamicLayer`.

    A token tree is scored with a 4D mask over the whole cache and compacted by gathering key/value rows: neither
    fits sliding-window layers (which hold only the last window of tokens) nor linear-attention states.
    """
    unsupported = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})
    if unsupported:
        raise ValueError(
            f"Token trees need full-attention cache layers; this model's cache has {unsupported}. Use a drafter "
            "that proposes chains (e.g. DraftModelDrafter, or PromptLookupDrafter with num_candidates=1)."
        )


def check_layerwise_support(cache: Cache, max_length: int) -> None:
    """Raises `ValueError` unless every layer of `cache` attends to all earlier tokens up to `max_length` tokens.

    Layer skip runs decoder layers itself with a causal mask over the whole cache: right for full-attention layers,
    and for sliding-window layers whose window holds the whole sequence.
    """
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            continue
        if type(layer) is DynamicSlidingWindowLayer and layer.sliding_window >= max_length:
            continue
        window = getattr(layer, "sliding_window", None)
        raise ValueError(
            f"Layer skip needs full-attention cache layers; this model's cache has {type(layer).__name__}"
            + (f" with a window of {window} tokens, shorter than max_length={max_length}" if window else "")
            + ". Lower max_length to the window, or use DraftModelDrafter or PromptLookupDrafter."
        )


def keep_accepted(cache: Cache, accepted_nodes: torch.LongTensor, num_nodes: int) -> None:
    """Keeps the key/value states of the accepted path of a draft tree and drops those of the other nodes.

    The last `num_nodes` entries of every layer are the draft's nodes in node order. Afterwards the accepted
    nodes, root to leaf, stand in their place and the rest are gone. When the accepted nodes are the first ones
    (always for a chain) this is a plain rollback; otherwise their rows are gathered in every layer first.

    Args:
        cache (`Cache`): a `DynamicCache`; gathering needs full-attention layers (see `check_tree_support`).
        accepted_nodes (`torch.LongTensor` of shape `(num_accepted,)`): node indices of the accepted path.
        num_nodes (`int`): the draft's number of nodes, all in the cache.
    """
    num_accepted = len(accepted_nodes)
    if num_accepted and int(accepted_nodes[-1]) != num_accepted - 1:  # increasing node ids: a prefix ends at n - 1
        for layer in cache.layers:
            start = layer.keys.shape[-2] - num_nodes
            rows = start + accepted_nodes.to(layer.keys.device)
            layer.keys[..., start : start + num_accepted, :] = layer.keys[..., rows, :]
            layer.values[..., start : start + num_accepted, :] = layer.values[..., rows, :]
    rollback(cache, num_nodes - num_accepted)
