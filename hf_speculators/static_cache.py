"""transformers' `StaticCache` in the speculative loop: length buckets, the length reset, in-place slot moves.

A static cache preallocates `max_cache_len` slots per layer and counts the ones in use (`cumulative_length`, a
tensor, so compiled forwards see no new Python int); every forward writes its keys and values at that count and
attends over all `max_cache_len` slots, the unused ones masked. Dropping rejected draft tokens is then a length
reset: the next forward overwrites them (gpt-fast and vLLM keep a preallocated cache the same way). transformers
5.24 has `StaticLayer.crop` for it; 5.23 has none, so `reset_length` lowers the count itself. Nothing here
reallocates a layer except `select_rows` (rows that finished leave the batch) and `ensure_room` (a forward wider
than the call's estimate: a token tree).
"""

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

MIN_BUCKET = 256  # the smallest static cache length (slots per row) the loop allocates


def is_static(cache) -> bool:
    """Whether any layer of `cache` is a preallocated static layer (`StaticLayer` or a subclass)."""
    return any(isinstance(layer, StaticLayer) for layer in cache.layers)


def allocated(cache) -> bool:
    """Whether every layer of `cache` holds its tensors (a static layer allocates them in its first forward)."""
    return all(layer.is_initialized for layer in cache.layers)


def length_bucket(num_slots: int) -> int:
    """The static cache length for `num_slots` slots: the smallest of 1, 1.25, 1.5, 1.75 or 2 times a power of two
    that holds them, at least `MIN_BUCKET`. Calls with different prompt and generation lengths share a few shapes
    (dynamo compiles a graph for the first two, then treats the length as dynamic), and a forward, whose attention
    spans every slot of a static cache, reads at most a fifth of them unused (with powers of two alone, up to half:
    a 1,172-token prompt attended over 2,048 slots)."""
    num_slots = max(num_slots, MIN_BUCKET)
    power = 1 << ((num_slots - 1).bit_length() - 1)  # power < num_slots <= 2 * power
    quarter = power // 4
    return power + -(-(num_slots - power) // quarter) * quarter


def static_length(cache) -> int:
    """The slots per row every static layer of `cache` holds (`max_cache_len`)."""
    return cache.layers[0].max_cache_len


def _not_full_attention(cache) -> list[str]:
    """The names of `cache`'s layer classes that are not full-attention `StaticLayer`s."""
    return sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not StaticLayer})


def bucketed_cache(config, num_slots: int) -> StaticCache:
    """A new `StaticCache` for a model of `config` of `length_bucket(num_slots)` slots per row."""
    return StaticCache(config=config, max_cache_len=length_bucket(num_slots))


def draft_static_cache(config, num_slots: int) -> StaticCache | None:
    """A draft model's `bucketed_cache`, or `None` when its layers are not all full-attention `StaticLayer`s
    (sliding windows: the draft model then runs eagerly on its dynamic cache)."""
    cache = bucketed_cache(config, num_slots)
    return None if _not_full_attention(cache) else cache


def prepare_static_cache(cache, config, num_slots: int):
    """A static cache that holds `num_slots` slots per row: when `cache` is empty (as `cache_implementation="static"`
    makes it, of `max_length - 1` slots or an earlier call's length: too few for a draft, or not a bucket), a new
    `StaticCache` of `length_bucket(num_slots)` slots, so that calls share a few cache shapes; a prefilled `cache`
    itself, when it holds `num_slots`.

    Raises:
        `ValueError`: layers other than full-attention `StaticLayer`s (a sliding window keeps only its last tokens
            and rolls them over, which a length reset cannot undo), or a prefilled cache shorter than `num_slots`.
    """
    refused = _not_full_attention(cache)
    if refused:
        raise ValueError(
            f"Speculative decoding with a static cache needs full-attention StaticLayer layers; this cache has "
            f"{refused} (a sliding window past its size cannot take back rejected tokens). Use the default dynamic "
            "cache (drop cache_implementation='static') for this model."
        )
    if int(cache.get_seq_length()) == 0:
        return bucketed_cache(config, num_slots)
    if static_length(cache) < num_slots:
        raise ValueError(
            f"The static cache passed holds {static_length(cache)} slots per row, fewer than the {num_slots} this "
            "call may write (max_length plus a draft, plus masked holes for a batch): pass a StaticCache with "
            f"max_cache_len >= {num_slots}, or an empty one."
        )
    return cache


def reset_length(layer: StaticLayer, num_tokens: int) -> None:
    """Drops the last `num_tokens` (> 0) tokens of a static `layer` by lowering its count in place: 5.24's
    `StaticLayer.crop`, or the same reset on 5.23, which has none."""
    if not layer.is_initialized:
        return
    if "crop" in vars(StaticLayer):
        layer.crop(-num_tokens)
    else:
        layer.cumulative_length.sub_(num_tokens)


def store_slots(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Makes `keys` and `values` `(batch_size, num_heads, width, head_dim)` the first `width` slots of `layer`: in
    place for a static layer (compiled forwards keep its addresses; the caller resets its length), replacing the
    tensors of a dynamic one."""
    if isinstance(layer, StaticLayer):
        width = keys.shape[-2]
        layer.keys[..., :width, :] = keys
        layer.values[..., :width, :] = values
    else:
        layer.keys, layer.values = keys, values


def ensure_room(cache, num_slots: int) -> bool:
    """Makes every static layer of `cache` hold at least `num_slots` slots per row: when one holds fewer, every
    layer moves, its tokens kept, into tensors of `length_bucket(num_slots)` slots (marked static again: compiled
    forwards see one more shape, as transformers' plain decoding does when a longer prompt grows its cache). A token
    tree or a draft's unverified tokens may need more slots in one forward than the call's first estimate.

    Returns:
        `bool`: whether the layers moved.
    """
    if static_length(cache) >= num_slots:
        return False
    length = length_bucket(num_slots)
    for layer in cache.layers:
        layer.max_cache_len = length
        if layer.is_initialized:
            grown = [torch.zeros((*states.shape[:2], length, states.shape[-1]), dtype=states.dtype, device=states.device)
                     for states in (layer.keys, layer.values)]
            for states, old in zip(grown, (layer.keys, layer.values)):
                states[..., : old.shape[-2], :] = old
                torch._dynamo.mark_static_address(states)
            layer.keys, layer.values = grown
    return True


def select_rows(cache, rows: torch.LongTensor) -> None:
    """Keeps the batch rows `rows` of every static layer of `cache` (new tensors, marked static again), for a static
    cache run eagerly: compiled calls keep finished rows in place (`RaggedCache(fixed_rows=True)`), one batch size."""
    for layer in cache.layers:
        if layer.is_initialized:
            index = rows.to(layer.keys.device)
            layer.keys, layer.values = layer.keys[index], layer.values[index]
            layer.batch_size = layer.keys.shape[0]
            torch._dynamo.mark_static_address(layer.keys)
            torch._dynamo.mark_static_address(layer.values)
