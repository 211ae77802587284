"""Speculative decoding of a batch: per-row drafts and verification, one target forward per step for all rows."""

import torch

from .cache import DEFAULT_MAX_HOLES, RaggedCache
from .drafters import Drafter
from .metrics import SpeculativeStats, clock
from .outputs import SpeculativeGenerateOutput, commit_tokens
from .sampling import RowOfBatch, process_logits
from .schedules import DraftLengthSchedule
from .types import Draft
from .verifiers import Verifier


def left_padding(attention_mask: torch.LongTensor | None, input_ids: torch.LongTensor) -> list[int]:
    """Each row's number of left padding tokens; raises `ValueError` for right padding or holes in a prompt.

    Args:
        attention_mask (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*): the prompts'
            mask (`None`: no padding).
        input_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`): the prompts.
    """
    if attention_mask is None:
        return [0] * input_ids.shape[0]
    num_pads = (attention_mask == 0).sum(dim=1)
    expected = torch.arange(input_ids.shape[1], device=attention_mask.device) >= num_pads[:, None]
    if not torch.equal(attention_mask.bool(), expected) or bool((num_pads == input_ids.shape[1]).any()):
        raise ValueError(
            "Batched speculative generate needs left-padded prompts, each with at least one token: set "
            "tokenizer.padding_side = 'left' before tokenizing (the attention mask must be zeros, then ones)."
        )
    return num_pads.tolist()


