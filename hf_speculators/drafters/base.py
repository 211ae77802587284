"""The drafter interface: settings and weights on the drafter, per-call state in a `DraftState` the loop owns."""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.candidate_generator import CandidateGenerator

from ..cache import RaggedCache
from ..draft import Draft
from ..sampling import process_logits, sample
from ..step import Proposal


@dataclass(frozen=True)
class TargetNeeds:
    """What a drafter reads from the target's verification (and prefill) forwards, which the loop runs.

    Args:
        layer_ids (`tuple[int, ...]`): decoder layers whose input hidden states (the residual stream entering layer
            i, transformers' `hidden_states[i]`) the drafter reads (EAGLE-3's auxiliary layers).
        final_norm (`bool`): whether it reads the final norm's output (transformers' `last_hidden_state`; EAGLE-1/2,
            Medusa).
    """

    layer_ids: tuple[int, ...] = ()
    final_norm: bool = False

    @property
    def features(self) -> bool:
        """Whether any hidden state is read."""
        return bool(self.layer_ids) or self.final_norm


@dataclass
class StepFeedback:
    """What the loop hands a drafter after a prefill or step (`Drafter.observe`), one entry per row of the forward.

    Args:
        rows (`list[int]`): each entry's row in the generate call's batch.
        positions (`list[int]`): each row's position of its first kept token (the tokens its cache held before).
        features (`list[torch.FloatTensor]`, *optional*): when the drafter's `TargetNeeds` asks for hidden states,
            row i's features `(num_kept_i, width)` of the tokens the target's cache kept (the pending token and the
            accepted draft tokens; in a prefill, the prompt's cached tokens), in sequence order: the layer inputs of
            `layer_ids` then the final norm's output, concatenated.
        extra_logits (`list[torch.FloatTensor]`, *optional*): for a draft with unverified query tokens
            (`Draft.extra_token_ids`), row i's target logits `(num_extra_i, vocab_size)` of them.
        num_accepted (`list[int]`, *optional*): after a step (not a prefill), row i's accepted draft tokens, as the
            verifier counted them (a stopping criterion may have kept fewer).
    """

    rows: list[int]
    positions: list[int]
    features: list[torch.FloatTensor] | None = None
    extra_logits: list[torch.FloatTensor | None] | None = None
    num_accepted: list[int] | None = None


@dataclass
class DraftState:
    """One generate call as a drafter sees it: created by `Drafter.start`, owned by the loop, dropped after the call.

    Subclasses add the drafter's own per-call state (a draft model's KV cache, n-gram indexes, head caches), so one
    drafter instance serves concurrent calls without sharing any of it.

    Args:
        target (`PreTrainedModel`): the target model.
        generation_config (`GenerationConfig`): the call's config; `do_sample` decides greedy or sampled drafts.
        logits_processor (`LogitsProcessorList`): the call's processors and warpers, applied to draft logits too
            (for a batch: as row 0 of the batch, `RowOfBatch`; draft scores only steer acceptance).
        generator (`torch.Generator`, *optional*): the only source of randomness for sampled drafts.
        tokenizer (`PreTrainedTokenizerBase`, *optional*): the target's tokenizer, for vocabulary checks.
        cache (`RaggedCache`, *optional*): the target's cache of this call, for drafters that write into it (layer
            skip); `None` outside the speculative loop (transformers' `get_candidates`).
        batch_size (`int`): rows in the call.
        query_widths (`tuple[int, ...]`, *optional*): in a compiled call, the query widths the loop pads its steps'
            verify forwards to (`compiled.CompiledSteps.widths`); `None`: each step at its widest draft's.
    """

    target: object
    generation_config: GenerationConfig
    logits_processor: LogitsProcessorList = field(default_factory=LogitsProcessorList)
    generator: torch.Generator | None = None
    tokenizer: object = None
    cache: RaggedCache | None = None
    batch_size: int = 1
    query_widths: tuple[int, ...] | None = None

    @property
    def do_sample(self) -> bool:
        return bool(self.generation_config.do_sample)

    @cached_property
    def eos_token_ids(self) -> set[int]:
        """The call's EOS token ids (`generation_config.eos_token_id`, one or several), where a draft should end."""
        eos = self.generation_config.eos_token_id
        return set([eos] if isinstance(eos, int) else (eos or []))

    def draft_tokens(self, prefixes: Sequence[torch.LongTensor], logits: torch.FloatTensor,
                     with_probs: bool = False) -> tuple[torch.LongTensor, torch.FloatTensor | None]:
        """Picks the next draft token of several sequences from raw draft logits `(n, vocab_size)`, row i continuing
        `prefixes[i]` `(1, length_i)`.

        The logits go through the call's processors as the target's do. Returns the tokens `(n,)` and, when
        sampling (the distributions they were drawn from: their `draft_probs` rows) or when `with_probs` asks for
        them under greedy decoding, the processed distributions `(n, vocab_size)`; else `None` (greedy drafting
        needs only the argmax). Sampled rows are drawn in order from the call's generator.
        """
        scores = process_logits(self.logits_processor, prefixes, logits)
        if not (self.do_sample or with_probs):
            return scores.argmax(dim=-1), None
        probs = torch.softmax(scores, dim=-1)
        if not self.do_sample:
            return probs.argmax(dim=-1), probs
        return torch.stack([sample(row_probs, self.generator) for row_probs in probs]), probs


