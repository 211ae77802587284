"""What a drafter proposes for one step: a `Draft` (a chain or a token tree, with unverified tokens if asked)."""

from dataclasses import dataclass
from functools import cached_property

import torch

from .tree import TokenTree


@dataclass(frozen=True)
class Draft:
    """Draft tokens proposed by a drafter for one speculative step.

    Args:
        token_ids (`torch.LongTensor` of shape `(num_nodes,)`):
            The draft tokens. A chain of k tokens has `num_nodes == k`.
        parent_ids (`torch.LongTensor` of shape `(num_nodes,)`):
            Index of each node's parent; -1 is the last committed token. A chain has `parent_ids[i] == i - 1`;
            in a tree every parent comes before its children (see `TokenTree`).
        draft_probs (`torch.FloatTensor` of shape `(num_nodes, vocab_size)`, *optional*):
            The distribution each node was sampled from, after the same logits processors as the target: for a
            node of a tree, given its path and the siblings drawn before it (the same row for siblings drawn
            independently; the row without the earlier siblings' tokens, renormalized, for siblings drawn without
            replacement). `None` for a deterministic drafter (prompt lookup, greedy drafting, top-k tree
            expansion): lossless verification then treats every node as one-hot, which is lossless for any tree.
        extra_token_ids (`torch.LongTensor` of shape `(num_extra,)`, *optional*): tokens the target scores in the
            same forward but that are not verified (lookahead decoding's window); the loop returns their logits to
            the drafter (`StepFeedback.extra_logits`) and keeps none of them in the cache.
        extra_offsets (`torch.LongTensor` of shape `(num_extra,)`, *optional*): each extra token's position after
            the committed tokens' cache (the pending token is at 0, a node at depth d at 1 + d).
        extra_visible (`torch.BoolTensor` of shape `(num_extra, 1 + num_nodes + num_extra)`, *optional*): which
            query slots (the pending token, the nodes, the extra tokens) each extra token attends to, besides the
            cached tokens.

    Raises:
        `ValueError`: if `token_ids` and `parent_ids` differ in length or `draft_probs` has another number of rows.
    """

    token_ids: torch.LongTensor
    parent_ids: torch.LongTensor
    draft_probs: torch.FloatTensor | None = None
    extra_token_ids: torch.LongTensor | None = None
    extra_offsets: torch.LongTensor | None = None
    extra_visible: torch.BoolTensor | None = None

    def __post_init__(self):
        if self.token_ids.shape != self.parent_ids.shape or self.token_ids.ndim != 1:
            raise ValueError(
                f"A draft needs 1D token_ids and parent_ids of the same length, got shapes "
                f"{tuple(self.token_ids.shape)} and {tuple(self.parent_ids.shape)}."
            )
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.token_ids):
            raise ValueError(
                f"draft_probs needs one row per node ({len(self.token_ids)} rows), got shape "
                f"{tuple(self.draft_probs.shape)}."
            )
        if self.extra_token_ids is not None:
            num_extra, width = len(self.extra_token_ids), 1 + len(self.token_ids) + len(self.extra_token_ids)
            if (self.extra_offsets is None or self.extra_offsets.shape != (num_extra,) or self.extra_visible is None
                    or self.extra_visible.shape != (num_extra, width)):
                raise ValueError(
                    f"Extra (unverified) tokens need extra_offsets of shape ({num_extra},) and extra_visible of shape "
                    f"({num_extra}, {width}) (pending token, nodes, extra tokens)."
                )

    @classmethod
    def chain(cls, token_ids: torch.LongTensor, draft_probs: torch.FloatTensor | None = None) -> "Draft":
        """Builds a chain draft (each node the child of the one before) from `token_ids` of shape `(k,)`."""
        parent_ids = torch.arange(-1, len(token_ids) - 1, device=token_ids.device)
        return cls(token_ids=token_ids, parent_ids=parent_ids, draft_probs=draft_probs)

    @classmethod
    def from_lists(cls, token_ids: list[int], parent_ids: list[int], device: torch.device | str) -> "Draft":
        """Builds a deterministic draft (`draft_probs=None`) from Python lists of tokens and parent indices."""
        return cls(token_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
                   parent_ids=torch.tensor(parent_ids, dtype=torch.long, device=device))

    @classmethod
    def empty(cls, device: torch.device) -> "Draft":
        """A draft with no tokens: the step then decodes one token as plain `generate` would."""
        return cls.chain(torch.empty(0, dtype=torch.long, device=device))

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def num_extra(self) -> int:
        """Unverified tokens scored after the nodes (0 for most drafters)."""
        return 0 if self.extra_token_ids is None else len(self.extra_token_ids)

    @cached_property
    def tree(self) -> TokenTree:
        """The draft's structure (validated on first use: a malformed `parent_ids` raises `ValueError`)."""
        return TokenTree(self.parent_ids)

    @property
    def is_chain(self) -> bool:
        return self.tree.is_chain
