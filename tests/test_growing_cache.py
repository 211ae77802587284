"""GrowingLayer: the same keys and values as transformers' DynamicLayer under every operation the loop performs, and
the loop's caches built of it."""

import random

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from hf_speculators.cache import prepare_cache
from hf_speculators.growing_cache import MIN_CAPACITY, GrowingLayer, use_growing_layers
from batch_helpers import MAX_NEW_TOKENS
from speculative_helpers import make_drafter, output_cache, prompt_ids, speculative_generate


def _states(batch_size: int, num_new: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(batch_size, 2, num_new, 4, generator=generator),
            torch.randn(batch_size, 2, num_new, 3, generator=generator))  # values of another head_dim (MLA)


@pytest.mark.parametrize("capacity", [None, 5, 300])
def test_matches_dynamic_layer_through_appends_crops_and_replacements(capacity):
    generator, choices = torch.Generator().manual_seed(0), random.Random(0)
    grown, plain = GrowingLayer(capacity), DynamicLayer()
    for _ in range(120):
        operation = choices.choice(["update", "update", "update", "crop", "tail", "replace", "select"])
        length, batch_size = plain.get_seq_length(), plain.keys.shape[0] if plain.is_initialized else 3
        if operation == "crop" and length > 1:
            count = -choices.randint(1, length - 1)
            grown.crop(count)
            plain.crop(count)
        elif operation == "tail" and length > 2:  # the loop's tree gather writes the last slots in place
            order = torch.randperm(2, generator=generator)
            for layer in (grown, plain):
                layer.keys[..., -2:, :] = layer.keys[..., -2:, :][..., order, :].clone()
        elif operation == "replace" and length:  # a compaction stores new tensors
            keys, values = _states(batch_size, length, generator)
            grown.keys, grown.values, plain.keys, plain.values = keys, values, keys.clone(), values.clone()
        elif operation == "select" and length and batch_size > 1:
            rows = torch.tensor([0, batch_size - 1])
            grown.batch_select_indices(rows)
            plain.batch_select_indices(rows)
        else:
            keys, values = _states(batch_size, choices.randint(1, 9), generator)
            returned = grown.update(keys, values)
            expected = plain.update(keys.clone(), values.clone())
            assert all(torch.equal(a, b) for a, b in zip(returned, expected))
        assert grown.get_seq_length() == plain.get_seq_length()
        if plain.is_initialized:
            assert torch.equal(grown.keys, plain.keys) and torch.equal(grown.values, plain.values)


def test_appends_in_place_within_its_capacity():
    generator = torch.Generator().manual_seed(0)
    capacity = MIN_CAPACITY + 16
    layer = GrowingLayer(capacity)
    layer.update(*_states(1, capacity - 6, generator))
    buffer = layer.keys.data_ptr()
    layer.crop(-4)
    layer.update(*_states(1, 10, generator))  # every slot of the first buffer
    assert layer.keys.data_ptr() == buffer and layer.get_seq_length() == capacity
    layer.update(*_states(1, 1, generator))  # one more: a larger buffer
    assert layer.keys.data_ptr() != buffer and layer.get_seq_length() == capacity + 1


def test_only_empty_full_attention_layers_are_replaced():
    cache = DynamicCache()
    cache.layers = [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=4), DynamicLayer()]
    cache.layers[2].update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    kinds = [type(layer) for layer in use_growing_layers(cache, 32).layers]
    assert kinds == [GrowingLayer, DynamicSlidingWindowLayer, DynamicLayer]
    assert cache.layers[0].capacity == 32


def test_generate_runs_on_growing_layers(zoo):
    reference = zoo.reference("llama", "repetitive", max_new_tokens=MAX_NEW_TOKENS)
    target = zoo.target("llama")
    assert all(type(layer) is GrowingLayer for layer in prepare_cache(None, target.config, 64).layers)
    out = speculative_generate(target, prompt_ids("repetitive"), make_drafter("adversary", 3, zoo, "llama",
                                                                              reference=reference),
                               return_dict_in_generate=True)
    assert out.sequences.tolist() == reference.tolist()
    assert all(type(layer) is GrowingLayer for layer in output_cache(out).layers)
