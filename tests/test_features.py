"""Target features captured in the loop's own forwards (`target.FeatureCapture`) and handed to a drafter through
`observe`: each row's features are exactly its full forward's hidden states, every kept position once, in order,
for chains and token trees, one sequence and a batch."""

import pytest
import torch
from batch_helpers import PAD, left_padded
from drafters_for_tests import ScriptedDrafter, WrongFirstTreeDrafter
from speculative_helpers import PROMPTS, assert_same_tokens, plain_generate, prompt_ids, speculative_generate
from test_compiled import compile_config, fresh_dynamo, unique_graphs

import hf_speculators as hs
from hf_speculators.drafters.base import TargetNeeds
from hf_speculators.target import FeatureCapture

LAYER_IDS, FINAL_NORM = (0, 1), True


class RecordingDrafter(hs.Drafter):
    """Drafts each row with its own test drafter and keeps every feature row `observe` hands over, by (row,
    position)."""

    def __init__(self, inners: list, layer_ids=LAYER_IDS, final_norm=FINAL_NORM):
        super().__init__(inners[0].num_draft_tokens)
        self.inners, self.needs, self.features = inners, TargetNeeds(tuple(layer_ids), final_norm), {}
        self.drafts_trees = any(inner.drafts_trees for inner in inners)

    def target_needs(self, target) -> TargetNeeds:
        return self.needs

    def observe(self, state, feedback) -> None:
        for row, position, features in zip(feedback.rows, feedback.positions, feedback.features):
            for offset, feature in enumerate(features):
                assert (row, position + offset) not in self.features  # each kept position once
                self.features[row, position + offset] = feature

    def draft_row(self, state, input_ids, max_tokens, row):
        return self.inners[row].draft_row(state, input_ids, max_tokens, row)


def expected_features(model, sequence: torch.LongTensor, layer_ids=LAYER_IDS, final_norm=FINAL_NORM):
    """`(length, width)`: the hidden states entering `layer_ids` (and after the final norm) in a full forward."""
    with torch.no_grad():
        output = model(sequence, output_hidden_states=True)
    states = [output.hidden_states[i] for i in layer_ids] + ([output.hidden_states[-1]] if final_norm else [])
    return torch.cat(states, dim=-1)[0]


def check_row(drafter, model, row: int, sequence: torch.LongTensor) -> None:
    """Row `row` was handed the features of every position of `sequence` `(1, length)` but the last, which is
    still pending, equal to a full forward's."""
    positions = sorted(position for r, position in drafter.features if r == row)
    assert positions == list(range(sequence.shape[1] - 1))
    actual = torch.stack([drafter.features[row, position] for position in positions])
    torch.testing.assert_close(actual, expected_features(model, sequence)[:-1], atol=1e-5, rtol=1e-5)


def inner(shape: str, reference, num_draft_tokens: int = 3):
    """A chain drafter with some tokens right, or a tree whose accepted nodes are never the first ones (the
    target's cache gathers their slots, and so must the features)."""
    if shape == "chain":
        return ScriptedDrafter(reference, num_draft_tokens, num_correct=1)
    return WrongFirstTreeDrafter(reference, num_draft_tokens)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_one_sequence_gets_the_full_forward_hidden_states(zoo, arch, shape):
    target, reference = zoo.target(arch), zoo.reference(arch, "random")
    drafter = RecordingDrafter([inner(shape, reference)])
    out = speculative_generate(target, prompt_ids("random"), drafter, return_dict_in_generate=True,
                               plain_floor=False)  # every step drafts: the floor reads the clock
    assert_same_tokens(out.sequences, reference)
    assert 0 < out.speculative_stats.num_accepted_tokens < out.speculative_stats.num_drafted_tokens
    check_row(drafter, target, 0, out.sequences)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_each_row_of_a_batch_gets_its_own_hidden_states(zoo, arch, shape):
    """Rows of different prompt lengths (a one-token prompt has no prefill features), each its own features."""
    target, names = zoo.target(arch), ("random", "one_token", "repetitive")
    references = [plain_generate(target, prompt_ids(name)) for name in names]
    drafter = RecordingDrafter([inner(shape, reference) for reference in references])
    input_ids, attention_mask = left_padded([PROMPTS[name] for name in names])
    out = speculative_generate(target, input_ids, drafter, attention_mask=attention_mask, pad_token_id=PAD)
    for row, reference in enumerate(references):
        assert out[row, -reference.shape[1]:].tolist() == reference[0].tolist()
        check_row(drafter, target, row, reference)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_compiled_steps_hand_over_the_same_hidden_states(zoo, arch, shape):
    """Compiled decoding steps (a static cache and `compile_config`) return the features through the forward's
    `output_hidden_states` instead of hooks, which would not run inside a graph: the same features, each row its own."""
    fresh_dynamo()
    target, names = zoo.target(arch), ("random", "repetitive")
    references = [plain_generate(target, prompt_ids(name)) for name in names]
    drafter = RecordingDrafter([inner(shape, reference) for reference in references])
    input_ids, attention_mask = left_padded([PROMPTS[name] for name in names])
    out = speculative_generate(target, input_ids, drafter, attention_mask=attention_mask, pad_token_id=PAD,
                               cache_implementation="static", compile_config=compile_config("eager"), plain_floor=False)
    assert unique_graphs() >= 1  # the steps ran compiled
    for row, reference in enumerate(references):
        assert out[row, -reference.shape[1]:].tolist() == reference[0].tolist()
        check_row(drafter, target, row, reference)


def test_a_one_token_prompt_gets_its_first_feature_after_the_first_step(zoo):
    reference = zoo.reference("llama", "one_token")
    drafter = RecordingDrafter([ScriptedDrafter(reference, 2, num_correct=1)], layer_ids=[1], final_norm=False)
    out = speculative_generate(zoo.target("llama"), prompt_ids("one_token"), drafter)
    assert_same_tokens(out, reference)
    assert drafter.features[0, 0].shape == (48,)
    torch.testing.assert_close(drafter.features[0, 0], expected_features(zoo.target("llama"), out, [1], False)[0])


def test_layer_ids_outside_the_target_fail(zoo):
    with pytest.raises(ValueError, match=r"Feature layer ids \[2\] are outside this target's decoder layers 0..1"):
        FeatureCapture(zoo.target("llama"), TargetNeeds(layer_ids=(0, 2)))


def test_a_drafter_that_reads_nothing_gets_no_features(zoo):
    """Without `target_needs`, no hooks run: `observe` gets each step's accepted counts, never features, and nothing
    after the prefill."""
    reference = zoo.reference("llama", "random")
    drafter = ScriptedDrafter(reference, 3, num_correct=1)

    def observe(state, feedback):
        if feedback.features is not None or feedback.num_accepted is None:
            pytest.fail("features (or a prefill) observed without target_needs")

    drafter.observe = observe
    assert_same_tokens(speculative_generate(zoo.target("llama"), prompt_ids("random"), drafter), reference)
