"""The plain-speed floor: each row stops drafting while its drafts cost more than they bring, and probes again.

The floor sits beneath every schedule (the constant one included): the loop asks the schedule for a draft length,
then the floor for which rows draft at all (`PlainFloor.budgets`), and tells both what the step did. A row the
floor holds plain runs a plain one-token step (draft length 0; with every row plain the drafter is not called at
all). Only the steps before a decision count, so rejection sampling stays lossless and greedy output exact.

The rule, from this call's own steps: a drafted step costs the plain step's seconds `P` plus `extra` seconds per
drafting row (`extra` measured as the drafted steps' mean seconds over `P`, shared among their mean drafting rows; not counting
the call's first drafted step, which also starts the drafter, and each at most twice the mean so far), and
gives row r `tokens[r]` tokens (a moving average of what its drafted steps committed, the bonus or recovered
token included) where a plain step gives 1. Row r drafts while `tokens[r] > 1 + extra / P`, in a batch as alone:
a generate call lasts until its last row is done, so a row held plain does not save the batch its steps, it becomes
the row the call waits for, and every plain step it adds costs the call a whole step. (Ranking the rows by the
batch's tokens per second instead, `(tokens[r] - 1) / extra` against the batch's `B / P`, held rows plain at B
times the break-even and lost at batch size 4: `docs/benchmarks/floor.md`.) A row that commits nothing beyond
the next token (`tokens == 1`) never drafts past its first `min_drafted_steps` drafted steps and probes. Until
a plain step was measured, `P` is taken as a drafted step's verification seconds (which scored more tokens, so
too much) and a row needs `calibration_margin` times the break-even to keep drafting.

Probing: a plain row drafts again once it has run `wait` plain steps, counted so that a probe's `extra` seconds
are at most a share `budget` of the plain steps' seconds before it: `wait = ceil(extra / (budget * P))` (at least
1, at most `max_wait`). So a free drafter (prompt lookup, suffix decoding) probes every step or two and a draft
model waits longer, as in the goodput schedule. The budget starts at `probe_overhead`; a probe that does not win
the row back halves it, down to `min_probe_overhead`; one that does restores it. The probe's tokens count with
weight `probe_weight` in the row's average. A drafter with its own cache (a draft model, a head) also catches up
on the tokens committed in the plain steps, in one draft forward of at most `max_wait` + 1 tokens (compiled: the
excess over k + 1 eagerly), which a steady run of drafted steps does not pay. So a step in which a row probes
counts only in the probes' own `extra` (`probe_extra`, the `extra` of the waits once measured), not in the drafted
steps' costs that decide whether a row drafts (counted there, the catch-ups made drafts look dearer than they are,
and the floor held rows plain where drafting paid: `docs/benchmarks/floor.md`). Probing costs at most
`probe_overhead` of the plain steps' time right after the floor engages, and at most `min_probe_overhead` (or
`extra / (max_wait * P)`) over a long plain stretch.

A floor may start from an earlier call's costs and its rows' mean tokens per drafted step and probe budget
(`summary`, `start_from`: the hybrid drafter's floor for its model does, across the calls of one drafter): its
rows are then judged from their first step, as after `min_drafted_steps` drafted steps, and probe as rarely as the
earlier call's did.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .schedules.goodput import MIN_OBSERVATIONS, capped
from .step import RowOutcome


@dataclass
class RowFloor:
    """One row's floor state.

    Args:
        tokens (`float`): the moving average of tokens committed per drafted step (`None` before one).
        num_drafted (`int`): drafted steps observed.
        plain (`bool`): whether the floor holds the row plain.
        budget (`float`): the share of the plain steps' seconds a probe may cost; `left`: plain steps before the
            next probe.
        num_plain_steps (`int`): steps the floor held the row plain.
    """

    tokens: float | None = None
    num_drafted: int = 0
    plain: bool = False
    budget: float = 0.0
    left: int = 0
    num_plain_steps: int = 0


class PlainFloor:
    """Decides, step by step, which rows draft and which run plain (see the module docstring).

    Args:
        memory (`float`, defaults to 0.8): the decay of a row's tokens per drafted step (about 5 steps count).
        min_drafted_steps (`int`, defaults to 4): drafted steps a row runs before the floor may hold it plain.
        probe_overhead (`float`, defaults to 0.5), min_probe_overhead (`float`, defaults to 1/32): the most a probe
            may cost as a share of the plain steps' seconds before it, at first and after losing probes.
        max_wait (`int`, defaults to 32): the most plain steps between probes.
        probe_weight (`float`, defaults to 0.5): a probe's weight in the row's average.
        calibration_margin (`float`, defaults to 1.25): how far above break-even a row must be to keep drafting
            before a plain step's cost was measured.
        cost_memory (`float`, defaults to 0.9): the decay of the step costs' moving averages.
    """

    def __init__(self, memory: float = 0.8, min_drafted_steps: int = 4, probe_overhead: float = 0.5,
                 min_probe_overhead: float = 1 / 32, max_wait: int = 32, probe_weight: float = 0.5,
                 calibration_margin: float = 1.25, cost_memory: float = 0.9):
        self.memory, self.min_drafted_steps, self.probe_weight = memory, min_drafted_steps, probe_weight
        self.probe_overhead, self.min_probe_overhead = probe_overhead, min_probe_overhead
        self.max_wait, self.calibration_margin = max_wait, calibration_margin
        self.cost_memory = cost_memory
        self.rows: dict[int, RowFloor] = {}
        # moving averages: a plain step's seconds; a drafted step's seconds, verification seconds and drafting rows
        self.plain_seconds = self.drafted_seconds = self.verify_seconds = self.drafting_rows = None
        self.probe_extra = None  # a probe step's seconds over a plain step's per drafting row (catch-ups included)
        self.num_drafted_steps = 0
        self.probing: set[int] = set()
        # a new row's tokens per drafted step and probe budget, from an earlier call (`start_from`)
        self.prior_tokens: float | None = None
        self.prior_budget = probe_overhead

    def budgets(self, rows: Sequence[int], budgets: Sequence[int]) -> list[int]:
        """Each running row's draft length: the schedule's `budgets`, or 0 where the floor holds the row plain."""
        self.probing = set()
        chosen = []
        for row, budget in zip(rows, budgets):
            state = self.rows.get(row) or self._new_row(row)
            if budget and state.plain:
                if state.left > 0:
                    state.left -= 1
                    state.num_plain_steps += 1
                    budget = 0
                else:
                    self.probing.add(row)
            chosen.append(budget)
        return chosen

    def update(self, outcomes: Sequence[RowOutcome], draft_seconds: float, verify_seconds: float) -> None:
        """Takes in one step of every running row (as `DraftLengthSchedule.update`) and sets which rows draft next."""
        drafted = [outcome for outcome in outcomes if outcome.num_nodes > 0]
        seconds = draft_seconds + verify_seconds
        if not drafted:
            if all(outcome.draft_length == 0 for outcome in outcomes):
                self.plain_seconds = self._average(self.plain_seconds, seconds)
        elif any(outcome.row in self.probing for outcome in drafted):  # it also caught up on the plain steps
            self.probe_extra = self._average(self.probe_extra, self._extra_per_row(seconds, len(drafted)))
        elif self.num_drafted_steps > 0:  # the first drafted step also starts the drafter (a draft model's prefill)
            expected = self.drafted_seconds if self.num_drafted_steps > MIN_OBSERVATIONS else None
            self.drafted_seconds = self._average(self.drafted_seconds, capped(seconds, expected))
            self.verify_seconds = self._average(self.verify_seconds, verify_seconds)
            self.drafting_rows = self._average(self.drafting_rows, float(len(drafted)))
        self.num_drafted_steps += bool(drafted)
        for outcome in drafted:
            state = self.rows[outcome.row]
            weight = self.probe_weight if outcome.row in self.probing else 1.0 - self.memory
            tokens = float(outcome.num_committed if outcome.finished else outcome.num_accepted + 1)
            state.tokens = tokens if state.tokens is None else (1.0 - weight) * state.tokens + weight * tokens
            state.num_drafted += 1
        self._decide([outcome.row for outcome in outcomes if not outcome.finished])

    def _new_row(self, row: int) -> RowFloor:
        """A row's state at its first step: nothing measured, or with an earlier call's prior (`start_from`) as after
        `min_drafted_steps` drafted steps, held plain at once where those lost."""
        state = self.rows[row] = RowFloor(budget=self.prior_budget)
        if self.prior_tokens is not None:
            state.tokens, state.num_drafted = self.prior_tokens, self.min_drafted_steps
            self._decide([row])
        return state

    def summary(self) -> tuple | None:
        """What a later call may start from (`start_from`): this call's step costs, and its rows' mean tokens per
        drafted step and probe budget; `None` before a drafted step was measured."""
        rows = [state for state in self.rows.values() if state.tokens is not None]
        if self.drafted_seconds is None or not rows:
            return None
        costs = (self.plain_seconds, self.drafted_seconds, self.verify_seconds, self.drafting_rows)
        return costs, sum(state.tokens for state in rows) / len(rows), sum(state.budget for state in rows) / len(rows)

    def start_from(self, summary: tuple) -> None:
        """Starts a call from an earlier call's `summary`: its step costs (as measured over more than
        `MIN_OBSERVATIONS` drafted steps, so that a drafted step counts as at most twice their mean), and each row's
        tokens per drafted step and probe budget at their mean, so a row whose drafts lost there is held plain from
        its first step and probes as rarely as there."""
        costs, self.prior_tokens, self.prior_budget = summary
        self.plain_seconds, self.drafted_seconds, self.verify_seconds, self.drafting_rows = costs
        self.num_drafted_steps = MIN_OBSERVATIONS + 1

    def _average(self, average: float | None, value: float) -> float:
        return value if average is None else self.cost_memory * average + (1.0 - self.cost_memory) * value

    def _decide(self, rows: list[int]) -> None:
        """Chooses the rows that draft next step: those whose drafted steps beat the plain steps they replace."""
        if self.drafted_seconds is None:  # no drafted step measured yet
            return
        margin = 1.0 if self.plain_seconds is not None else self.calibration_margin
        break_even = 1.0 + margin * self._extra_seconds() / max(self._plain_seconds(), 1e-9)
        for row in rows:
            state = self.rows[row]
            if state.tokens is not None and not (state.plain and row not in self.probing):
                self._set(row, state.tokens > break_even)

    def _set(self, row: int, drafts: bool) -> None:
        """Holds row `row` plain (after `min_drafted_steps` drafted steps), or lets it draft."""
        state = self.rows[row]
        if drafts:
            if state.plain:  # a probe won the row back
                state.budget = self.probe_overhead
            state.plain = False
        elif state.num_drafted >= self.min_drafted_steps:
            if state.plain and row in self.probing:  # a probe that lost
                state.budget = max(state.budget / 2, self.min_probe_overhead)
            state.plain, state.left = True, self._wait(state.budget)

    def _plain_seconds(self) -> float:
        """A plain step's seconds: measured, or until then a drafted step's verification seconds (too many)."""
        return self.plain_seconds if self.plain_seconds is not None else self.verify_seconds

    def _extra_seconds(self) -> float:
        """What one drafting row adds to a step's seconds."""
        return self._extra_per_row(self.drafted_seconds, self.drafting_rows)

    def _extra_per_row(self, seconds: float, rows: float) -> float:
        """A step's `seconds` over a plain step's, per drafting row of its `rows`."""
        return max(0.0, seconds - self._plain_seconds()) / rows

    def _wait(self, budget: float) -> int:
        """Plain steps before a probe whose extra seconds (as measured for probes, else a drafted step's) are at most
        `budget` of theirs."""
        plain = max(self._plain_seconds(), 1e-9)
        extra = self._extra_seconds() if self.probe_extra is None else self.probe_extra
        return min(self.max_wait, max(1, math.ceil(extra / (budget * plain))))

    def num_plain_steps(self, row: int) -> int:
        """The steps the floor held row `row` plain."""
        return self.rows[row].num_plain_steps if row in self.rows else 0
