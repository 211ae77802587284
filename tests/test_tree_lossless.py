"""Seeded Monte-Carlo tests: rejection verification of token trees keeps the target's distribution.

The verifier is a pure function of a draft and the target's scores, so these tests use no model: a 6-token
vocabulary, fixed target distributions p(x1) and p(x2 | x1), and draft distributions q that differ from them.
Each trial drafts a depth-2 tree, verifies it once and reads the first two output tokens (when the step yields
only one, the second is drawn from p(. | x1), as the next lossless step would). The empirical joint distribution
of (x1, x2) must be within `BOUND` (total variation) of p(x1) p(x2 | x1); sampling noise at `NUM_TRIALS` is about
0.015. A deliberately broken verifier, which tries every sibling against p instead of the residual, must exceed
the same bound, which shows that the test can see the error it guards against.
"""

import pytest
import torch

from hf_speculators import Draft, ExactVerifier, RejectionVerifier
from hf_speculators.verifiers import rejection

VOCAB, NUM_TRIALS, BOUND = 6, 12000, 0.04
generator = torch.Generator().manual_seed(0)
TARGET_ROOT = torch.softmax(1.5 * torch.randn(VOCAB, generator=generator), -1)  # p(x1)
TARGET_NEXT = torch.softmax(1.5 * torch.randn(VOCAB, VOCAB, generator=generator), -1)  # p(x2 | x1)
DRAFT_ROOT = torch.softmax(1.5 * torch.randn(VOCAB, generator=generator), -1)  # q(x1)
DRAFT_NEXT = torch.softmax(1.5 * torch.randn(VOCAB, VOCAB, generator=generator), -1)  # q(x2 | x1)
EXPECTED = TARGET_ROOT[:, None] * TARGET_NEXT  # [VOCAB, VOCAB]


def _siblings(probs, count, replacement, rng):
    """`count` tokens drawn from `probs` and the distribution each was drawn from (given the earlier ones)."""
    tokens, rows, left = [], [], probs.clone()
    for _ in range(count):
        rows.append(left / left.sum())
        tokens.append(int(torch.multinomial(rows[-1], 1, generator=rng)))
        if not replacement:
            left[tokens[-1]] = 0
    return tokens, rows


def sampled_tree(rng, replacement: bool) -> Draft:
    """3 children of the root, 2 under each, drawn from q with or without replacement (siblings may share tokens)."""
    tokens, rows = _siblings(DRAFT_ROOT, 3, replacement, rng)
    parent_ids = [-1] * 3
    for parent, token in enumerate(tokens[:3]):
        children, child_rows = _siblings(DRAFT_NEXT[token], 2, replacement, rng)
        tokens, rows, parent_ids = tokens + children, rows + child_rows, parent_ids + [parent] * 2
    return Draft(token_ids=torch.tensor(tokens), parent_ids=torch.tensor(parent_ids), draft_probs=torch.stack(rows))


def sampled_chain(rng) -> Draft:
    """Two tokens drawn from q, a chain."""
    (first,), (first_row,) = _siblings(DRAFT_ROOT, 1, True, rng)
    (second,), (second_row,) = _siblings(DRAFT_NEXT[first], 1, True, rng)
    return Draft.chain(torch.tensor([first, second]), draft_probs=torch.stack([first_row, second_row]))


def deterministic_tree(rng) -> Draft:
    """A fixed tree whose root children share a token (0, 3, 0) and whose grandchildren do too: no draft_probs."""
    return Draft.from_lists([0, 3, 0, 1, 1, 2, 0, 5], [-1, -1, -1, 0, 0, 1, 2, 2], "cpu")


def target_scores(draft: Draft) -> torch.FloatTensor:
    """Log p after the root, after each depth-1 node; uniform after depth-2 nodes (their bonus is a third token)."""
    rows = [TARGET_ROOT.log()]
    for token, parent in zip(draft.token_ids.tolist(), draft.parent_ids.tolist()):
        rows.append(TARGET_NEXT[token].log() if parent == -1 else torch.zeros(VOCAB))
    return torch.stack(rows)


def output_distribution(make_draft, verifier, seed=1) -> torch.FloatTensor:
    """The empirical joint distribution `(VOCAB, VOCAB)` of the first two tokens over `NUM_TRIALS` steps."""
    rng = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(NUM_TRIALS):
        draft = make_draft(rng)
        verdict = verifier(draft, target_scores(draft), do_sample=True, generator=rng)
        tokens = draft.token_ids[verdict.accepted_nodes].tolist() + [int(verdict.next_token)]
        if len(tokens) == 1:
            tokens.append(int(torch.multinomial(TARGET_NEXT[tokens[0]], 1, generator=rng)))
        counts[tokens[0], tokens[1]] += 1
    return counts / NUM_TRIALS


def total_variation(empirical) -> float:
    return 0.5 * float((empirical - EXPECTED).abs().sum())


DRAFTS = {
    "sampled chain": sampled_chain,
    "sampled with replacement": lambda rng: sampled_tree(rng, replacement=True),
    "sampled without replacement": lambda rng: sampled_tree(rng, replacement=False),
    "deterministic, shared tokens": deterministic_tree,
}


@pytest.mark.parametrize("kind", DRAFTS)
def test_tree_rejection_sampling_is_lossless(kind):
    assert total_variation(output_distribution(DRAFTS[kind], RejectionVerifier())) < BOUND


def _ignore_residual(target_probs, draft_probs):
    return target_probs  # broken: a rejected sibling leaves p unchanged for the next sibling and the recovered token


@pytest.mark.parametrize("kind", ["sampled with replacement", "deterministic, shared tokens"])
def test_broken_variant_fails_the_same_bound(kind, monkeypatch):
    monkeypatch.setattr(rejection, "residual_distribution", _ignore_residual)
    assert total_variation(output_distribution(DRAFTS[kind], RejectionVerifier())) > 2 * BOUND


@pytest.mark.parametrize("seed", range(5))
def test_greedy_tree_rejection_equals_exact(seed):
    rng = torch.Generator().manual_seed(seed)
    draft = sampled_tree(rng, replacement=True)
    scores = torch.randn(draft.num_nodes + 1, VOCAB, generator=rng)
    scores[0, draft.token_ids[0]] += 3  # make the first child the argmax: some node gets accepted
    verdict = RejectionVerifier()(draft, scores, do_sample=False, generator=rng)
    exact = ExactVerifier()(draft, scores, do_sample=False, generator=None)
    assert verdict.accepted_nodes.tolist() == exact.accepted_nodes.tolist() and verdict.num_accepted >= 1
    assert int(verdict.next_token) == int(exact.next_token)
