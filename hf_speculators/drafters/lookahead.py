"""Lookahead decoding: Jacobi iteration over a window of future positions makes n-grams; the n-grams that start with
the last committed token are verified, all in the same target forward (Fu et al., ICML 2024)."""

import functools
from dataclasses import dataclass, field

import torch

from ..tree import trie_from_sequences
from ..draft import Draft
from .base import Drafter, DraftState, StepFeedback
from .spec import MethodSpec, Setting, Variant


@functools.cache
def window_visible(window_size: int, num_levels: int) -> torch.BoolTensor:
    """`torch.BoolTensor` of shape `(num_levels * window_size,) * 2`: which window tokens each window token attends
    to. Token (j, i) (level j, column i, index `j * window_size + i`) sees level 0's columns `0..i` and column i of
    levels `1..j`: with the pending token before them, its virtual sequence."""
    level = torch.arange(num_levels).repeat_interleave(window_size)
    column = torch.arange(window_size).repeat(num_levels)
    first_level_before = (level[None, :] == 0) & (column[None, :] <= column[:, None])
    same_column_below = (level[None, :] >= 1) & (level[None, :] <= level[:, None]) & (column[None, :] == column[:, None])
    return first_level_before | same_column_below


@dataclass
class LookaheadRow:
    """One row's lookahead state.

    Args:
        levels (`list[list[int]]`): the Jacobi window, up to `ngram_size - 1` levels of `window_size` tokens; level
            j, column i sits `1 + i + j` positions after the pending token.
        pool (`dict[int, list[tuple[int, ...]]]`): n-grams by first token: each key's continuations of
            `ngram_size - 1` tokens, at most `verification_set_size`, oldest first.
        num_indexed (`int`): committed tokens from which n-grams have been added to the pool.
    """

    levels: list[list[int]]
    pool: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)
    num_indexed: int = 0


@dataclass
class LookaheadState(DraftState):
    """A call's `LookaheadRow` per row (keyed by the row's index in the batch)."""

    rows: dict = field(default_factory=dict)


