"""The data of one speculative step, every field with its shape: what the drafter proposes (`Proposal`, with an
optional `Resume`), what the target's forward returns (`TargetOutput`) and what the step did in each row
(`RowOutcome`), which feeds the stats, the schedule and the drafter's feedback."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .draft import Draft


@dataclass(frozen=True)
class Resume:
    """A drafter's request that the loop's target forward starts at decoder layer `exit_layer` (layer skip).

    The drafter already ran layers `[0, exit_layer)` over the step's query slots while drafting, writing their keys
    and values into the target's cache; the loop runs only layers `[exit_layer, L)` from `hidden_states`.

    Args:
        exit_layer (`int`): the first layer the loop runs.
        hidden_states (`torch.FloatTensor` of shape `(batch_size, num_query, hidden_size)`): the hidden states
            entering `exit_layer` for every query slot.
        valid (`torch.BoolTensor` of shape `(batch_size, num_query)`): the query slots the drafter fed (the loop
            checks they are the slots it builds).
    """

    exit_layer: int
    hidden_states: torch.FloatTensor
    valid: torch.BoolTensor


@dataclass(frozen=True)
class Proposal(Sequence):
    """What `Drafter.propose` returns: one draft per running row and, optionally, where the target's forward resumes.

    A proposal is also the sequence of its drafts (`proposal[i]`, `len`, iteration), so code that reads a list of
    drafts reads it unchanged; a drafter that never resumes may return a plain list of drafts (`Proposal.of`).

    Args:
        drafts (`list[Draft]`): row i's draft (a chain or a token tree; `Draft.empty` for none), in `rows` order.
        resume (`Resume`, *optional*): the drafter already ran the target's first layers over the verification query
            the loop builds from `drafts` (layer skip); the forward starts at `resume.exit_layer`.
    """

    drafts: list[Draft]
    resume: Resume | None = None

    @classmethod
    def of(cls, proposed: "Proposal | Sequence[Draft]") -> "Proposal":
        """`proposed` as a `Proposal`: a plain sequence of drafts is one without a resume."""
        return proposed if isinstance(proposed, Proposal) else cls(list(proposed))

    def __getitem__(self, index):
        return self.drafts[index]

    def __len__(self) -> int:
        return len(self.drafts)


@dataclass(frozen=True)
class TargetOutput:
    """What one target forward over a step's query (or a prefill) returns.

    Args:
        logits (`torch.FloatTensor` of shape `(batch_size, num_logits, vocab_size)`): the logits of the query's
            last `num_logits` slots (every slot in a step).
        features (`torch.FloatTensor` of shape `(batch_size, num_query, width)`, *optional*): the hidden states the
            drafter's `TargetNeeds` asks for at every query slot, concatenated (`None` when it asks for none).
    """

    logits: torch.FloatTensor
    features: torch.FloatTensor | None = None


@dataclass(frozen=True)
class RowOutcome:
    """What one step did in one row: what it drafted, what the verifier accepted and what was committed.

    Args:
        row (`int`): the row's index in the generate call's batch.
        draft_length (`int`): the draft length the step asked for (0: a plain step, the drafter not called).
        num_nodes (`int`): the draft tokens (tree nodes) the drafter returned.
        depth (`int`): the draft's longest path (`num_nodes` for a chain).
        accepted_nodes (`list[int]`): the accepted draft nodes, root to leaf, as the verifier chose them.
        num_committed (`int`): the tokens added to the row (accepted ones and the next token, up to a stopping
            criterion), at least 1.
        finished (`bool`): whether the row met a stopping criterion (it leaves the batch).
    """

    row: int
    draft_length: int
    num_nodes: int
    depth: int
    accepted_nodes: list[int]
    num_committed: int
    finished: bool

    @property
    def num_accepted(self) -> int:
        """The accepted draft tokens, as the verifier counted them (a stopping criterion may have kept fewer)."""
        return len(self.accepted_nodes)

    @property
    def kept_slots(self) -> list[int]:
        """The row's query slots its cache keeps: the pending token (slot 0), then the accepted path."""
        return [0] + [1 + node for node in self.accepted_nodes]
