"""The verifier interface: a pure function of a draft and the target's scores."""

from dataclasses import dataclass

import torch

from ..draft import Draft
from ..sampling import sample


@dataclass(frozen=True)
class Verdict:
    """What a verifier kept of a draft.

    Args:
        accepted_nodes (`torch.LongTensor` of shape `(num_accepted,)`):
            Indices into the draft's nodes of the accepted path, root to leaf (`arange(num_accepted)` for a chain).
        next_token (`torch.LongTensor` of shape `()`):
            The token the target adds after the accepted path: the bonus token when every node on the path was
            accepted up to a leaf, otherwise the recovered (corrected) token.
    """

    accepted_nodes: torch.LongTensor
    next_token: torch.LongTensor

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


class Verifier:
    """Decides which draft tokens to keep, given the target's processed scores at every draft position.

    A verifier never sees a model: it is called as `verifier(draft, target_scores, do_sample=..., generator=...)`
    where `target_scores` is a `torch.FloatTensor` of shape `(num_nodes + 1, vocab_size)` holding the target's
    scores after the generate call's logits processors and warpers; row 0 scores the token after the last
    committed token and row i + 1 the token after node i (for a chain: after the first i + 1 draft tokens).
    It returns the accepted root-to-leaf path of the draft (a prefix, for a chain) and the next token.

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


class NodewiseVerifier(Verifier):
    """A verifier that judges every node on its own and keeps the deepest path of accepted nodes.

    Node i is judged by `accepts` from its token and the target's scores after its parent (row
    `parent_ids[i] + 1`). The kept path is the deepest one on which every node is accepted; the next token is the
    target's argmax after it under greedy decoding, or a sample from the target's distribution there when sampling.
    """

    def accepts(self, token_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.BoolTensor:
        """Whether each draft token is acceptable on its own.

        Args:
            token_ids (`torch.LongTensor` of shape `(num_nodes,)`): the draft tokens.
            scores (`torch.FloatTensor` of shape `(num_nodes, vocab_size)`): row i, the target's processed scores
                of the token at node i's place (after its parent).

        Returns:
            `torch.BoolTensor` of shape `(num_nodes,)`.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement accepts(token_ids, scores)")

    def __call__(
        self, draft: Draft, target_scores: torch.FloatTensor, *, do_sample: bool, generator: torch.Generator | None
    ) -> Verdict:
        # [num_nodes, vocab]: the scores each node is judged by, the target's after its parent
        parent_scores = target_scores[:-1] if draft.is_chain else target_scores[draft.parent_ids + 1]
        node_accepted = self.accepts(draft.token_ids, parent_scores)  # [num_nodes]
        accepted_nodes = draft.tree.longest_path(node_accepted)
        # [vocab]: the scores after the path's last node (a chain's node i is row i + 1: no read of the device)
        after = len(accepted_nodes) if draft.is_chain or not len(accepted_nodes) else int(accepted_nodes[-1]) + 1
        scores = target_scores[after]
        next_token = sample(torch.softmax(scores, dim=-1), generator) if do_sample else scores.argmax()
        return Verdict(accepted_nodes=accepted_nodes, next_token=next_token)