class Drafter(CandidateGenerator):
    """Proposes draft tokens for every running row of a generate call.

    A drafter holds weights and settings only. The speculative loop calls `start(state)` once per generate call
    (checks that the drafter fits the target; fills the drafter's `DraftState` subclass), then once per step
    `propose(state, input_ids, max_tokens, rows)`, and after the prefill and each step `observe(state, feedback)`
    with what it declared it reads from the target's forward (`target_needs`). Per-call state lives in the state
    object, never on the drafter, so concurrent calls never share it.

    A drafter that drafts each row on its own implements `draft_row`; the default `propose` maps it over the rows.
    A drafter that drafts rows together (one batched draft forward) overrides `propose`.

    As a transformers `CandidateGenerator`, `get_candidates(input_ids)` returns `(candidate_ids, candidate_logits)`
    with `candidate_ids` of shape `(1, sequence_length + k)` and `candidate_logits` of shape `(1, k, vocab_size)`
    (log-probabilities) or `None` for a deterministic drafter. transformers checks chains only: a tree draft gives
    its leftmost path (the first child at every node, the drafter's best guess).

    Args:
        num_draft_tokens (`int`): draft tokens proposed per step (k), at least 1: for a tree, its depth (the most
            tokens on one path, which is what the length budget `max_tokens` of `propose` limits).

    Raises:
        `ValueError`: if `num_draft_tokens` is not an integer >= 1.
    """

    name: str = ""
    state_class: type = DraftState
    drafts_trees: bool = False  # whether `propose` may return token trees (checked against the attention kernel)
    converts_per_call: bool = False  # whether `start` fits its modules to each call's target device and dtype itself
    # whether the drafter holds its costly drafts back itself where they lose to plain steps (`HybridDrafter`): the
    # loop's floor is then off unless asked for (`generate(plain_floor=True)`)
    has_own_floor: bool = False

    def __init__(self, num_draft_tokens: int):
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be an integer >= 1, got {num_draft_tokens!r}.")
        self.num_draft_tokens = num_draft_tokens
        self._candidate_state: DraftState | None = None  # transformers' assisted loop only (`get_candidates`)

    def target_needs(self, target) -> TargetNeeds:
        """What this drafter reads from the target's forwards (default: nothing)."""
        return TargetNeeds()

    @property
    def draft_lengths(self) -> tuple[int, ...]:
        """The draft lengths, increasing, a compiled call pads its verify query to (plus the pending token; each a
        compiled graph, `compiled.CompiledSteps.widths`): default `(num_draft_tokens,)`."""
        return (self.num_draft_tokens,)

    def draft_modules(self, target) -> tuple[torch.nn.Module, ...]:
        """The modules whose forwards this drafter runs to draft for `target` (its draft model or head, and any part
        of the target it calls outside the target's own forward), for a benchmark to time as model time; a module
        that runs inside another one's forward may be listed too. Default: none (a model-free drafter)."""
        return ()

    def start(self, state: DraftState) -> None:
        """Starts a generate call: checks that this drafter fits `state.target` and fills its per-call state.

        Raises:
            `ValueError`: for a target, tokenizer or cache this drafter cannot serve, naming what to change.
        """

    def propose(self, state: DraftState, input_ids: Sequence[torch.LongTensor], max_tokens: Sequence[int],
                rows: Sequence[int]) -> Proposal | list[Draft]:
        """Drafts for every running row: one `Draft` (a chain or a token tree) per entry of `input_ids`.

        Returns a `Proposal`: the drafts, in `rows` order, and optionally a `Resume` (the drafter already ran the
        target's first layers over the verification query: layer skip). A drafter that never resumes may return
        the drafts as a plain list (the default does).

        Args:
            state (`DraftState`): this call's state, as `start` filled it.
            input_ids (`Sequence[torch.LongTensor]`): each row's committed tokens, shape `(1, sequence_length_i)`,
                without padding.
            max_tokens (`Sequence[int]`): each row's length budget (no path longer; 0: no draft for that row).
            rows (`Sequence[int]`): each row's index in the generate call's batch (increasing). A row that is
                absent finished and will not come back: per-row state may be dropped.
        """
        return [self.draft_row(state, ids, budget, row) if budget > 0 else Draft.empty(ids.device)
                for ids, budget, row in zip(input_ids, max_tokens, rows)]

    def draft_row(self, state: DraftState, input_ids: torch.LongTensor, max_tokens: int, row: int) -> Draft:
        """The draft of one row (see `propose`), `input_ids` of shape `(1, sequence_length)`, `max_tokens >= 1`."""
        raise NotImplementedError(f"{type(self).__name__} must implement draft_row or propose")

    def observe(self, state: DraftState, feedback: StepFeedback) -> None:
        """Takes in what the target's last forward gave this drafter (`StepFeedback`); the default ignores it."""

    def finish(self, state: DraftState, sequences: Sequence[torch.LongTensor], prompt_lengths: Sequence[int]) -> dict:
        """Ends a generate call that completed: a drafter with a cross-call memory (`SuffixDrafter`) keeps what the
        call generated. Returns the drafter's own figures for `SpeculativeStats.drafter_stats` (default: none).

        Args:
            state (`DraftState`): the call's state.
            sequences (`Sequence[torch.LongTensor]`): every row's committed tokens, shape `(1, sequence_length_i)`,
                without padding, prompt included.
            prompt_lengths (`Sequence[int]`): every row's prompt length in those tokens.
        """
        return {}

    def clear_cache(self) -> None:
        """Forgets what earlier calls left in a cross-call memory (`SuffixDrafter`'s); the default keeps none."""

    @contextmanager
    def memory_kept(self) -> Iterator[None]:
        """A block whose calls leave the cross-call memory as it was (what `clear_cache` forgets is put back when
        the block ends): the bench's warm-up calls on random tokens. The default keeps no memory."""
        yield

    def new_state(self, target, generation_config: GenerationConfig, **kwargs) -> DraftState:
        """A started `DraftState` for one call (`kwargs`: the other `DraftState` fields)."""
        state = self.state_class(target, generation_config, **kwargs)
        self.start(state)
        return state

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.FloatTensor | None]:
        """transformers' assisted-generation interface: a greedy chain after `input_ids` `(1, sequence_length)`.

        The state of transformers' call is kept on the drafter (transformers' loop makes one call per candidate
        generator); `hf_speculators.generate` never uses it."""
        if self._candidate_state is None:
            self._candidate_state = self.new_state(None, GenerationConfig())
        draft = self.propose(self._candidate_state, [input_ids], [self.num_draft_tokens], [0])[0]
        path = draft.tree.leftmost_path()
        candidate_ids = torch.cat([input_ids, draft.token_ids[path][None].to(input_ids.device)], dim=-1)
        candidate_logits = None if draft.draft_probs is None else draft.draft_probs[path].log()[None]
        return candidate_ids, candidate_logits

    def update_candidate_strategy(self, input_ids, scores, num_matches) -> None:
        """transformers' assisted-generation hook; the draft length is the loop's schedule's job, so nothing."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_draft_tokens={self.num_draft_tokens})"