class BatchedSpeculativeDecoding:
    """The state of one speculative generate call over a batch of left-padded prompts.

    Each step every running row gets its own draft, all rows are scored in one target forward (each row's pending
    token and draft tokens, shorter drafts padded), each row is verified on its own and keeps its accepted tokens in
    a `RaggedCache`. A row that meets a stopping criterion leaves the batch: no more drafting or target compute.
    Rows are kept with their left padding, as plain `generate` sees them, so `max_length`, the stopping criteria and
    the logits processors treat each row as they would in a plain batched call (`RowOfBatch`); drafters and
    verifiers see a row without padding.

    Args:
        model (`PreTrainedModel`): the target.
        drafter (`Drafter`): a drafter whose `check_batch_support` passed.
        verifier (`Verifier`): judges each row's draft.
        schedule (`DraftLengthSchedule`): one draft length per step for every row; it learns from every row.
        cache (`DynamicCache`): an empty cache of full-attention layers (see `check_batch_support`).
        generation_config, logits_processor, stopping_criteria: as transformers prepared them.
        generator (`torch.Generator`): the only source of randomness.
        pad_token_id (`int`): fills draft-less query slots and the end of rows that finished early.
        max_holes (`int`, defaults to `cache.DEFAULT_MAX_HOLES`): the `RaggedCache` compaction threshold (0: realign
            every step). Not a `generate` argument: `examples/batch_compaction.py` passes it to measure its cost.
    """

    def __init__(self, model, drafter: Drafter, verifier: Verifier, schedule: DraftLengthSchedule, cache,
                 generation_config, logits_processor, stopping_criteria, generator, pad_token_id: int,
                 max_holes: int = DEFAULT_MAX_HOLES):
        self.model, self.drafter, self.verifier, self.schedule = model, drafter, verifier, schedule
        self.generation_config, self.logits_processor, self.stopping_criteria = (
            generation_config, logits_processor, stopping_criteria)
        self.generator, self.pad_token_id, self.device = generator, pad_token_id, model.device
        self._dynamic_cache, self.max_holes = cache, max_holes
        self.stats = SpeculativeStats(lossless=verifier.lossless, verifier=verifier.name, drafter=repr(drafter))

    def prefill(self, input_ids: torch.LongTensor, num_pads: list[int]) -> None:
        """Caches every prompt token but the last of each row; the last one is pending for the first step."""
        start = clock(self.device)
        self.sequences = list(input_ids.split(1))  # [1, length] per row, left padding included
        self.num_pads = num_pads
        self.row_stats = [SpeculativeStats(lossless=self.stats.lossless, verifier=self.stats.verifier,
                                           drafter=self.stats.drafter) for _ in num_pads]
        new_valid = torch.arange(input_ids.shape[1] - 1) >= torch.tensor(num_pads)[:, None]
        self.cache = RaggedCache(self._dynamic_cache, torch.zeros(input_ids.shape[0], 0, dtype=torch.bool),
                                 self.max_holes)
        if input_ids.shape[1] > 1:
            self.drafter.target_forward_batch(self.model, self.cache, input_ids[:, :-1], new_valid, num_logits=1)
            self.stats.num_target_forwards += 1
        self.cache.append(new_valid)
        self.stats.verify_time += clock(self.device) - start

    @property
    def active(self) -> list[int]:
        """The running rows (indices into the call's batch): those the cache still holds."""
        return self.cache.rows

    def _draft(self) -> tuple[list[Draft], list[int]]:
        """Each running row's draft, as long as the schedule says and the row's length budget leaves room for."""
        max_length = self.generation_config.max_length
        budgets = [max(0, min(self.schedule.draft_length, max_length - self.sequences[row].shape[1] - 1))
                   for row in self.active]
        if max(budgets) == 0:
            return [Draft.empty(self.device) for _ in self.active], budgets
        committed = [self.sequences[row][:, self.num_pads[row]:] for row in self.active]
        drafts = self.drafter.propose_batch(committed, budgets, self.active)
        if not all(draft.is_chain for draft in drafts):
            raise ValueError(f"{self.drafter!r} proposed a token tree; batch size > 1 supports chains only.")
        return drafts, budgets

    def _query(self, drafts: list[Draft]) -> tuple[torch.LongTensor, torch.BoolTensor]:
        """The step's input ids `(num_rows, 1 + longest draft)`: each row's pending token and draft tokens, then
        padding; and which slots hold a token."""
        lengths = torch.tensor([1 + draft.num_nodes for draft in drafts])
        query = torch.full((len(drafts), int(lengths.max())), self.pad_token_id, dtype=torch.long)
        for i, (row, draft) in enumerate(zip(self.active, drafts)):
            query[i, 0] = self.sequences[row][0, -1]
            query[i, 1 : 1 + draft.num_nodes] = draft.token_ids
        return query.to(self.device), torch.arange(query.shape[1]) < lengths[:, None]

    def step(self) -> bool:
        """One step for every running row: draft, one target forward, verify, commit. Returns whether all finished."""
        # 1. a draft per row
        start = clock(self.device)
        drafts, budgets = self._draft()
        verify_start = clock(self.device)
        # 2. one target forward over every row's pending token and draft tokens
        query, new_valid = self._query(drafts)
        logits = self.drafter.target_forward_batch(self.model, self.cache, query, new_valid)  # [rows, query, vocab]
        # 3. per row: logits processors, verification, commit until a stopping criterion
        num_kept, finished, num_accepted = [], [], []
        for i, (row, draft) in enumerate(zip(self.active, drafts)):
            accepted, done = self._verify_and_commit(row, draft, logits[i, : draft.num_nodes + 1], budgets[i])
            num_kept.append(1 + accepted)
            num_accepted.append(accepted)
            finished.append(done)
        # 4. each row keeps its pending token and accepted draft tokens in the cache; finished rows leave the batch
        self.cache.append(torch.arange(query.shape[1]) < torch.tensor(num_kept)[:, None])
        if any(finished):
            self.cache.keep_rows([row for row, done in zip(self.active, finished) if not done])
        # 5. timings; the schedule learns from every row of the step
        end = clock(self.device)
        self.stats.num_target_forwards += 1
        self.stats.draft_time += verify_start - start
        self.stats.verify_time += end - verify_start
        for draft, budget, accepted in zip(drafts, budgets, num_accepted):
            self.schedule.update(budget, draft.num_nodes, draft.num_nodes, accepted, verify_start - start,
                                 end - verify_start)
        return not self.active

    def _verify_and_commit(self, row: int, draft: Draft, logits: torch.FloatTensor, budget: int) -> tuple[int, bool]:
        """Verifies row `row`'s draft against its logits `(num_nodes + 1, vocab)` and commits the new tokens.

        Returns the number of accepted draft tokens and whether the row finished."""
        prefixes = draft.tree.prefixes(self.sequences[row], draft.token_ids, range(-1, draft.num_nodes))
        processors = RowOfBatch(self.logits_processor, len(self.sequences), row)
        scores = process_logits(processors, prefixes, logits)  # [num_nodes + 1, vocab]
        verdict = self.verifier(draft, scores, do_sample=self.generation_config.do_sample, generator=self.generator)
        new_tokens = torch.cat([draft.token_ids[verdict.accepted_nodes], verdict.next_token[None]])
        self.sequences[row], committed, finished = commit_tokens(self.sequences[row], new_tokens,
                                                                 scores[: len(new_tokens)], self.stopping_criteria)
        self.row_stats[row].record(draft.num_nodes, min(verdict.num_accepted, committed), committed,
                                   draft_length=budget)
        return verdict.num_accepted, finished

    def output(self) -> SpeculativeGenerateOutput:
        """The rows, right-padded with the pad token to the longest (as plain `generate` pads finished rows)."""
        width = max(sequence.shape[1] for sequence in self.sequences)
        sequences = torch.stack([torch.nn.functional.pad(sequence[0], (0, width - sequence.shape[1]),
                                                         value=self.pad_token_id) for sequence in self.sequences])
        for row_stats in self.row_stats:
            self.stats.add(row_stats)
        self.stats.row_stats = self.row_stats
        return SpeculativeGenerateOutput(sequences=sequences, speculative_stats=self.stats)
