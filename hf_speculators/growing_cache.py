"""Cache layers that append in place: a `DynamicLayer` whose keys and values are views of a buffer with room to grow.

transformers' `DynamicLayer.update` concatenates (`torch.cat`) the new keys and values onto the old ones, so every
forward copies the whole cache: at a context of 1,172 tokens that copy was about a quarter of a one-token forward of
the demo target on the CPU (examples/forward_cost.py `--plain-step`). A `GrowingLayer` writes the new slots into a
preallocated buffer and hands the attention a view of its first slots; the attention reads the same values in the
same order, so the logits are bit-identical. Rollback (`crop`) slices the view as before, and the next update writes
over the dropped slots.
"""

import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 64  # slots a new buffer has beyond what it holds at least; else room for half as many again


class GrowingLayer(DynamicLayer):
    """A full-attention `DynamicLayer` that appends into a buffer of `capacity` slots instead of concatenating.

    `keys` and `values` stay what `DynamicLayer` promises, tensors `(batch_size, num_heads, num_slots, head_dim)`,
    here views of the first `num_slots` slots of the buffers. Whoever replaces them (a compaction, a row selection,
    an offload) makes the next update copy them into new buffers. A new buffer (at the first update, or when one is
    full) has room for half as many slots again as it holds (at least `MIN_CAPACITY` more), but no more than
    `capacity`: memory stays within 1.5 times what the slots need, as `torch.cat` would briefly hold 2 times.

    Args:
        capacity (`int`, *optional*): the most slots the call may write (its `max_length` plus a draft), where known:
            a call that writes them needs a single buffer.
    """

    def __init__(self, capacity: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.capacity = capacity
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def _holds_views(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether `keys` and `values` are still the leading slots of this layer's buffers, as wide as the update."""
        if self._buffers is None:
            return False
        return all(
            cached.data_ptr() == buffer.data_ptr() and cached.stride() == buffer.stride()
            and cached.shape[:2] == new.shape[:2] and cached.shape[-1] == new.shape[-1] and cached.dtype == new.dtype
            for cached, buffer, new in zip((self.keys, self.values), self._buffers, (key_states, value_states)))

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, num_slots: int) -> None:
        """New buffers of room for at least `num_slots` slots, holding the cached slots."""
        needed = num_slots + key_states.shape[-2]
        capacity = needed + max(needed // 2, MIN_CAPACITY)  # room to grow by half
        if self.capacity is not None:  # but no more than the call may write
            capacity = min(capacity, max(self.capacity, needed))
        buffers = tuple(new.new_empty(*new.shape[:2], capacity, new.shape[-1]) for new in (key_states, value_states))
        if num_slots:
            buffers[0][..., :num_slots, :] = self.keys
            buffers[1][..., :num_slots, :] = self.values
        self._buffers = buffers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes `key_states` and `value_states` `(batch_size, num_heads, num_new, head_dim)` after the cached slots;
        returns the keys and values of every slot, as `DynamicLayer.update` does."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        num_slots, num_new = self.get_seq_length(), key_states.shape[-2]
        if not self._holds_views(key_states, value_states) or num_slots + num_new > self._buffers[0].shape[-2]:
            self._allocate(key_states, value_states, num_slots)
        keys, values = self._buffers
        keys[..., num_slots : num_slots + num_new, :] = key_states
        values[..., num_slots : num_slots + num_new, :] = value_states
        self.keys, self.values = keys[..., : num_slots + num_new, :], values[..., : num_slots + num_new, :]
        return self.keys, self.values

    def reset(self) -> None:
        """Drops the buffers with the cached slots."""
        self._buffers = None
        super().reset()


def use_growing_layers(cache: Cache, capacity: int | None = None) -> Cache:
    """Replaces, in place, every full-attention `DynamicLayer` of `cache` that holds nothing yet by a `GrowingLayer`
    of `capacity` slots (sliding-window, static and other layers stay as they are). Returns `cache`."""
    cache.layers = [GrowingLayer(capacity) if type(layer) is DynamicLayer and not layer.is_initialized else layer
                    for layer in cache.layers]
    return cache
