"""The speculative loop: one step function for a batch of one or more rows, owning the target's forward."""

import torch

from .cache import DEFAULT_MAX_HOLES, RaggedCache, declared_windows, seq_length, truncate
from .compiled import CompiledSteps
from .draft import Draft
from .drafters import Drafter
from .drafters.base import StepFeedback
from .floor import PlainFloor
from .metrics import SpeculativeStats, clock
from .outputs import CACHE_FIELD, SpeculativeGenerateOutput, commit_tokens
from .query import Query
from .sampling import row_processors, process_logits
from .schedules import DraftLengthSchedule
from .step import Proposal, RowOutcome, TargetOutput
from .target import TargetForward
from .verifiers import Verifier


class SpeculativeLoop:
    """The state of one speculative generate call over `batch_size` rows (a single sequence is a batch of one).

    Each step every running row gets its own draft (a chain or a token tree), one target forward scores every row's
    pending token and draft (`Query`), each row is verified on its own and keeps its accepted tokens in the
    `RaggedCache`, and the drafter is handed what it reads of that forward (`StepFeedback`). A row that meets a
    stopping criterion leaves the batch: no more drafting, and no more target compute when eager (compiled, it
    keeps its place in the forwards' tensors as a dummy row, so that one graph serves the call). Rows are kept with their left
    padding, as plain `generate` sees them, so `max_length`, the stopping criteria and the logits processors treat
    each row as a plain batched call would (`row_processors`); drafters and verifiers see a row without padding.
    With one row the cache never keeps a hole, the target runs with its own causal mask for chains, and the
    streamer, `output_scores`, `output_logits` and the returned cache are served.

    Args:
        model (`PreTrainedModel`): the target.
        drafter (`Drafter`): proposes each row's draft.
        verifier (`Verifier`): judges each row's draft.
        schedule (`DraftLengthSchedule`): one draft length per step for every row, updated once per step.
        generation_config, logits_processor, stopping_criteria: as transformers prepared them.
        generator (`torch.Generator`): the only source of randomness.
        tokenizer (`PreTrainedTokenizerBase`, *optional*): the target's tokenizer, for the drafter's checks.
        streamer (`BaseStreamer`, *optional*): one row only: receives the prompt, then every committed token once.
        pad_token_id (`int`): fills draft-less query slots and the end of rows that finished early.
        max_holes (`int`, defaults to `cache.DEFAULT_MAX_HOLES`): the `RaggedCache` compaction threshold (0: realign
            every step). Not a `generate` argument: `examples/batch_compaction.py` passes it to measure its cost.
        compiled (`CompiledSteps`, *optional*): the compiled target forward of the decoding steps and the query
            width they are padded to (`compiled.compiled_steps`); `None`: eager steps of the drafts' own widths.
        floor (`PlainFloor`, *optional*): beneath the schedule, holds each row plain while its drafts cost more than
            they bring (`floor.py`); `None`: every row drafts what the schedule asks.
    """

    def __init__(self, model, drafter: Drafter, verifier: Verifier, schedule: DraftLengthSchedule,
                 generation_config, logits_processor, stopping_criteria, generator, tokenizer=None, streamer=None,
                 pad_token_id: int = 0, max_holes: int = DEFAULT_MAX_HOLES, compiled: CompiledSteps | None = None,
                 floor: PlainFloor | None = None):
        self.model, self.drafter, self.verifier, self.schedule = model, drafter, verifier, schedule
        self.generation_config, self.logits_processor, self.stopping_criteria = (
            generation_config, logits_processor, stopping_criteria)
        self.generator, self.tokenizer, self.streamer = generator, tokenizer, streamer
        self.pad_token_id, self.max_holes, self.device = pad_token_id, max_holes, model.device
        self.compiled = compiled
        self.floor = floor
        self.stats = SpeculativeStats(lossless=verifier.lossless, verifier=verifier.name, drafter=repr(drafter))
        self.scores = [] if generation_config.output_scores else None
        self.raw_logits = [] if generation_config.output_logits else None

    def prefill(self, input_ids: torch.LongTensor, num_pads: list[int], cache) -> None:
        """Starts the drafter's state and caches every prompt token but the last of each row (pending for the
        first step), skipping the tokens a prefilled `cache` (one row only) already holds."""
        start = clock(self.device)
        batch_size = input_ids.shape[0]
        self.sequences = list(input_ids.split(1))  # [1, length] per row, left padding included
        self.prompt_width = input_ids.shape[1]
        self.num_pads = num_pads
        self.row_stats = [SpeculativeStats(lossless=self.stats.lossless, verifier=self.stats.verifier,
                                           drafter=self.stats.drafter) for _ in num_pads]
        self.processors = [row_processors(self.logits_processor, batch_size, row) for row in range(batch_size)]
        truncate(cache, input_ids.shape[1] - 1)
        num_cached = seq_length(cache)
        self.cache = RaggedCache(cache, torch.ones(batch_size, num_cached, dtype=torch.bool), self.max_holes,
                                 full_masks=batch_size > 1 and bool(declared_windows(self.model.config)),
                                 fixed_rows=self.compiled is not None)  # compiled: one batch size per call
        self.running = list(range(batch_size))  # the rows that have not finished (the cache's rows)
        self.state = self.drafter.new_state(
            self.model, self.generation_config, logits_processor=self.processors[0], generator=self.generator,
            tokenizer=self.tokenizer, cache=self.cache, batch_size=batch_size,
            query_widths=None if self.compiled is None else self.compiled.widths)
        self.target = TargetForward(self.model, self.drafter.target_needs(self.model),
                                    step_call=None if self.compiled is None else self.compiled.forward)
        self.observes = type(self.drafter).observe is not Drafter.observe  # whether feedback reaches anything
        if self.streamer is not None:
            self.streamer.put(input_ids.cpu())
        positions = torch.arange(num_cached, input_ids.shape[1] - 1)
        valid = positions >= torch.tensor(num_pads)[:, None]  # [batch_size, prompt length - 1 - num_cached]
        if valid.shape[1]:
            output = self.target(self.cache, Query.chain(input_ids[:, num_cached:-1], valid), num_logits=1)
            self.stats.num_target_forwards += 1
            self._feedback(valid, output)
            self.cache.append(valid)
        self.stats.verify_time += clock(self.device) - start

    def _budgets(self, rows: list[int]) -> list[int]:
        """Each running row's draft length: the schedule's, capped by what the length limit leaves (the step's
        next token takes one place), or 0 where the floor holds the row plain."""
        max_length = self.generation_config.max_length
        budgets = [max(0, min(self.schedule.draft_length, max_length - self.sequences[row].shape[1] - 1))
                   for row in rows]
        return budgets if self.floor is None else self.floor.budgets(rows, budgets)

    def step(self) -> bool:
        """One step for every running row: propose, query, forward, verify, commit, observe. Returns whether all
        finished."""
        start = clock(self.device)
        rows = self.running
        budgets = self._budgets(rows)
        proposal = self._propose(rows, budgets)
        verify_start = clock(self.device)
        pending = torch.cat([self.sequences[row][0, -1:] for row in rows]).to(self.device)
        query = Query.from_drafts(pending, proposal.drafts, self.pad_token_id,
                                  widths=None if self.compiled is None else self.compiled.widths)
        output = self.target(self.cache, query, proposal.resume)  # logits [rows, num_query, vocab]
        outcomes = [self._verify_and_commit(row, draft, output.logits[i, : draft.num_nodes + 1], budgets[i])
                    for i, (row, draft) in enumerate(zip(rows, proposal.drafts))]
        keep = torch.zeros_like(query.valid)  # [rows, num_query]: each row's pending token and accepted path
        for i, outcome in enumerate(outcomes):
            keep[i, outcome.kept_slots] = True
        self._feedback(keep, output, query, outcomes)  # the drafter reads what it asked for of the forward
        self._keep_slots(keep, query, outcomes)
        self._observe(outcomes, verify_start - start, clock(self.device) - verify_start)
        return not self.running

    def _propose(self, rows: list[int], budgets: list[int]) -> Proposal:
        """Each running row's draft, as long as its budget; without a drafter call when every budget is 0."""
        if max(budgets) == 0:
            return Proposal([Draft.empty(self.device) for _ in rows])
        committed = [self.sequences[row][:, self.num_pads[row]:] for row in rows]
        return Proposal.of(self.drafter.propose(self.state, committed, budgets, rows))

    def _verify_and_commit(self, row: int, draft: Draft, logits: torch.FloatTensor, budget: int) -> RowOutcome:
        """Verifies row `row`'s draft (asked for `budget` tokens) against its logits `(num_nodes + 1, vocab)` and
        commits the new tokens."""
        prefixes = draft.tree.prefixes(self.sequences[row], draft.token_ids, range(-1, draft.num_nodes))
        scores = process_logits(self.processors[row], prefixes, logits)  # [num_nodes + 1, vocab]
        verdict = self.verifier(draft, scores, do_sample=self.generation_config.do_sample, generator=self.generator)
        new_tokens = torch.cat([draft.token_ids[verdict.accepted_nodes], verdict.next_token[None]])
        # a chain's accepted nodes are its first ones (`Verdict`): no read of the device
        nodes = list(range(verdict.num_accepted)) if draft.is_chain else verdict.accepted_nodes.tolist()
        scored_by = [0] + [node + 1 for node in nodes]  # the scores row of each new token
        self.sequences[row], committed, finished = commit_tokens(self.sequences[row], new_tokens, scores[scored_by],
                                                                 self.stopping_criteria)
        self._extra_outputs(new_tokens[:committed], scored_by[:committed], scores, logits)
        return RowOutcome(row, budget, draft.num_nodes, draft.tree.depth, nodes, committed, finished)

    def _keep_slots(self, keep: torch.BoolTensor, query: Query, outcomes: list[RowOutcome]) -> None:
        """Each row's cache keeps its `keep` slots `(rows, num_query)`; the rows that finished leave the batch."""
        self.cache.append(keep, gather=query.visible is not None)  # a chain's kept slots come first already
        if any(outcome.finished for outcome in outcomes):
            self.running = [outcome.row for outcome in outcomes if not outcome.finished]
            if self.running:  # one row's cache stays for the output
                self.cache.keep_rows(self.running)

    def _observe(self, outcomes: list[RowOutcome], draft_seconds: float, verify_seconds: float) -> None:
        """The step's timings; each row's stats and the schedule learn from the step's outcomes."""
        self.stats.num_target_forwards += 1
        self.stats.draft_time += draft_seconds
        self.stats.verify_time += verify_seconds
        for outcome in outcomes:
            self.row_stats[outcome.row].record(
                outcome.num_nodes, min(outcome.num_accepted, outcome.num_committed), outcome.num_committed,
                depth=outcome.depth, draft_length=outcome.draft_length)
        self.schedule.update(outcomes, draft_seconds, verify_seconds)
        if self.floor is not None:
            self.floor.update(outcomes, draft_seconds, verify_seconds)

    def _extra_outputs(self, new_tokens: torch.LongTensor, scored_by: list[int], scores, logits) -> None:
        """Streams the committed tokens and keeps their scores and logits, when asked (one row only)."""
        if self.scores is not None:
            self.scores.extend(scores[i : i + 1] for i in scored_by)
        if self.raw_logits is not None:
            self.raw_logits.extend(logits[i : i + 1].float() for i in scored_by)
        if self.streamer is not None:
            self.streamer.put(new_tokens.cpu())

    def _feedback(self, keep: torch.BoolTensor, output: TargetOutput, query: Query | None = None,
                  outcomes: list[RowOutcome] | None = None) -> None:
        """Hands the drafter the features of each row's kept slots `keep` `(rows, num_query)`, the logits of its
        unverified tokens and, after a step, each row's accepted draft tokens (after a prefill: only when it reads
        features)."""
        if not self.observes:  # the drafter ignores feedback: build none (prompt lookup, the draft model, ...)
            return
        features, logits = output.features, output.logits
        extra = query is not None and query.visible is not None and any(
            int(query.valid[i].sum()) > n for i, n in enumerate(query.num_verified))
        if features is None and not extra and outcomes is None:
            return
        rows = self.running
        kept = [keep[i].to(features.device) for i in range(len(rows))] if features is not None else None
        self.drafter.observe(self.state, StepFeedback(
            rows=rows,
            positions=self.cache.lengths.tolist(),
            features=None if kept is None else [features[i, slots] for i, slots in enumerate(kept)],
            extra_logits=None if not extra else [
                logits[i, n : int(query.valid[i].sum())] for i, n in enumerate(query.num_verified)],
            num_accepted=None if outcomes is None else [outcome.num_accepted for outcome in outcomes],
        ))

    def output(self) -> SpeculativeGenerateOutput:
        """The rows, right-padded with the pad token to the longest (as plain `generate` pads finished rows), and
        the call's stats (a batch's with `row_stats`); for one row also the cache, holding every token but the last
        (as after plain `generate`)."""
        if self.streamer is not None:
            self.streamer.end()
        prompt_lengths = [self.prompt_width - pads for pads in self.num_pads]
        self.stats.drafter_stats = self.drafter.finish(
            self.state, [sequence[:, pads:] for sequence, pads in zip(self.sequences, self.num_pads)], prompt_lengths)
        for row, row_stats in enumerate(self.row_stats):
            row_stats.num_floor_steps = 0 if self.floor is None else self.floor.num_plain_steps(row)
            self.stats.add(row_stats)
        if len(self.sequences) > 1:
            self.stats.row_stats = self.row_stats
        cache = None
        if len(self.sequences) == 1:
            self.cache.truncate(torch.tensor([self.sequences[0].shape[1] - 1]))
            cache = self.cache.cache
        width = max(sequence.shape[1] for sequence in self.sequences)
        sequences = torch.cat([torch.nn.functional.pad(sequence, (0, width - sequence.shape[1]),
                                                       value=self.pad_token_id) for sequence in self.sequences])
        return SpeculativeGenerateOutput(
            sequences=sequences,
            scores=None if self.scores is None else tuple(self.scores),
            logits=None if self.raw_logits is None else tuple(self.raw_logits),
            speculative_stats=self.stats,
            **{CACHE_FIELD: cache},
        )
