"""A model-free drafter and a model drafter together: per step and row, the model-free draft when it is expected to
give more tokens per second than the model's drafts do, else the model's (Arctic Inference's suffix + speculator,
with the comparison made in tokens per second of each source's measured steps)."""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch

from ..draft import Draft
from ..floor import PlainFloor
from ..metrics import clock
from ..query import padded_width
from ..schedules import DraftLengthSchedule, check_schedule, make_schedule
from ..schedules.goodput import CostFit
from ..step import Proposal, RowOutcome
from .base import Drafter, DraftState, StepFeedback, TargetNeeds
from .eagle import EAGLE_HEAD
from .spec import DRAFT_MODEL, MethodSpec, Setting, Variant
from .suffix import SUFFIX_SETTINGS

SOURCES = ("model_free", "model")
PLAIN = "plain"  # the timing key of a step without a draft (`HybridState.step_seconds`)
# the weight, in steps, of the priors of `HybridState.free_accepted_per_score` (its drafts accepted as scored) and of
# `HybridState.seconds_ratio` (both kinds of steps alike): a few measured steps of a kind take over
PRIOR_STEPS = 2.0
# the prior of `HybridState.verify_cost`: one more query slot costs this share of a one-slot forward, and the
# decay of its observations' weight per later step (the goodput schedule's)
VERIFY_RELATIVE_SLOPE, VERIFY_MEMORY = 0.1, 0.98


