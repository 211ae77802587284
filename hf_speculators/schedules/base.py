"""The draft-length schedule interface, and the two schedules without a model: constant and transformers' heuristic.

A schedule sits beside the drafter, not inside it: the loop reads `schedule.draft_length` before each step and
calls `schedule.update(...)` after it with what the step drafted, accepted and cost (seconds from the clock reads
the loop makes anyway). It never sees the drafter, so every drafter gets it, and a step's draft length depends
only on the steps before it, which keeps rejection sampling lossless. One schedule object serves one generate call.
"""

from collections.abc import Sequence

from ..step import RowOutcome


class DraftLengthSchedule:
    """How many draft tokens each step asks the drafter for (for a tree: its depth).

    Args:
        num_draft_tokens (`int`): the drafter's `num_draft_tokens`: the constant length, the heuristic's starting
            length, or the goodput schedule's upper bound.

    Attributes:
        draft_length (`int`): the draft length of the next step, >= 0 (0: a plain one-token step). The loop also
            caps it by what the length limit leaves.
    """

    name: str = ""

    def __init__(self, num_draft_tokens: int):
        self.num_draft_tokens = num_draft_tokens
        self.draft_length = num_draft_tokens

    def update(self, outcomes: Sequence[RowOutcome], draft_seconds: float, verify_seconds: float) -> None:
        """Takes in one finished step of every running row; the default (a constant length) ignores it.

        Args:
            outcomes (`Sequence[RowOutcome]`): per running row, what the step asked for (`draft_length`: the
                schedule's, capped by the length limit, or 0 where the plain-speed floor held the row plain), drafted (`num_nodes`, `depth`) and accepted
                (`num_accepted`, a root-to-leaf path).
            draft_seconds (`float`): seconds spent drafting for every row.
            verify_seconds (`float`): seconds spent in the one target forward, verification and commit; it scored
                `len(outcomes) * (max(num_nodes) + 1)` query slots.
        """


class ConstantSchedule(DraftLengthSchedule):
    """`num_draft_tokens` draft tokens every step (transformers' `num_assistant_tokens_schedule="constant"`)."""

    name = "constant"


class HeuristicSchedule(DraftLengthSchedule):
    """transformers' `num_assistant_tokens_schedule="heuristic"` rule, for comparison.

    Starts at `num_draft_tokens`; after a step whose every draft token was accepted (in a batch: in every row that
    drafted) the length grows by 2 (with
    no upper bound, as in transformers), after any other step it shrinks by 1, never below 1. A step whose draft
    came back empty in every row (prompt lookup found no match) leaves it as it is. The length starts afresh in each generate
    call, as transformers' `"heuristic_transient"` (this library keeps no state across calls).
    """

    name = "heuristic"

    def update(self, outcomes, draft_seconds, verify_seconds) -> None:
        drafted = [outcome for outcome in outcomes if outcome.num_nodes > 0]
        if drafted:
            complete = all(outcome.num_accepted == outcome.num_nodes for outcome in drafted)
            self.draft_length = self.draft_length + 2 if complete else max(1, self.draft_length - 1)
