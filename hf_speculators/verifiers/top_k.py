"""Top-k verification with a tolerance: relaxed verification that accepts near-best tokens."""

import math

import torch

from .base import NodewiseVerifier


class TopKVerifier(NodewiseVerifier):
    """Accepts draft token x when it is among the target's `top_k` tokens and its log-probability is within
    `accept_tolerance` nats of the best token's (top-k verification with a tolerance, SpecDec, Xia et al. 2023).

    These are the `verifier_accept_k` and `accept_tolerance` fields of the vllm-project/speculators format, whose
    defaults there (1 and 0.0) amount to greedy verification. Log-probabilities come from the target's scores
    after the generate call's processors and warpers. On a tree the deepest path of accepted tokens is kept; the
    next token is the target's argmax (greedy) or a sample from its distribution (sampling).

    Not lossless: the output is not the target's own, and `speculative_stats.lossless` is `False`.

    Args:
        top_k (`int`, defaults to 3): how many of the target's best tokens may be accepted, >= 1.
        accept_tolerance (`float`, defaults to 1.0): the largest log-probability gap to the best token, in nats, >= 0.

    Raises:
        `ValueError`: for `top_k` not an integer >= 1 or `accept_tolerance` not a number >= 0.
    """

    name = "top_k"
    lossless = False

    def __init__(self, top_k: int = 3, accept_tolerance: float = 1.0):
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}.")
        if (isinstance(accept_tolerance, bool) or not isinstance(accept_tolerance, (int, float))
                or math.isnan(accept_tolerance) or accept_tolerance < 0):
            raise ValueError(f"accept_tolerance must be a number >= 0 (nats), got {accept_tolerance!r}.")
        self.top_k, self.accept_tolerance = top_k, float(accept_tolerance)

    def accepts(self, token_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.BoolTensor:
        log_probs = torch.log_softmax(scores, dim=-1)  # [num_nodes, vocab]
        token_log_probs = log_probs.gather(-1, token_ids[:, None])  # [num_nodes, 1]
        rank = (log_probs > token_log_probs).sum(-1)  # tokens strictly more likely than the draft token
        gap = log_probs.max(-1).values - token_log_probs[:, 0]
        return (rank < self.top_k) & (gap <= self.accept_tolerance)

    def __repr__(self) -> str:
        return f"TopKVerifier(top_k={self.top_k}, accept_tolerance={self.accept_tolerance:g})"
