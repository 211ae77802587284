"""Exact (greedy) verification."""

import torch

from .base import NodewiseVerifier


class ExactVerifier(NodewiseVerifier):
    """Accepts the longest draft path on which every token is the target's argmax.

    For a chain this is the longest prefix equal to the target's greedy tokens (speculative greedy decoding,
    Leviathan et al. 2023, Section 2); for a token tree, the deepest root-to-leaf path whose every node is the
    target's argmax after its parent (SpecInfer, Miao et al. 2024). The next token is the target's argmax after
    the accepted path, so the output is token for token the output of `model.generate(do_sample=False)`.

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

    def accepts(self, token_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.BoolTensor:
        return token_ids == scores.argmax(-1)
