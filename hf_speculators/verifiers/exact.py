"""Exact (greedy) verification."""

import torch

from ..types import Draft, Verdict
from .base import Verifier


class ExactVerifier(Verifier):
    """Accepts the longest prefix of the draft that equals the target's argmax at each position.

    The output is token for token the output of `model.generate(do_sample=False)` (speculative greedy decoding,
    Leviathan et al. 2023, Section 2). The next token is the target's argmax after the accepted prefix.

    Raises:
        `ValueError`: at the start of a generate call with `do_sample=True` (use `verifier="rejection"`).
    """

    name = "exact"
    lossless = True

    def validate(self, do_sample: bool) -> None:
        if do_sample:
            raise ValueError(
                "verifier='exact' reproduces greedy decoding and cannot sample. With do_sample=True use "
                "verifier='rejection' (lossless speculative sampling), or set do_sample=False."
            )

    def __call__(
        self, draft: Draft, target_scores: torch.FloatTensor, *, do_sample: bool, generator: torch.Generator | None
    ) -> Verdict:
        target_tokens = target_scores.argmax(-1)  # [num_nodes + 1]
        matches = (draft.token_ids == target_tokens[:-1]).long()
        num_accepted = int(matches.cumprod(0).sum())
        accepted_nodes = torch.arange(num_accepted, device=target_tokens.device)
        return Verdict(accepted_nodes=accepted_nodes, next_token=target_tokens[num_accepted])
