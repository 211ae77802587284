"""The only module that touches transformers `Cache` objects: checks, rollback and truncation."""

from transformers import Cache, DynamicCache


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


def truncate(cache: Cache, length: int) -> None:
    """Keeps the first `length` tokens of `cache` (no-op if it holds `length` or fewer)."""
    rollback(cache, cache.get_seq_length() - length)
