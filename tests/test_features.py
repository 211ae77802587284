"""Target features recorded in the target's own forwards: committed rows equal a full forward's hidden states."""

import pytest
import torch
from speculative_helpers import assert_same_tokens, prompt_ids, speculative_generate

import hf_speculators as hs
from hf_speculators.drafters.feature import FeatureDrafter
from hf_speculators.features import TargetFeatures, accepted_path
from hf_speculators.tree import TokenTree


class RecordingDrafter(FeatureDrafter):
    """Drafts with `inner` and keeps every committed feature row with its position."""

    def __init__(self, inner, layer_ids, final_norm):
        super().__init__(inner.num_draft_tokens)
        self.inner, self.points, self.rows = inner, (list(layer_ids), final_norm), {}

    def feature_points(self, target):
        return self.points

    def prepare(self, target, generation_config, logits_processor, generator, tokenizer=None, cache=None):
        super().prepare(target, generation_config, logits_processor, generator, tokenizer, cache)
        self.inner.prepare(target, generation_config, logits_processor, generator, tokenizer, cache)

    def propose(self, input_ids, max_tokens):
        position, rows = self.committed_features(input_ids)
        assert position + (0 if rows is None else len(rows)) == input_ids.shape[1] - 1  # up to the pending token
        for i, row in enumerate([] if rows is None else rows):
            assert position + i not in self.rows  # each position is committed once
            self.rows[position + i] = row
        return self.inner.propose(input_ids, max_tokens)


def _expected_rows(model, sequence, layer_ids, final_norm):
    output = model(sequence, output_hidden_states=True)
    states = [output.hidden_states[i] for i in layer_ids]  # hidden_states[i] enters layer i
    if final_norm:
        states.append(output.hidden_states[-1])  # after the final norm
    return torch.cat(states, dim=-1)[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_committed_rows_are_the_full_forward_hidden_states(zoo, arch, shape):
    target, draft = zoo.target(arch), zoo.noisy_draft(arch)
    inner = (hs.DraftModelDrafter(draft, num_draft_tokens=3) if shape == "chain"
             else hs.TreeDrafter(draft, hs.DynamicTree(depth=3, top_k=2, num_nodes=6)))
    layer_ids, final_norm = [0, 1], True
    drafter = RecordingDrafter(inner, layer_ids, final_norm)
    out = speculative_generate(target, prompt_ids("random"), drafter, return_dict_in_generate=True)
    assert_same_tokens(out.sequences, zoo.reference(arch, "random"))
    assert 0 < out.speculative_stats.num_accepted_tokens < out.speculative_stats.num_draft_tokens  # both kinds met
    # rows are committed up to the last step's pending token; the last step's own rows are never committed
    with torch.no_grad():
        expected = _expected_rows(target, out.sequences, layer_ids, final_norm)
    assert sorted(drafter.rows) == list(range(len(drafter.rows)))
    actual = torch.stack([drafter.rows[p] for p in sorted(drafter.rows)])
    torch.testing.assert_close(actual, expected[: len(actual)], atol=1e-5, rtol=1e-5)
    assert len(actual) >= out.sequences.shape[1] - 3 - drafter.num_draft_tokens  # no propose at a zero budget


def test_one_token_prompt_has_no_prefill_rows(zoo):
    drafter = RecordingDrafter(hs.PromptLookupDrafter(num_draft_tokens=2), [1], False)
    speculative_generate(zoo.target("llama"), prompt_ids("one_token"), drafter, max_new_tokens=4)
    assert 0 in drafter.rows and drafter.rows[0].shape == (48,)


def test_accepted_path_follows_committed_tokens():
    tree = TokenTree(torch.tensor([-1, -1, 0, 0, 1, 2]))
    tokens = torch.tensor([10, 11, 12, 13, 14, 15])
    assert accepted_path(tree, tokens, [10, 12, 15, 99]) == [0, 2, 5]
    assert accepted_path(tree, tokens, [11, 14, 7]) == [1, 4]
    assert accepted_path(tree, tokens, [12]) == []


def test_feature_points_are_checked(zoo):
    with pytest.raises(ValueError, match=r"Feature layer ids \[2\] are outside this target's decoder layers 0..1"):
        TargetFeatures(zoo.target("llama"), [0, 2])
    with pytest.raises(ValueError, match="would record nothing"):
        TargetFeatures(zoo.target("llama"))


def test_get_candidates_refuses(zoo):
    drafter = RecordingDrafter(hs.PromptLookupDrafter(), [0], False)
    with pytest.raises(RuntimeError, match="only hf_speculators.generate records"):
        drafter.get_candidates(prompt_ids("random"))


def test_forwards_without_a_commit_in_between_are_resolved_in_order(zoo):
    """A step without a draft calls no propose: its rows must still be committed at the next call, in order."""
    from transformers import DynamicCache

    from hf_speculators.forward import forward_logits

    target, features = zoo.target("llama"), TargetFeatures(zoo.target("llama"), [1])
    sequence, cache = prompt_ids("random"), DynamicCache(config=zoo.target("llama").config)
    with torch.no_grad():
        for fed, tree, num_prefix in [(sequence[:, :5], TokenTree.chain(0), 5),  # a prefill of 5 tokens
                                      (sequence[:, 5:6], TokenTree.chain(0), 6),  # a step without a draft
                                      (sequence[:, 6:8], TokenTree.chain(1), 7)]:  # one pending token, one node
            features.record(lambda: forward_logits(target, cache, fed, tree, num_prefix, 1), fed, tree, num_prefix)
        position, rows = features.commit(sequence)  # the draft node (sequence[7]) was accepted
        expected = _expected_rows(target, sequence, [1], False)
    assert position == 0 and rows.shape == (8, 48)
    torch.testing.assert_close(rows, expected, atol=1e-5, rtol=1e-5)
    assert features.commit(sequence) == (7, None)
