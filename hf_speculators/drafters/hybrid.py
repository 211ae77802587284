"""A model-free drafter and a model drafter together: per step and row, the model-free draft when its match predicts
more accepted tokens than the model's drafts give, else the model's (Arctic Inference's suffix + speculator)."""

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from ..draft import Draft
from .base import Drafter, DraftState, StepFeedback, TargetNeeds

SOURCES = ("model_free", "model")


@dataclass
class HybridState(DraftState):
    """A call's state of both drafters and the hybrid's bookkeeping.

    Args:
        model_free (`DraftState`): the model-free drafter's state.
        model (`DraftState`): the model drafter's state.
        last (`dict[int, str]`): per row, the source of the draft of the step in flight.
        figures (`dict[str, list[int]]`): per source, `[steps, drafted tokens, accepted tokens]` so far.
    """

    model_free: DraftState | None = None
    model: DraftState | None = None
    last: dict = field(default_factory=dict)
    figures: dict = field(default_factory=lambda: {source: [0, 0, 0] for source in SOURCES})

    def expected_model_accepted(self, budget: int) -> float:
        """Accepted tokens per model draft so far in this call; before the first, the model's draft length (the
        threshold Arctic Inference uses)."""
        steps, _, accepted = self.figures["model"]
        return accepted / steps if steps else float(budget)


class HybridDrafter(Drafter):
    """Suffix decoding where it is confident, a model drafter elsewhere (Arctic Inference's suffix decoding with a
    speculator; Oliaro et al., arXiv 2411.04975, pair SuffixDecoding with EAGLE the same way).

    Each step the model-free drafter drafts every row first, with its score: the accepted tokens its frequency
    estimate expects (`SuffixDrafter.scored_draft`: it grows with the match length). A row takes that draft when the
    score is at least what the model drafter's drafts have been accepted for in this call (mean accepted tokens per
    model draft; before the first, the model's draft length, Arctic Inference's threshold; a tie goes to the draft
    that costs no forward); the other rows take the model's draft. When every
    row takes the model-free draft the model drafter is not run that step (it catches up with the committed tokens
    at its next call, as after any step). If the model drafter asks to resume the target's forward from its exit
    layer (layer skip), every row takes its draft that step. The target's features, when the model drafter reads
    them, reach it after every step, whichever source drafted.

    The call's `SpeculativeStats.drafter_stats` holds, per source (`"model_free"`, `"model"`), the steps it drafted
    (`steps`), its draft tokens (`drafted_tokens`) and its accepted tokens (`accepted_tokens`, as the verifier counted
    them: where a stopping criterion kept fewer, `SpeculativeStats.num_accepted_tokens` counts those kept).

    Args:
        model_free (`Drafter`): a drafter with `scored_draft(state, input_ids, max_tokens, row)` returning a draft
            with its `score` (`SuffixDrafter`).
        model_drafter (`Drafter`): the model drafter (`DraftModelDrafter`, `EagleDrafter`, ...).

    Raises:
        `ValueError`: a `model_free` drafter without `scored_draft`.
    """

    name = "hybrid"
    state_class = HybridState

    def __init__(self, model_free: Drafter, model_drafter: Drafter):
        if not hasattr(model_free, "scored_draft"):
            raise ValueError(f"HybridDrafter needs a model-free drafter that scores its drafts (SuffixDrafter), got "
                             f"{type(model_free).__name__}.")
        super().__init__(max(model_free.num_draft_tokens, model_drafter.num_draft_tokens))
        self.model_free, self.model_drafter = model_free, model_drafter

    @property
    def drafts_trees(self) -> bool:
        return self.model_free.drafts_trees or self.model_drafter.drafts_trees

    def target_needs(self, target) -> TargetNeeds:
        return self.model_drafter.target_needs(target)

    def start(self, state: HybridState) -> None:
        shared = {f.name: getattr(state, f.name) for f in fields(DraftState)
                  if f.name not in ("target", "generation_config", "resume")}
        state.model_free = self.model_free.new_state(state.target, state.generation_config, **shared)
        state.model = self.model_drafter.new_state(state.target, state.generation_config, **shared)

    def propose(self, state: HybridState, input_ids: Sequence[torch.LongTensor], max_tokens: Sequence[int],
                rows: Sequence[int]) -> list[Draft]:
        free_budgets = [min(budget, self.model_free.num_draft_tokens) for budget in max_tokens]
        model_budgets = [min(budget, self.model_drafter.num_draft_tokens) for budget in max_tokens]
        scored = [self.model_free.scored_draft(state.model_free, ids, budget, row) if budget > 0 else None
                  for ids, budget, row in zip(input_ids, free_budgets, rows)]
        use_free = [draft is not None and draft.token_ids and draft.score >= state.expected_model_accepted(budget)
                    for draft, budget in zip(scored, model_budgets)]
        model_drafts = [None] * len(rows)
        if not all(use_free):
            model_drafts = self.model_drafter.propose(state.model, input_ids, model_budgets, rows)
            state.resume, state.model.resume = state.model.resume, None
            if state.resume is not None:  # the target resumes from the model's draft forward: its drafts only
                use_free = [False] * len(rows)
        drafts = []
        for ids, row, free, free_draft, model_draft in zip(input_ids, rows, use_free, scored, model_drafts):
            draft = (Draft.from_lists(free_draft.token_ids, free_draft.parent_ids, device=ids.device) if free
                     else model_draft)
            source = SOURCES[0] if free else SOURCES[1]
            state.figures[source][0] += 1
            state.figures[source][1] += draft.num_nodes
            state.last[row] = source
            drafts.append(draft)
        return drafts

    def observe(self, state: HybridState, feedback: StepFeedback) -> None:
        """Credits each row's draft source with its accepted tokens; both drafters take the feedback."""
        for row, accepted in zip(feedback.rows, feedback.num_accepted or []):
            if row in state.last:
                state.figures[state.last.pop(row)][2] += accepted
        self.model_free.observe(state.model_free, feedback)
        self.model_drafter.observe(state.model, feedback)

    def finish(self, state: HybridState, sequences: Sequence[torch.LongTensor], prompt_lengths: Sequence[int]) -> dict:
        """Lets both drafters finish (suffix decoding keeps the outputs) and returns the figures per source."""
        self.model_free.finish(state.model_free, sequences, prompt_lengths)
        self.model_drafter.finish(state.model, sequences, prompt_lengths)
        names = ("steps", "drafted_tokens", "accepted_tokens")
        return {source: dict(zip(names, figures)) for source, figures in state.figures.items()}

    def __repr__(self) -> str:
        return f"HybridDrafter({self.model_free!r}, {self.model_drafter!r})"