@dataclass
class HybridState(DraftState):
    """A call's state of both drafters and the hybrid's bookkeeping.

    Args:
        model_free (`DraftState`): the model-free drafter's state.
        model (`DraftState`): the model drafter's state.
        last (`dict[int, str]`): per row, the source of the draft of the step in flight.
        figures (`dict[str, list[int]]`): per source, `[steps, drafted tokens, accepted tokens]` so far.
        free_scores (`float`): the summed scores of the model-free drafts taken so far.
        step_seconds (`dict[str, list[float]]`): per source, and for steps without a draft (`"plain"`), `[steps
            timed, seconds]`: a step's seconds run from its `propose` to its `observe` (drafting, the target's
            forward, verification; not the plain steps the loop may run before the next draft), and count for the
            model when any row of it drafted with the model, else for the model-free drafter when any row took its
            draft.
        step_started (`tuple[str, float]`, *optional*): the source and start time of the step in flight.
        model_lengths (`DraftLengthSchedule`, *optional*): chooses the model drafter's draft length each step
            (the goodput schedule: from its drafts' acceptance per position and the measured costs of this call's
            model-drafted steps).
        model_step (`tuple`, *optional*): of the step in flight: its model-drafted rows' draft lengths asked, draft
            tokens and depths (`{row: (asked, nodes, depth)}`, empty when the model did not draft), its seconds of
            drafting (both drafters') and the time drafting ended.
        model_floor (`PlainFloor`, *optional*): which rows the model drafter may draft for: a row whose model-drafted
            steps commit fewer tokens per second than the steps without a model draft is held from it (and probed
            now and then), its steps drafted by the model-free drafter where it has a draft and plain otherwise.
        verify_cost (`CostFit`): seconds of a step after its drafting (the target's forward, verification and
            bookkeeping) against the query slots it scored (`slots`): every step's, whichever source drafted.
        step_slots (`int`): the query slots of the step in flight.
    """

    model_free: DraftState | None = None
    model: DraftState | None = None
    last: dict = field(default_factory=dict)
    figures: dict = field(default_factory=lambda: {source: [0, 0, 0] for source in SOURCES})
    free_scores: float = 0.0
    step_seconds: dict = field(default_factory=lambda: {source: [0, 0.0] for source in (*SOURCES, PLAIN)})
    step_started: tuple | None = None
    model_lengths: DraftLengthSchedule | None = None
    model_step: tuple | None = None
    model_floor: PlainFloor | None = None
    verify_cost: CostFit = field(default_factory=lambda: CostFit(VERIFY_RELATIVE_SLOPE, VERIFY_MEMORY))
    step_slots: int = 0

    def model_draft_length(self) -> int:
        """The model drafter's draft length for the next step: its schedule's, at least 1 (whether a row drafts at
        all is the plain-speed floor's decision) and at most the model drafter's `num_draft_tokens` (the heuristic
        schedule has no bound)."""
        return min(max(1, self.model_lengths.draft_length), self.model_lengths.num_draft_tokens)

    def observe_step(self, num_accepted: dict[int, int], now: float) -> None:
        """Ends the step in flight: its seconds count for its source; a step the model drafted in goes to the
        model's draft-length schedule and every step to the model floor, each with every row's outcome (accepted
        tokens `num_accepted` by row; a row the model did not draft for ran without a model draft, as a row the floor
        holds: its verify forward's slots and seconds are the step's) and the step's seconds."""
        started = self.end_step(now)
        if started is None:  # no step proposed since the last one (the loop's floor ran a plain step)
            return
        lengths, draft_seconds, drafted_at = self.model_step
        self.model_step = None
        self.verify_cost.add(self.step_slots, now - drafted_at)
        outcomes = [RowOutcome(row, *lengths[row], list(range(accepted)), accepted + 1, False) if row in lengths
                    else RowOutcome(row, 0, 0, 0, [], 1, False) for row, accepted in num_accepted.items()]
        if lengths:  # the model drafted: every row goes, one forward scored all their slots
            self.model_lengths.update(outcomes, draft_seconds, now - drafted_at)
        self.model_floor.update(outcomes, draft_seconds, now - drafted_at)

    def expected_model_accepted(self, budget: int) -> float:
        """Accepted tokens per model draft so far in this call; before the first, the model's draft length (the
        threshold Arctic Inference uses)."""
        steps, _, accepted = self.figures["model"]
        return accepted / steps if steps else float(budget)

    def free_accepted_per_score(self) -> float:
        """Accepted tokens per unit of score of the model-free drafts so far in this call, with a prior of 1 (a
        draft accepted as its frequency estimate says) weighing `PRIOR_STEPS` drafts of score 1. Under sampling
        a copied token is accepted with the target's probability of it, well below its frequency estimate."""
        return (self.figures["model_free"][2] + PRIOR_STEPS) / (self.free_scores + PRIOR_STEPS)

    def seconds_ratio(self, kind: str, other: str) -> float:
        """Seconds of a step of `kind` over seconds of a step of `other` (keys of `step_seconds`), measured in this
        call; 1 (drafting costs nothing beside verification, as on a GPU) until both have run a step, and pulled
        towards 1 by a prior of `PRIOR_STEPS` steps of each at the mean step's seconds."""
        (steps, seconds), (other_steps, other_seconds) = self.step_seconds[kind], self.step_seconds[other]
        if not steps or not other_steps:
            return 1.0
        mean = (seconds + other_seconds) / (steps + other_steps)
        return ((seconds + PRIOR_STEPS * mean) / (steps + PRIOR_STEPS)) / (
            (other_seconds + PRIOR_STEPS * mean) / (other_steps + PRIOR_STEPS))

    def cost_ratio(self) -> float:
        """Seconds of a model-free step over seconds of a model step (`seconds_ratio`)."""
        return self.seconds_ratio(*SOURCES)

    def takes_model_free(self, score: float, budget: int) -> bool:
        """Whether a model-free draft of `score` is expected to give at least the tokens per second of a model
        draft: `(1 + score * free_accepted_per_score) / free_cost >= (1 + expected_model_accepted) / model_cost`,
        each step committing its accepted tokens and one more."""
        expected = score * self.free_accepted_per_score()
        return 1.0 + expected >= (1.0 + self.expected_model_accepted(budget)) * self.cost_ratio()

    def common_width(self, free_probs: Sequence[Sequence[float]], model_widths: Sequence[int], num_rows: int,
                     draft_seconds: float) -> int:
        """The most draft tokens per row this step verifies: the step's one forward scores `num_rows * (width + 1)`
        query slots (`slots`), so a long model-free draft in one row widens every row's query. The width in
        `max(1, model_widths)..` the longest model-free draft of the most expected tokens per second for the step,

            (num_rows + m * len(model_widths) + a * sum of each model-free draft's first `width` probs)
                / (draft_seconds + verify_cost(slots(num_rows, width))),

        with `m` and `a` as in `takes_model_free` and `draft_seconds` the drafting already done (the smaller width
        on a tie; the longest draft before a step was measured). Model drafts keep their length: the model's
        schedule chose it.

        Args:
            free_probs (`Sequence[Sequence[float]]`): per model-free draft, its tokens' estimated probabilities,
                best first (`SuffixDraft.probs`).
            model_widths (`Sequence[int]`): the draft tokens of each model draft.
            num_rows (`int`): the rows of the step.
            draft_seconds (`float`): the step's seconds of drafting so far.
        """
        widest, least = max(map(len, free_probs), default=0), max([1, *model_widths])
        if widest <= least or not self.verify_cost.fitted:
            return widest
        per_score = self.free_accepted_per_score()
        fixed = num_rows + len(model_widths) * self.expected_model_accepted(self.model_draft_length())

        def rate(width: int) -> float:
            tokens = fixed + per_score * sum(sum(probs[:width]) for probs in free_probs)
            return tokens / (draft_seconds + self.verify_cost(self.slots(num_rows, width)))

        return max(range(least, widest + 1), key=rate)

    def slots(self, num_rows: int, width: int) -> int:
        """The query slots a step of `num_rows` rows scores when its widest draft holds `width` tokens: `num_rows *
        (width + 1)`, in a compiled call padded to the next of its `query_widths`."""
        return num_rows * padded_width(width + 1, self.query_widths)

    def free_beats_plain(self, score: float) -> bool:
        """Whether a model-free draft of `score` is expected to give more tokens per second than a step without a
        draft, for a row the model floor holds back: `1 + score * free_accepted_per_score > free_cost /
        plain_cost` (`seconds_ratio`; 1 until both kinds of steps were measured, so any draft is taken then)."""
        return 1.0 + score * self.free_accepted_per_score() > self.seconds_ratio(SOURCES[0], PLAIN)

    def time_step(self, source: str | None, now: float) -> None:
        """Ends the step in flight (`end_step`) and starts one drafted by `source` (`None`: a step without a
        draft)."""
        self.end_step(now)
        self.step_started = (source, now)

    def end_step(self, now: float) -> float | None:
        """Ends the step in flight, whose seconds count for its source (`"plain"` without one); returns when it
        started (`None`: no step in flight)."""
        if self.step_started is None:
            return None
        source, started = self.step_started
        self.step_seconds[source or PLAIN][0] += 1
        self.step_seconds[source or PLAIN][1] += now - started
        self.step_started = None
        return started


