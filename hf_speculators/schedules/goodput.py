"""The goodput schedule: each step's draft length chosen to maximize expected tokens per second.

Goodput of a draft length k (in the spirit of SmartSpec, Liu et al. 2024, arXiv 2406.14066, with the cost model
of Leviathan et al. 2023 measured instead of assumed):

    goodput(k) = E[tokens committed | k] / E[seconds of a step | k]
    E[tokens | k]  = 1 + sum_{i<k} Q_i * c_0 * ... * c_i               (bonus or recovered token included)
    E[seconds | k] = draft(d_k) + verify(B * (1 + r * d_k)),  d_k = sum_{i<k} Q_i   (k = 0: a plain step)

with c_i the acceptance rate at draft position (tree: depth) i given that every earlier position was accepted,
Q_i how often a draft asked for more than i tokens has a token at position i (prompt lookup may find fewer),
r the draft's nodes per depth (1 for a chain), B the rows of a batch (each step's one forward scores every row's
query, padded to the widest), and `draft` and `verify` straight lines fitted to the steps' seconds against the
deepest draft and the query slots scored (a plain step is a point of the verification line at one token). Every
estimate is an exponential moving average over the call's steps with a prior, so the first steps are sane.
"""

from .base import DraftLengthSchedule

# an observed duration counts as at most this multiple of what was expected: a step that the OS descheduled
# (a busy machine) should not make drafting look expensive for the next fifty steps
OUTLIER_RATIO = 2.0
MIN_OBSERVATIONS = 3  # observations before durations are capped


def capped(seconds: float, expected: float | None) -> float:
    """`seconds`, at most `OUTLIER_RATIO * expected` (not capped when `expected` is `None`)."""
    return seconds if expected is None else min(seconds, OUTLIER_RATIO * expected)


class MovingAverage:
    """The discounted mean of the values taken in: each value's weight decays by `memory` per later value.

    Args:
        memory (`float`): the decay factor, in (0, 1); about `1 / (1 - memory)` recent values count.
    """

    def __init__(self, memory: float):
        self.memory, self.weight, self.total, self.count = memory, 0.0, 0.0, 0

    def add(self, value: float) -> None:
        """Takes in `value`, capped at `OUTLIER_RATIO` times the mean after `MIN_OBSERVATIONS` values."""
        value = capped(value, self.value if self.count >= MIN_OBSERVATIONS else None)
        self.count += 1
        self.weight = self.memory * self.weight + 1.0
        self.total = self.memory * self.total + value

    @property
    def value(self) -> float | None:
        """The mean, or `None` before the first value."""
        return self.total / self.weight if self.weight else None


class CostFit:
    """A straight line `seconds = intercept + slope * tokens`, fitted by discounted least squares with a prior.

    The prior is the line `seconds = c * (1 + relative_slope * (tokens - 1))` through the mean observation: one
    token costs `c`, each extra one `relative_slope * c`. It pulls the slope with the weight of `prior_weight`
    observations one token apart, so one observed length already gives a line, and observations at several lengths
    take over. After `MIN_OBSERVATIONS`, an observation counts as at most `OUTLIER_RATIO` times the line's value.

    Args:
        relative_slope (`float`): the prior's cost of one more token relative to the first (1.0: proportional).
        memory (`float`): each observation's weight decays by this factor per later observation.
        prior_weight (`float`, defaults to 1.0): the prior's weight.
    """

    def __init__(self, relative_slope: float, memory: float, prior_weight: float = 1.0):
        self.relative_slope, self.memory, self.prior_weight = relative_slope, memory, prior_weight
        self.weight = self.tokens = self.tokens_squared = self.seconds = self.tokens_seconds = 0.0
        self.intercept = self.slope = 0.0
        self.count = 0

    def add(self, tokens: float, seconds: float) -> None:
        """Takes in one observation: `seconds` spent on `tokens` tokens; refits the line."""
        seconds = capped(seconds, self(tokens) if self.count >= MIN_OBSERVATIONS else None)
        self.count += 1
        m = self.memory
        self.weight = m * self.weight + 1.0
        self.tokens = m * self.tokens + tokens
        self.tokens_squared = m * self.tokens_squared + tokens * tokens
        self.seconds = m * self.seconds + seconds
        self.tokens_seconds = m * self.tokens_seconds + tokens * seconds
        mean_tokens, mean_seconds = self.tokens / self.weight, self.seconds / self.weight
        prior_slope = mean_seconds * self.relative_slope / (1.0 + self.relative_slope * (mean_tokens - 1.0))
        spread = self.tokens_squared - self.tokens * mean_tokens  # weighted sum of squared deviations
        covariance = self.tokens_seconds - self.tokens * mean_seconds
        self.slope = max(0.0, (covariance + self.prior_weight * prior_slope) / (spread + self.prior_weight))
        self.intercept = mean_seconds - self.slope * mean_tokens

    @property
    def fitted(self) -> bool:
        return self.count > 0

    def __call__(self, tokens: float) -> float:
        """Predicted seconds for `tokens` tokens (never below zero)."""
        return max(0.0, self.intercept + self.slope * tokens)


