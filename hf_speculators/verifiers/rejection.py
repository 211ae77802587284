"""Lossless speculative sampling of chains and token trees."""

import torch

from ..draft import Draft
from ..sampling import one_hot_probs, probabilities, residual_distribution, sample
from .base import Verdict, Verifier


class RejectionVerifier(Verifier):
    """Lossless rejection sampling of a draft chain or tree (recursive rejection sampling over siblings).

    Starting at the last committed token, the children of the current node are tried in node order (SpecInfer's
    multi-step speculative sampling, Miao et al. 2024; EAGLE, Li et al. 2024). Child x, drawn from the draft
    distribution q_x (its row of `draft_probs`), is accepted with probability `min(1, p'(x) / q_x(x))`, where p'
    starts as the target's distribution p after the current node. On acceptance the walk moves to x and p' is
    reset to the target's distribution after x. On rejection p' becomes `norm(max(0, p' - q_x))` and the next
    sibling is tried; when every child is rejected the recovered token is drawn from p', and at a leaf the bonus
    token from p. For a chain this is Leviathan et al. 2023, Algorithm 1 (Chen et al. 2023).

    The output is distributed exactly as the target's own samples when each row of `draft_probs` is the
    distribution its node was drawn from given its path and its earlier siblings. A deterministic draft
    (`draft_probs=None`: prompt lookup, top-k tree expansion) is one-hot: child x is accepted with probability
    p'(x) and a rejection sets p'(x) to 0 and renormalizes, which is lossless for any tree, siblings sharing a
    token included. With `do_sample=False`, p is the one-hot argmax and the result equals exact verification.
    All randomness comes from the `generator` passed in: one uniform per node, then one draw for the next token.
    """

    name = "rejection"
    lossless = True

    def __call__(
        self, draft: Draft, target_scores: torch.FloatTensor, *, do_sample: bool, generator: torch.Generator | None
    ) -> Verdict:
        target_probs = probabilities(target_scores, do_sample)  # [num_nodes + 1, vocab]
        draft_probs = draft.draft_probs
        if draft_probs is None:
            draft_probs = one_hot_probs(draft.token_ids, target_probs.shape[-1])  # [num_nodes, vocab]
        nodes = torch.arange(draft.num_nodes, device=target_probs.device)
        draft_token_probs = draft_probs[nodes, draft.token_ids]  # [num_nodes], q_x(x) > 0 for a token drawn from q_x
        uniform = torch.rand(draft.num_nodes, generator=generator, device=target_probs.device)
        # the verdict on each node while its parent's distribution is still p (the first child tried)
        accepted_first = (uniform * draft_token_probs < target_probs[draft.parent_ids + 1, draft.token_ids]).tolist()
        path = []
        while True:
            node = path[-1] if path else -1
            child, residual = _try_children(
                draft.tree.children(node), target_probs[node + 1], draft_probs, draft.token_ids, draft_token_probs,
                uniform, accepted_first,
            )
            if child is None:  # every child rejected (or a leaf): the recovered or bonus token ends the step
                accepted_nodes = torch.tensor(path, dtype=torch.long, device=target_probs.device)
                return Verdict(accepted_nodes=accepted_nodes, next_token=sample(residual, generator))
            path.append(child)


def _try_children(children, target_probs, draft_probs, token_ids, draft_token_probs, uniform, accepted_first):
    """Recursive rejection over the siblings `children` (node indices, in order).

    Returns `(child, None)` for the first accepted child, or `(None, residual)` with the distribution `(vocab_size,)`
    of the next token when all are rejected (`target_probs` itself when there are no children).
    """
    residual = target_probs  # p', [vocab]
    for rank, child in enumerate(children):
        if rank == 0:
            accepted = accepted_first[child]  # computed for all nodes at once: p' is still p for the first child
        else:
            accepted = bool(uniform[child] * draft_token_probs[child] < residual[token_ids[child]])
        if accepted:
            return child, None
        residual = residual_distribution(residual, draft_probs[child])
    return None, residual
