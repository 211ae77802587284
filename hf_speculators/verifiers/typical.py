"""Typical acceptance: relaxed verification that accepts any token the target finds typical enough."""

import math

import torch

from .base import NodewiseVerifier


class TypicalVerifier(NodewiseVerifier):
    """Accepts draft token x when `p(x) > min(epsilon, delta * exp(-H(p)))` (typical acceptance, Medusa, Cai et al.
    2024, Section 2.3.1).

    p is the target's distribution after the generate call's processors and warpers (a softmax of the processed
    scores, under greedy decoding too) and H(p) its entropy in nats: where the target is sure, only its likely
    tokens pass; where it hesitates, the bar drops to `epsilon` at most. On a tree the deepest path of accepted
    tokens is kept; the next token is the target's argmax (greedy) or a sample from p (sampling).

    Not lossless: the output is not the target's own, and `speculative_stats.lossless` is `False`.

    Args:
        epsilon (`float`, defaults to 0.09): the hard threshold, in (0, 1] (Medusa's `posterior_threshold`).
        delta (`float`, *optional*, defaults to `sqrt(epsilon)`): the entropy-dependent threshold's scale, > 0
            (Medusa's `posterior_alpha`).

    Raises:
        `ValueError`: for `epsilon` outside (0, 1] or `delta <= 0`.
    """

    name = "typical"
    lossless = False

    def __init__(self, epsilon: float = 0.09, delta: float | None = None):
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0 < epsilon <= 1:
            raise ValueError(f"epsilon must be a number in (0, 1], got {epsilon!r}.")
        delta = math.sqrt(epsilon) if delta is None else delta
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not delta > 0:
            raise ValueError(f"delta must be a number > 0, got {delta!r}.")
        self.epsilon, self.delta = float(epsilon), float(delta)

    def accepts(self, token_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.BoolTensor:
        probs = torch.softmax(scores, dim=-1)  # [num_nodes, vocab]
        entropy = torch.special.entr(probs).sum(-1)  # [num_nodes], 0 * log 0 counted as 0
        threshold = torch.clamp(self.delta * torch.exp(-entropy), max=self.epsilon)
        return probs.gather(-1, token_ids[:, None])[:, 0] > threshold

    def __repr__(self) -> str:
        return f"TypicalVerifier(epsilon={self.epsilon:g}, delta={self.delta:.4g})"