class GoodputSchedule(DraftLengthSchedule):
    """Chooses each step's draft length k in `0..num_draft_tokens` that maximizes expected tokens per second.

    The estimates (module docstring) come from this call's own steps: acceptance per draft position, the seconds
    of drafting and of verification measured by the loop's existing clock reads (no extra device synchronization).
    k = 0 runs a plain one-token step; while there, a probe step drafts again (the best k >= 1) so that a call that
    started badly, or a text that becomes copyable again, is noticed. The wait for a probe is counted in seconds,
    not steps: a probe runs once the plain steps since the last drafted step have taken `1 / budget` times the
    probe's expected extra seconds over a plain step (from `expected_tokens_and_seconds()`), so that
    probing costs at most `budget` of the plain steps' time however dear a draft is: a free drafter whose drafts
    are often empty (prompt lookup) probes every step or two, a draft model that costs a target forward per token
    waits longer. The budget starts at `probe_overhead`; a probe whose draft gets nothing accepted halves it, down
    to `min_probe_overhead` (on a call where drafts are never accepted, probes cost at most that fraction); an
    accepted probe restores it; a probe that found nothing to draft leaves it. Every `explore_interval` drafted
    steps, one step uses a neighbouring length (k - 1, then k + 1), so that the costs at other lengths and the
    acceptance one position further are measured, not only assumed. The first step drafts `num_draft_tokens`
    (nothing is measured yet).

    Args:
        num_draft_tokens (`int`): the upper bound on the draft length.
        prior_acceptance (`float`, defaults to 0.8): the prior acceptance rate at position 0; position i's prior is
            the estimate at position i - 1.
        prior_strength (`float`, defaults to 1.0): the priors' weight, in steps.
        memory (`float`, defaults to 0.95): the acceptance estimates' decay factor per later observation (about the
            last 20 drafts count).
        cost_memory (`float`, defaults to 0.98): the same for the costs (about the last 50 steps count: timings are
            noisy and change slowly).
        verify_relative_slope (`float`, defaults to 0.1): the prior cost of one more scored token relative to a
            one-token target forward (measured within a few steps).
        probe_overhead (`float`, defaults to 0.5), min_probe_overhead (`float`, defaults to 0.0625): the most a
            probe's expected extra seconds may be as a fraction of the plain steps' seconds before it, at first and
            after rejected probes (see above).
        explore_interval (`int` or `None`, defaults to 16): drafted steps between exploration steps; `None`: never.
    """

    name = "goodput"

    def __init__(self, num_draft_tokens: int, *, prior_acceptance: float = 0.8, prior_strength: float = 1.0,
                 memory: float = 0.95, cost_memory: float = 0.98, verify_relative_slope: float = 0.1,
                 probe_overhead: float = 0.5, min_probe_overhead: float = 0.0625, explore_interval: int | None = 16):
        super().__init__(num_draft_tokens)
        self.prior_acceptance, self.prior_strength, self.memory = prior_acceptance, prior_strength, memory
        self.reached = [0.0] * num_draft_tokens  # discounted steps whose draft reached position i (earlier accepted)
        self.accepted = [0.0] * num_draft_tokens  # ... of which position i was accepted
        self.asked = [0.0] * num_draft_tokens  # discounted steps that asked for more than i tokens
        self.present = [0.0] * num_draft_tokens  # ... of which the draft had a token at position i
        self.nodes_per_depth = MovingAverage(cost_memory)  # draft tokens per position (1 for a chain)
        self.draft_cost = CostFit(relative_slope=1.0, memory=cost_memory)  # seconds vs tokens drafted (depth)
        self.verify_cost = CostFit(relative_slope=verify_relative_slope, memory=cost_memory)  # vs tokens scored
        self.plain_cost = MovingAverage(cost_memory)  # seconds of a step without a draft
        self.probe_overhead, self.min_probe_overhead = probe_overhead, min_probe_overhead
        self.probe_budget, self.explore_interval = probe_overhead, explore_interval
        self.num_plain_steps = self.num_drafted_steps = 0  # plain steps since the last drafted one; drafted steps
        self.probing = False
        self.num_rows = 1  # rows of the last step, whose query the next step's verification cost scales with

    def update(self, outcomes, draft_seconds, verify_seconds) -> None:
        """Takes in one step of every running row (see `DraftLengthSchedule.update`): the acceptance of each row's
        draft, and the step's costs against its deepest draft and the query slots its one forward scored."""
        for outcome in outcomes:  # a row the length limit or the floor gave no draft length says nothing
            if outcome.draft_length > 0:
                self._observe_acceptance(min(outcome.draft_length, self.num_draft_tokens), outcome.depth,
                                         outcome.num_accepted)
        self.num_rows = len(outcomes)
        drafted = [outcome for outcome in outcomes if outcome.num_nodes > 0]
        if not drafted:  # a plain step
            self.plain_cost.add(draft_seconds + verify_seconds)
        else:
            self.draft_cost.add(max(outcome.depth for outcome in outcomes), draft_seconds)
            self.verify_cost.add(self.num_rows * (max(outcome.num_nodes for outcome in outcomes) + 1), verify_seconds)
            self.nodes_per_depth.add(sum(outcome.num_nodes / outcome.depth for outcome in drafted) / len(drafted))
        if self.probing and drafted:  # a probe that found nothing to draft (prompt lookup) says nothing
            self.probe_budget = (self.probe_overhead if any(outcome.num_accepted for outcome in outcomes) else
                                 max(self.probe_budget / 2, self.min_probe_overhead))
        self.draft_length = self._next_length()

    def _observe_acceptance(self, asked: int, depth: int, num_accepted: int) -> None:
        """Updates the counts of the positions the step asked for; the positions beyond decay four times as fast,
        so that one a short draft length leaves unobserved soon returns to its prior (the estimate one position
        earlier) instead of keeping an unlucky old estimate that would keep the draft length short."""
        m, num_reached = self.memory, min(num_accepted + 1, depth)  # reached: the accepted and the first rejected
        for i in range(asked):
            self.asked[i] = m * self.asked[i] + 1.0
            self.present[i] = m * self.present[i] + (i < depth)
            self.reached[i] = m * self.reached[i] + (i < num_reached)
            self.accepted[i] = m * self.accepted[i] + (i < num_accepted)
        fast = m**4
        for i in range(asked, self.num_draft_tokens):
            self.asked[i], self.present[i] = fast * self.asked[i], fast * self.present[i]
            self.reached[i], self.accepted[i] = fast * self.reached[i], fast * self.accepted[i]

    def expected_goodput(self) -> list[float]:
        """Entry k: the expected tokens per second of a step with draft length k, for k in `0..num_draft_tokens`."""
        return self._goodput_and_seconds()[0]

    def expected_tokens_and_seconds(self) -> tuple[list[float], list[float]]:
        """Entry k of each: the expected tokens committed (the bonus or recovered one included) and seconds of a step
        with draft length k, for k in `0..num_draft_tokens` (k = 0: a plain step). Needs a measured draft."""
        rows = self.num_rows
        plain = self.plain_cost.value if self.plain_cost.value is not None else self.verify_cost(rows)
        # the two cost lines in one, for a step of `rows` rows (its forward scores every row's slots):
        # draft(depth) + verify(rows * (1 + nodes_per_depth * depth)) = fixed + per_depth * depth
        draft, verify = self.draft_cost, self.verify_cost
        fixed = draft.intercept + verify.intercept + verify.slope * rows
        per_depth = draft.slope + verify.slope * rows * self.nodes_per_depth.value
        strength, acceptance, presence = self.prior_strength, self.prior_acceptance, 1.0  # position 0's priors
        tokens, seconds, survival, depth = [1.0], [plain], 1.0, 0.0
        for accepted, reached, present, asked in zip(self.accepted, self.reached, self.present, self.asked):
            acceptance = (accepted + strength * acceptance) / (reached + strength)
            presence = (present + strength * presence) / (asked + strength)
            survival *= acceptance
            depth += presence
            tokens.append(tokens[-1] + presence * survival)
            seconds.append(fixed + per_depth * depth)
        return tokens, seconds

    def _goodput_and_seconds(self) -> tuple[list[float], list[float]]:
        tokens, seconds = self.expected_tokens_and_seconds()
        return [t / step if step > 0 else float("inf") for t, step in zip(tokens, seconds)], seconds

    def _next_length(self) -> int:
        if not self.draft_cost.fitted:  # no draft measured yet (e.g. prompt lookup found nothing so far)
            return self.num_draft_tokens
        rates, seconds = self._goodput_and_seconds()
        best = max(range(len(rates)), key=rates.__getitem__)
        self.probing = False
        if best == 0:
            probe = max(range(1, len(rates)), key=rates.__getitem__)
            if seconds[probe] - seconds[0] > self.probe_budget * self.num_plain_steps * seconds[0]:
                self.num_plain_steps += 1
                return 0
            self.probing, best = True, probe
        self.num_plain_steps = 0
        self.num_drafted_steps += 1
        if self.explore_interval and not self.probing and self.num_drafted_steps % self.explore_interval == 0:
            step = 1 if (self.num_drafted_steps // self.explore_interval) % 2 == 0 else -1
            best = min(max(best + step, 0), self.num_draft_tokens)
        return best