class HybridDrafter(Drafter):
    """Suffix decoding where it is confident, a model drafter elsewhere (Arctic Inference's suffix decoding with a
    speculator; Oliaro et al., arXiv 2411.04975, pair SuffixDecoding with EAGLE the same way).

    Each step the model-free drafter drafts every row first, with its score: the accepted tokens its frequency
    estimate expects (`SuffixDrafter.scored_draft`: it grows with the match length). A row takes that draft when it
    is expected to commit at least as many tokens per second as a model draft (`HybridState.takes_model_free`):
    `(1 + score * a) / c_free >= (1 + m) / c_model`, with `m` the mean accepted tokens per model draft in this call
    (before the first, the model's draft length), `a` the model-free drafts' accepted tokens per unit of score in
    this call (prior 1; under sampling far below 1: a copied token is accepted with the target's probability of it)
    and `c_free / c_model` the measured seconds of a model-free step over a model step (prior 1). With both priors
    this is Arctic Inference's threshold (score >= m; a tie goes to the draft that costs no forward); on a CPU,
    where a model draft costs a large part of a target forward, the model-free draft is taken at lower scores.
    The other rows take the model's draft, as long as `model_schedule` chooses; by default a goodput schedule over
    this call's model-drafted steps (`GoodputSchedule`: the length in `1..num_draft_tokens` of the model drafter of
    the most expected tokens per second, from its drafts' acceptance per position and the measured seconds of
    drafting and verifying), so under sampling, where a draft model's later tokens are seldom accepted, its drafts
    shorten, and where they are accepted they stay at `num_draft_tokens`. When every
    row takes the model-free draft the model drafter is not run that step (it catches up with the committed tokens
    at its next call, as after any step). If the model drafter asks to resume the target's forward from its exit
    layer (layer skip), every row takes its draft that step. The target's features, when the model drafter reads
    them, reach it after every step, whichever source drafted.

    The step's one forward scores every row's query padded to the longest draft, so a long model-free draft in one
    row widens all of them. The model-free drafts taken are therefore cut to one common width, the one of the most
    expected tokens per second for the whole step (`HybridState.common_width`: each draft's tokens' estimated
    probabilities times `a`, against a line fitted to this call's steps' seconds by query slots); the model's drafts
    keep the length its schedule chose. Under sampling, where `a` is low, a long copied draft's unlikely tail is
    not verified; in a compiled call, whose steps run at a few fixed widths, a width costs the slots of the compiled
    width that holds it.

    Beneath that choice a floor of its own (`hf_speculators.floor.PlainFloor`, with the steps the model did not draft
    for as its plain steps) holds a row back from the model drafter while the row's model-drafted steps commit fewer
    tokens per second than those steps, and probes it again now and then: the row then takes the model-free draft
    where there is one and runs a plain step where there is none. Where a model draft costs a large share of a
    target forward's time (a compiled target on a GPU, whose step is mostly the host's work), the hybrid so falls back
    to suffix decoding alone instead of losing to plain decoding; where it pays (the demo pair on a CPU) the floor
    seldom engages. Unlike the loop's floor it is on under sampling too: the hybrid's choices read the clock anyway.
    A call starts from the last call's measured costs and tokens per model-drafted step (`PlainFloor.start_from`;
    `clear_cache` forgets them), so a model that lost there is held back from the first step, not after 4 drafted
    steps and the draft model's prefill, and is probed as usual.

    The call's `SpeculativeStats.drafter_stats` holds, per source (`"model_free"`, `"model"`), the steps it drafted
    (`steps`), its draft tokens (`drafted_tokens`) and its accepted tokens (`accepted_tokens`, as the verifier counted
    them: where a stopping criterion kept fewer, `SpeculativeStats.num_accepted_tokens` counts those kept), and for
    the model the row-steps its floor held it back (`held_steps`).

    Args:
        model_free (`Drafter`): a drafter with `scored_draft(state, input_ids, max_tokens, row)` returning a draft
            with its `score` (`SuffixDrafter`).
        model_drafter (`Drafter`): the model drafter (`DraftModelDrafter`, `EagleDrafter`, ...).
        model_schedule (`str`, defaults to `"goodput"`): the model drafter's draft-length schedule, a key of
            `hf_speculators.schedules.SCHEDULES` (`"constant"`: its `num_draft_tokens` every step).

    Raises:
        `ValueError`: a `model_free` drafter without `scored_draft`; an unknown `model_schedule`.
    """

    name = "hybrid"
    state_class = HybridState
    has_own_floor = True

    def __init__(self, model_free: Drafter, model_drafter: Drafter, model_schedule: str = "goodput"):
        if not hasattr(model_free, "scored_draft"):
            raise ValueError(f"HybridDrafter needs a model-free drafter that scores its drafts (SuffixDrafter), got "
                             f"{type(model_free).__name__}.")
        super().__init__(max(model_free.num_draft_tokens, model_drafter.num_draft_tokens))
        self.model_free, self.model_drafter = model_free, model_drafter
        self.model_schedule = check_schedule(model_schedule, "HybridDrafter's model_schedule")
        self._floor_prior = None  # the last call's model floor summary (`PlainFloor.summary`), the next one's start

    @property
    def drafts_trees(self) -> bool:
        return self.model_free.drafts_trees or self.model_drafter.drafts_trees

    def target_needs(self, target) -> TargetNeeds:
        return self.model_drafter.target_needs(target)

    @property
    def draft_lengths(self) -> tuple[int, ...]:
        """Both drafters' draft lengths: a model draft's compiled verify forward does not pay for the model-free
        drafter's longer drafts."""
        return tuple(sorted({*self.model_free.draft_lengths, *self.model_drafter.draft_lengths}))

    def draft_modules(self, target) -> tuple:
        return self.model_free.draft_modules(target) + self.model_drafter.draft_modules(target)

    def start(self, state: HybridState) -> None:
        shared = {f.name: getattr(state, f.name) for f in fields(DraftState)
                  if f.name not in ("target", "generation_config")}
        state.model_free = self.model_free.new_state(state.target, state.generation_config, **shared)
        state.model = self.model_drafter.new_state(state.target, state.generation_config, **shared)
        state.model_lengths = make_schedule(self.model_schedule, self.model_drafter.num_draft_tokens)
        state.model_floor = PlainFloor()
        if self._floor_prior is not None:
            state.model_floor.start_from(self._floor_prior)

    def propose(self, state: HybridState, input_ids: Sequence[torch.LongTensor], max_tokens: Sequence[int],
                rows: Sequence[int]) -> Proposal:
        now = clock(input_ids[0].device)
        free_budgets = [min(budget, self.model_free.num_draft_tokens) for budget in max_tokens]
        model_budgets = [min(budget, state.model_draft_length()) for budget in max_tokens]
        scored = [self.model_free.scored_draft(state.model_free, ids, budget, row) if budget > 0 else None
                  for ids, budget, row in zip(input_ids, free_budgets, rows)]
        has_free = [draft is not None and bool(draft.token_ids) for draft in scored]
        use_free = [free and state.takes_model_free(draft.score, budget)
                    for free, draft, budget in zip(has_free, scored, model_budgets)]
        asked = [0 if free else budget for free, budget in zip(use_free, model_budgets)]
        granted = state.model_floor.budgets(rows, asked)
        # a row the model floor holds takes the model-free draft where it beats a plain step, else runs one
        sources = [SOURCES[0] if free or (ask and not grant and has and state.free_beats_plain(draft.score))
                   else SOURCES[1] if grant else None
                   for free, ask, grant, has, draft in zip(use_free, asked, granted, has_free, scored)]
        model_drafts, resume, lengths = [None] * len(rows), None, {}
        if SOURCES[1] in sources:
            budgets = [grant if source == SOURCES[1] else 0 for source, grant in zip(sources, granted)]
            model = Proposal.of(self.model_drafter.propose(state.model, input_ids, budgets, rows))
            model_drafts, resume = model.drafts, model.resume
            if resume is not None:  # the target resumes from the model's draft forward: its drafts only
                sources = [SOURCES[1]] * len(rows)
            lengths = {row: (budget, draft.num_nodes, draft.tree.depth) for row, budget, draft, source in zip(
                rows, budgets, model_drafts, sources) if source == SOURCES[1]}
        drafted_at = clock(input_ids[0].device)
        state.model_step = (lengths, drafted_at - now, drafted_at)
        scored = self._trim(state, scored, sources, [nodes for _, nodes, _ in lengths.values()], drafted_at - now)
        state.time_step(SOURCES[1] if SOURCES[1] in sources else SOURCES[0] if SOURCES[0] in sources else None, now)
        state.free_scores += sum(draft.score for draft, source in zip(scored, sources) if source == SOURCES[0])
        drafts = []
        for ids, row, source, free_draft, model_draft in zip(input_ids, rows, sources, scored, model_drafts):
            draft = (Draft.from_lists(free_draft.token_ids, free_draft.parent_ids, device=ids.device)
                     if source == SOURCES[0] else model_draft if source == SOURCES[1] else Draft.empty(ids.device))
            if source is not None:
                state.figures[source][0] += 1
                state.figures[source][1] += draft.num_nodes
                state.last[row] = source
            drafts.append(draft)
        state.step_slots = state.slots(len(rows), max(draft.num_nodes for draft in drafts))
        return Proposal(drafts, resume)

    @staticmethod
    def _trim(state: HybridState, scored: list, sources: list, model_widths: list[int], draft_seconds: float) -> list:
        """The rows' model-free drafts, those taken cut to the step's `HybridState.common_width`."""
        free = [draft.probs for draft, source in zip(scored, sources) if source == SOURCES[0]]
        width = state.common_width(free, model_widths, len(sources), draft_seconds)
        return [draft.truncated(width) if source == SOURCES[0] else draft for draft, source in zip(scored, sources)]

    def observe(self, state: HybridState, feedback: StepFeedback) -> None:
        """Ends the step's timing, credits each row's draft source with its accepted tokens, hands the step to the
        model's schedule and floor (`HybridState.observe_step`); both drafters take the feedback."""
        if feedback.num_accepted is not None:  # after a step, not a prefill
            state.observe_step(dict(zip(feedback.rows, feedback.num_accepted)), clock(state.target.device))
        for row, accepted in zip(feedback.rows, feedback.num_accepted or []):
            if row in state.last:
                state.figures[state.last.pop(row)][2] += accepted
        self.model_free.observe(state.model_free, feedback)
        self.model_drafter.observe(state.model, feedback)

    def finish(self, state: HybridState, sequences: Sequence[torch.LongTensor], prompt_lengths: Sequence[int]) -> dict:
        """Lets both drafters finish (suffix decoding keeps the outputs) and returns the figures per source, the
        model's with the row-steps its floor held it back (`held_steps`)."""
        self.model_free.finish(state.model_free, sequences, prompt_lengths)
        self.model_drafter.finish(state.model, sequences, prompt_lengths)
        names = ("steps", "drafted_tokens", "accepted_tokens")
        figures = {source: dict(zip(names, figures)) for source, figures in state.figures.items()}
        figures["model"]["held_steps"] = sum(map(state.model_floor.num_plain_steps, range(len(sequences))))
        self._floor_prior = state.model_floor.summary() or self._floor_prior
        return figures

    def clear_cache(self) -> None:
        """Forgets what earlier calls left: the model-free drafter's cross-call memory and the model floor's prior."""
        self.model_free.clear_cache()
        self._floor_prior = None

    @contextmanager
    def memory_kept(self) -> Iterator[None]:
        """Puts the model-free drafter's memory and the model floor's prior back as they were when the block ends."""
        prior = self._floor_prior
        try:
            with self.model_free.memory_kept():
                yield
        finally:
            self._floor_prior = prior

    def __repr__(self) -> str:
        return f"HybridDrafter({self.model_free!r}, {self.model_drafter!r})"


HYBRID_MODEL_METHODS = ("draft-model", "eagle3")  # the model drafters a hybrid pairs with suffix decoding
HYBRID_SPEC = MethodSpec(
    "hybrid", HybridDrafter, required=("draft_model",), shared=("draft_revision",),
    settings=(Setting("model_method", str, choices=HYBRID_MODEL_METHODS, flag=False), *SUFFIX_SETTINGS),
    loads="pair", checkpoint=DRAFT_MODEL,
    variants={"hybrid": Variant(), "hybrid-eagle3": Variant(settings={"model_method": "eagle3"}, checkpoint=EAGLE_HEAD)},
)
