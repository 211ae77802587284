"""Drafters with a known acceptance pattern, built from the target's own reference (greedy) output.

Each takes `reference`, the full sequence plain `generate` produced (prompt included, shape `(1, length)` or
`(length,)`), and proposes continuations of it. They record every draft they return in `proposals`, so tests
can check the speculative stats against what was actually proposed, and every call in `calls`.
"""

import torch

import hf_speculators as hs
from tiny_models import VOCAB_SIZE


class ReferenceDrafter(hs.Drafter):
    """Proposes `num_correct` tokens of the reference continuation, then tokens that are certainly wrong."""

    name = "reference-test"

    def __init__(self, reference: torch.LongTensor, num_draft_tokens: int, num_correct: int):
        super().__init__(num_draft_tokens)
        self.reference = reference.reshape(-1).tolist()
        self.num_correct = num_correct
        self.proposals: list[list[int]] = []  # the draft tokens of each call
        self.calls: list[tuple[int, int]] = []  # (input length, max_tokens) of each call

    def _future(self, input_ids: torch.LongTensor, max_tokens: int) -> list[int]:
        """The reference tokens after `input_ids`, which must be a prefix of the reference."""
        committed = input_ids[0].tolist()
        assert committed == self.reference[: len(committed)], "the target left the reference output"
        return self.reference[len(committed) : len(committed) + max_tokens]

    def draft_row(self, state, input_ids: torch.LongTensor, max_tokens: int, row: int) -> hs.Draft:
        self.calls.append((input_ids.shape[1], max_tokens))
        future = self._future(input_ids, max_tokens)
        tokens = [t if i < self.num_correct else (t + 1) % VOCAB_SIZE for i, t in enumerate(future)]
        self.proposals.append(tokens)
        return hs.Draft.chain(torch.tensor(tokens, dtype=torch.long, device=input_ids.device))


class OracleDrafter(ReferenceDrafter):
    """Proposes exactly the target's future greedy tokens: every draft token is accepted."""

    name = "oracle"

    def __init__(self, reference: torch.LongTensor, num_draft_tokens: int):
        super().__init__(reference, num_draft_tokens, num_correct=num_draft_tokens)


class AdversaryDrafter(ReferenceDrafter):
    """Proposes tokens that are never the target's greedy token: no draft token is accepted."""

    name = "adversary"

    def __init__(self, reference: torch.LongTensor, num_draft_tokens: int):
        super().__init__(reference, num_draft_tokens, num_correct=0)


class ScriptedDrafter(ReferenceDrafter):
    """The first `num_correct` draft tokens of every step are right, the rest wrong: exactly that many accepted
    (fewer only where the reference or the length budget leaves fewer tokens to propose)."""

    name = "scripted"


class WrongFirstTreeDrafter(ReferenceDrafter):
    """A token tree that holds the reference continuation, but at every depth after a wrong sibling (two wrong
    siblings with the same token with `share_tokens=True`): every draft token on the right path is accepted, and
    as the accepted nodes are never the first ones, the target cache must gather their KV rows each step."""

    name = "wrong-first-tree"

    def __init__(self, reference: torch.LongTensor, num_draft_tokens: int, share_tokens: bool = False):
        super().__init__(reference, num_draft_tokens, num_correct=num_draft_tokens)
        self.num_wrong = 2 if share_tokens else 1

    drafts_trees = True

    def draft_row(self, state, input_ids: torch.LongTensor, max_tokens: int, row: int) -> hs.Draft:
        token_ids, parent_ids, parent = [], [], -1
        for token in self._future(input_ids, max_tokens):
            for sibling in [(token + 1) % VOCAB_SIZE] * self.num_wrong + [token]:
                token_ids.append(sibling)
                parent_ids.append(parent)
            parent = len(token_ids) - 1
        return hs.Draft.from_lists(token_ids, parent_ids, input_ids.device)
