"""The two values that cross the drafter/verifier boundary: a `Draft` and a `Verdict`."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Draft:
    """Draft tokens proposed by a drafter for one speculative step.

    Args:
        token_ids (`torch.LongTensor` of shape `(num_nodes,)`):
            The draft tokens. A chain of k tokens has `num_nodes == k`.
        parent_ids (`torch.LongTensor` of shape `(num_nodes,)`):
            Index of each node's parent; -1 is the last committed token. A chain has `parent_ids[i] == i - 1`.
        draft_probs (`torch.FloatTensor` of shape `(num_nodes, vocab_size)`, *optional*):
            The distribution each node was sampled from, after the same logits processors as the target.
            `None` for a deterministic drafter (prompt lookup, greedy drafting): the draft is then treated
            as one-hot by lossless verification.
    """

    token_ids: torch.LongTensor
    parent_ids: torch.LongTensor
    draft_probs: torch.FloatTensor | None = None

    @classmethod
    def chain(cls, token_ids: torch.LongTensor, draft_probs: torch.FloatTensor | None = None) -> "Draft":
        """Builds a chain draft (each node the child of the one before) from `token_ids` of shape `(k,)`."""
        parent_ids = torch.arange(-1, len(token_ids) - 1, device=token_ids.device)
        return cls(token_ids=token_ids, parent_ids=parent_ids, draft_probs=draft_probs)

    @classmethod
    def empty(cls, device: torch.device) -> "Draft":
        """A draft with no tokens: the step then decodes one token as plain `generate` would."""
        return cls.chain(torch.empty(0, dtype=torch.long, device=device))

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        expected = torch.arange(-1, self.num_nodes - 1, device=self.parent_ids.device)
        return bool(torch.equal(self.parent_ids, expected))


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