class LookaheadDrafter(Drafter):
    """Lookahead decoding (Fu, Bailis, Stoica and Zhang, "Break the Sequential Dependency of LLM Inference Using
    Lookahead Decoding", ICML 2024), with TensorRT-LLM's parameter names.

    Each step the target's one forward scores, besides the pending token:

    - the verification branch: up to `verification_set_size` (G) n-grams of the pool that start with the pending
      token, their other `ngram_size - 1` tokens merged into a token tree (the draft the verifier checks);
    - the lookahead branch: the Jacobi window of `window_size` (W) columns and `ngram_size - 1` (N - 1) levels,
      sent as unverified tokens (`Draft.extra_token_ids`). Token (j, i) attends to the pending token, level 0's
      columns 0..i and column i of levels 1..j (`window_visible`), at the position after them: exactly its virtual
      sequence, as if the target ran over it alone.

    From the window's logits (`observe`), the argmax after each column of the last level becomes the next level; the
    column's tokens through that new token form an n-gram of N tokens that joins the pool (keyed by its first token,
    duplicates skipped, the oldest of a key evicted beyond G); then the window moves one level up. The window fills
    one level per step at first, its first level taken from the last W prompt tokens. The pool is also seeded with
    the committed text's n-grams (the prompt's first, then the output's as it grows). The window does not follow
    the accepted tokens: as in the reference implementation, its guesses are only sources of n-grams, and only
    verification decides what is kept, so greedy output is the target's exactly and, the draft being deterministic
    (`draft_probs=None`), rejection sampling over the tree is lossless. A step that cannot place the window before
    the target's `max_position_embeddings` sends the verification branch alone.

    Tokens per forward: 1 + up to `G * (N - 1)` tree nodes (fewer where n-grams share prefixes) + `W * (N - 1)`
    window tokens. On a CPU a forward costs more with every token: keep W and G small there.

    Args:
        window_size (`int`, defaults to 4): W, the window's columns (future positions guessed in parallel).
        ngram_size (`int`, defaults to 3): N, the n-gram length; the window has N - 1 levels and a step accepts at
            most N - 1 draft tokens (`num_draft_tokens = N - 1`).
        verification_set_size (`int`, defaults to 4): G, the most n-grams verified per step and kept per first token.

    Raises:
        `ValueError`: `window_size` or `verification_set_size` below 1, or `ngram_size` below 2.
    """

    name = "lookahead"
    state_class = LookaheadState
    drafts_trees = True

    def __init__(self, window_size: int = 4, ngram_size: int = 3, verification_set_size: int = 4):
        for name, value, low in (("window_size", window_size, 1), ("ngram_size", ngram_size, 2),
                                 ("verification_set_size", verification_set_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
        super().__init__(ngram_size - 1)
        self.window_size, self.ngram_size, self.verification_set_size = window_size, ngram_size, verification_set_size

    def _add(self, row: LookaheadRow, ngram: tuple[int, ...]) -> None:
        """Adds an n-gram to the pool under its first token (skipped if known; the key's oldest evicted beyond G)."""
        continuations = row.pool.setdefault(ngram[0], [])
        if ngram[1:] not in continuations:
            continuations.append(ngram[1:])
            if len(continuations) > self.verification_set_size:
                continuations.pop(0)

    def _row(self, state: LookaheadState, tokens: torch.LongTensor, row: int) -> LookaheadRow:
        """Row `row`'s state, made on its first step, with the n-grams of its committed `tokens` `(sequence_length,)`
        not indexed yet added to the pool (only those are read back from the device)."""
        if row not in state.rows:
            last = tokens[-self.window_size :].tolist()
            first_level = [last[(len(last) - self.window_size + i) % len(last)] for i in range(self.window_size)]
            state.rows[row] = LookaheadRow(levels=[first_level])
        lookahead = state.rows[row]
        new = tokens[lookahead.num_indexed :].tolist()
        for start in range(len(new) - self.ngram_size + 1):
            self._add(lookahead, tuple(new[start : start + self.ngram_size]))
        lookahead.num_indexed = max(lookahead.num_indexed, len(tokens) - self.ngram_size + 1)
        return lookahead

    def _fits(self, state: LookaheadState, num_tokens: int, num_levels: int) -> bool:
        """Whether the window's last position is within the target's position limit."""
        limit = getattr(getattr(state.target, "config", None), "max_position_embeddings", None)
        return limit is None or num_tokens - 1 + self.window_size + num_levels - 1 < limit

    def draft_row(self, state: LookaheadState, input_ids: torch.LongTensor, max_tokens: int, row: int) -> Draft:
        lookahead = self._row(state, input_ids[0], row)
        depth = min(self.ngram_size - 1, max_tokens)
        candidates = [ngram[:depth] for ngram in reversed(lookahead.pool.get(int(input_ids[0, -1]), []))]  # newest first
        draft = Draft.from_lists(*trie_from_sequences(candidates), device=input_ids.device)
        num_levels = len(lookahead.levels)
        if not self._fits(state, input_ids.shape[1], num_levels):
            return draft
        num_nodes, num_extra = draft.num_nodes, num_levels * self.window_size
        visible = torch.zeros(num_extra, 1 + num_nodes + num_extra, dtype=torch.bool)
        visible[:, 0] = True  # the pending token
        visible[:, 1 + num_nodes :] = window_visible(self.window_size, num_levels)
        offsets = 1 + torch.arange(self.window_size).repeat(num_levels) + torch.arange(num_levels).repeat_interleave(
            self.window_size)
        return Draft(draft.token_ids, draft.parent_ids,
                     extra_token_ids=torch.tensor(sum(lookahead.levels, []), device=input_ids.device),
                     extra_offsets=offsets, extra_visible=visible)

    def observe(self, state: LookaheadState, feedback: StepFeedback) -> None:
        """Takes each row's window logits: the last level's argmax becomes a new level, the n-grams it completes
        join the pool, and the window moves one level up once it has `ngram_size - 1` levels."""
        for row, logits in zip(feedback.rows, feedback.extra_logits or []):
            if logits is None or not len(logits):
                continue
            lookahead = state.rows[row]
            new_level = logits[-self.window_size :].argmax(dim=-1).tolist()
            if len(lookahead.levels) == self.ngram_size - 1:
                for column in zip(*lookahead.levels, new_level):
                    self._add(lookahead, column)
                lookahead.levels.pop(0)
            lookahead.levels.append(new_level)

    def __repr__(self) -> str:
        return (f"LookaheadDrafter(window_size={self.window_size}, ngram_size={self.ngram_size}, "
                f"verification_set_size={self.verification_set_size})")


LOOKAHEAD_SPEC = MethodSpec(
    "lookahead", LookaheadDrafter, settings=(
        Setting("window_size", low=1, help="lookahead: W, the window's columns (default 4)"),
        Setting("ngram_size", low=1, help="lookahead: N, the n-gram length (default 3)"),
        Setting("verification_set_size", low=1, help="lookahead: G, the most n-grams verified per step (default 4)")),
    variants={"lookahead": Variant(length="own")},
    draft_length=lambda config: config.resolved("ngram_size") - 1,
    no_draft_tokens="its drafts are ngram_size - 1 tokens long; set ngram_size.",
)
