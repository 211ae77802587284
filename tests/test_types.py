"""Draft and Verdict, and the loop's refusal of token trees."""

import pytest
import torch

import hf_speculators as hs
from speculative_helpers import prompt_ids, speculative_generate


def test_chain_draft():
    draft = hs.Draft.chain(torch.tensor([7, 3, 9]))
    assert draft.parent_ids.tolist() == [-1, 0, 1]
    assert draft.num_nodes == 3 and draft.is_chain and draft.draft_probs is None


def test_empty_draft():
    draft = hs.Draft.empty(torch.device("cpu"))
    assert draft.num_nodes == 0 and draft.is_chain
    assert draft.token_ids.dtype == torch.long


def test_tree_draft_is_not_a_chain():
    tree = hs.Draft(token_ids=torch.tensor([7, 3, 9]), parent_ids=torch.tensor([-1, 0, 0]))
    assert not tree.is_chain


def test_verdict_counts_accepted_nodes():
    verdict = hs.Verdict(accepted_nodes=torch.arange(2), next_token=torch.tensor(5))
    assert verdict.num_accepted == 2


class MalformedTreeDrafter(hs.Drafter):
    def draft_row(self, state, input_ids, max_tokens, row):
        return hs.Draft(token_ids=torch.tensor([1, 2]), parent_ids=torch.tensor([-1, 5]))


def test_generate_refuses_a_malformed_tree_draft(zoo):
    with pytest.raises(ValueError, match="Malformed token tree"):
        speculative_generate(zoo.target("llama"), prompt_ids("random"), MalformedTreeDrafter(2))


def test_a_drafter_must_implement_propose(zoo):
    with pytest.raises(NotImplementedError, match="must implement draft_row or propose"):
        speculative_generate(zoo.target("llama"), prompt_ids("random"), hs.Drafter(2))
