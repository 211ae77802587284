"""The verifier interface: a pure function of a draft and the target's scores."""

import torch

from ..types import Draft, Verdict


class Verifier:
    """Decides which draft tokens to keep, given the target's processed scores at every draft position.

    A verifier never sees a model: it is called as `verifier(draft, target_scores, do_sample=..., generator=...)`
    where `target_scores` is a `torch.FloatTensor` of shape `(num_nodes + 1, vocab_size)` holding the target's
    scores after the generate call's logits processors and warpers; row i scores the token after the path to
    node i - 1 (row 0: after the last committed token; the last row: after the last node of a chain).

    Attributes:
        name (`str`): the name `verifier=` accepts.
        lossless (`bool`): whether the output keeps the target's own distribution (greedy: its greedy output).
    """

    name: str = ""
    lossless: bool = True

    def validate(self, do_sample: bool) -> None:
        """Raises `ValueError` before generation starts if this verifier cannot serve the decoding mode."""

    def __call__(
        self, draft: Draft, target_scores: torch.FloatTensor, *, do_sample: bool, generator: torch.Generator | None
    ) -> Verdict:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(draft, target_scores, ...)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
