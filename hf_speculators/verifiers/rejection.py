"""Lossless speculative sampling."""

import torch

from ..sampling import one_hot_probs, probabilities, residual_distribution, sample
from ..types import Draft, Verdict
from .base import Verifier


class RejectionVerifier(Verifier):
    """Lossless rejection sampling of a chain draft (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

    Draft token x at position i, drawn from the draft distribution q_i, is accepted with probability
    `min(1, p_i(x) / q_i(x))`, p_i being the target's distribution after the generate call's processors and
    warpers. At the first rejection the recovered token is drawn from `norm(max(0, p_i - q_i))`; if every
    token is accepted, a bonus token is drawn from p_k. The tokens produced are distributed exactly as the
    target's own samples. A deterministic drafter (no `draft_probs`) is treated as one-hot.

    With `do_sample=False`, p is the one-hot argmax and the result equals exact greedy verification.
    All randomness comes from the `generator` passed in.
    """

    name = "rejection"
    lossless = True

    def __call__(
        self, draft: Draft, target_scores: torch.FloatTensor, *, do_sample: bool, generator: torch.Generator | None
    ) -> Verdict:
        target_probs = probabilities(target_scores, do_sample)  # [k + 1, vocab]
        num_nodes = draft.num_nodes
        draft_probs = draft.draft_probs
        if draft_probs is None:
            draft_probs = one_hot_probs(draft.token_ids, target_probs.shape[-1])  # [k, vocab]
        positions = torch.arange(num_nodes, device=target_probs.device)
        p = target_probs[positions, draft.token_ids]  # [k]
        q = draft_probs[positions, draft.token_ids]  # [k]
        uniform = torch.rand(num_nodes, generator=generator, device=target_probs.device)
        accepted = (uniform * q < p).long()  # u < p / q, with q > 0 for a token drawn from q
        num_accepted = int(accepted.cumprod(0).sum())
        if num_accepted == num_nodes:
            next_token = sample(target_probs[num_nodes], generator)  # bonus token
        else:
            residual = residual_distribution(target_probs[num_accepted], draft_probs[num_accepted])
            next_token = sample(residual, generator)  # recovered token
        return Verdict(accepted_nodes=positions[:num_accepted], next_token=next_token)
