"""Prompt-lookup drafting: continue the text the way it continued after an earlier occurrence of its suffix."""

from dataclasses import dataclass, field

import torch

from ..draft import Draft
from ..tree import trie_from_sequences
from .base import Drafter, DraftState
from .spec import Baseline, MethodSpec, Setting, Variant, VllmMapping

MATCH_RULES = ("latest", "earliest")


class NgramIndex:
    """Maps every n-gram of one token sequence to the positions that followed its occurrences.

    Updated incrementally with the tokens added since the last `update`, so a step costs O(max_ngram_size)
    lookups, not a rescan of the text; a sequence that does not extend the indexed one starts the index over.

    Args:
        min_ngram_size (`int`): shortest n-gram indexed.
        max_ngram_size (`int`): longest n-gram indexed.
    """

    def __init__(self, min_ngram_size: int, max_ngram_size: int):
        self.min_ngram_size, self.max_ngram_size = min_ngram_size, max_ngram_size
        self._reset()

    def _reset(self) -> None:
        self.tokens: list[int] = []
        self._indexed_ids = None  # the same tokens as a tensor (on the ids' device), to compare cheaply
        self._followers: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions right after its occurrences

    def update(self, input_ids: torch.LongTensor) -> None:
        """Indexes the tokens of `input_ids` `(1, sequence_length)` not indexed yet."""
        known = len(self.tokens)
        if known and (input_ids.shape[-1] < known or not torch.equal(input_ids[0, :known], self._indexed_ids[:known])):
            self._reset()  # another sequence than the one indexed: start over
            known = 0
        self._indexed_ids = input_ids[0]
        self.tokens.extend(input_ids[0, known:].tolist())
        for position in range(max(known, 1), len(self.tokens)):
            for size in range(self.min_ngram_size, min(self.max_ngram_size, position) + 1):
                self._followers.setdefault(tuple(self.tokens[position - size : position]), []).append(position)

    def followers(self, ngram: tuple[int, ...]) -> list[int]:
        """The positions right after the occurrences of `ngram` (oldest first) that have a token after them."""
        return self._followers.get(ngram, [])

    def match_starts(self, num_candidates: int, prefer: str) -> list[int]:
        """Up to `num_candidates` positions whose continuation to copy, the best match first (see
        `PromptLookupDrafter` for the rule `prefer` selects)."""
        tokens, starts = self.tokens, []
        for size in range(min(self.max_ngram_size, len(tokens)), self.min_ngram_size - 1, -1):
            positions = self.followers(tuple(tokens[-size:]))
            for start in reversed(positions) if prefer == "latest" else positions:
                if len(starts) == num_candidates:
                    return starts
                if start not in starts:
                    starts.append(start)
        return starts

    def copy_from(self, start: int, max_tokens: int) -> list[int]:
        """The `max_tokens` tokens that followed position `start`, continued through the draft itself.

        A copy that reaches the end of the text goes on copying its own draft tokens: after "a b a b" the match
        of "a b" at position 0 drafts "a b a b ...", not just the two tokens before the end.
        """
        tokens, draft = self.tokens, []
        for source in range(start, start + max_tokens):
            draft.append(tokens[source] if source < len(tokens) else draft[source - len(tokens)])
        return draft


@dataclass
class PromptLookupState(DraftState):
    """A call's n-gram index per row (keyed by the row's index in the batch)."""

    indexes: dict = field(default_factory=dict)


def _cut_after_eos(continuation: list[int], eos_token_ids: set[int]) -> list[int]:
    """`continuation` up to and including its first EOS token."""
    for i, token in enumerate(continuation):
        if token in eos_token_ids:
            return continuation[: i + 1]
    return continuation


class PromptLookupDrafter(Drafter):
    """Drafts by n-gram matching over the prompt and the generated text (prompt lookup decoding, Saxena 2023).

    Match rule: the longest suffix n-gram (from `max_ngram_size` down to `min_ngram_size` tokens) that occurred
    before wins; among its earlier occurrences, `prefer="latest"` (the default) takes the most recent one and
    `prefer="earliest"` the first one from the left, which is what transformers' prompt lookup does. The draft
    is the tokens that followed that occurrence, at most `max_tokens` of them, cut after the first EOS token;
    a copy that reaches the end of the text continues with its own draft tokens (a repeating pattern keeps
    repeating), so a recent match still yields a full draft.

    With `num_candidates=m > 1` the draft is a token tree: the continuations of up to m earlier occurrences
    (the longest n-gram's occurrences in the order of `prefer`, then those of shorter n-grams) merged into one trie,
    so continuations that agree share nodes and the target checks all of them in one forward. With the default
    `num_candidates=1` the draft is the chain described above.

    The n-gram index (`NgramIndex`, one per row of a batch) is updated incrementally with the tokens committed since
    the last step. The draft is deterministic (`draft_probs=None`).

    Args:
        num_draft_tokens (`int`, defaults to 8): draft tokens per step (transformers: `prompt_lookup_num_tokens`).
        max_ngram_size (`int`, defaults to 3): longest suffix n-gram tried.
        min_ngram_size (`int`, defaults to 1): shortest suffix n-gram tried.
        prefer (`str`, defaults to `"latest"`): which earlier occurrence to continue, `"latest"` or `"earliest"`.
        num_candidates (`int`, defaults to 1): how many continuations to merge into a tree (1: a chain).

    Raises:
        `ValueError`: for sizes or `num_candidates` below 1, `min_ngram_size > max_ngram_size`, or an unknown `prefer`.
    """

    name = "prompt-lookup"
    state_class = PromptLookupState

    def __init__(self, num_draft_tokens: int = 8, max_ngram_size: int = 3, min_ngram_size: int = 1,
                 prefer: str = "latest", num_candidates: int = 1):
        super().__init__(num_draft_tokens)
        if isinstance(num_candidates, bool) or not isinstance(num_candidates, int) or num_candidates < 1:
            raise ValueError(f"num_candidates must be an integer >= 1, got {num_candidates!r}.")
        if not 1 <= min_ngram_size <= max_ngram_size:
            raise ValueError(
                f"Need 1 <= min_ngram_size <= max_ngram_size, got min_ngram_size={min_ngram_size}, "
                f"max_ngram_size={max_ngram_size}."
            )
        if prefer not in MATCH_RULES:
            raise ValueError(f"prefer must be one of {MATCH_RULES}, got {prefer!r}.")
        self.max_ngram_size = max_ngram_size
        self.min_ngram_size = min_ngram_size
        self.prefer = prefer
        self.num_candidates = num_candidates

    @property
    def drafts_trees(self) -> bool:
        return self.num_candidates > 1

    def draft_row(self, state: PromptLookupState, input_ids: torch.LongTensor, max_tokens: int, row: int) -> Draft:
        index = state.indexes.get(row)
        if index is None:
            index = state.indexes[row] = NgramIndex(self.min_ngram_size, self.max_ngram_size)
        index.update(input_ids)
        starts = index.match_starts(self.num_candidates, self.prefer)
        continuations = [_cut_after_eos(index.copy_from(start, max_tokens), state.eos_token_ids) for start in starts]
        return Draft.from_lists(*trie_from_sequences(continuations), device=input_ids.device)

    def __repr__(self) -> str:
        return (
            f"PromptLookupDrafter(num_draft_tokens={self.num_draft_tokens}, max_ngram_size={self.max_ngram_size}, "
            f"min_ngram_size={self.min_ngram_size}, prefer={self.prefer!r}, num_candidates={self.num_candidates})"
        )


PROMPT_LOOKUP_SPEC = MethodSpec(
    "prompt-lookup", PromptLookupDrafter, settings=(
        Setting("max_ngram_size", low=1, help="prompt lookup's longest n-gram"),
        Setting("min_ngram_size", low=1, help="prompt lookup's shortest n-gram"),
        Setting("num_candidates", low=1, help="prompt-lookup-tree: continuations merged into the trie (default 4)"),
        Setting("prefer", str, choices=MATCH_RULES,
                help="our prompt lookups' match rule among earlier occurrences (default: latest)")),
    variants={"prompt-lookup": Variant(ignores=("num_candidates",)), "prompt-lookup-tree": Variant(settings={"num_candidates": 4})},
    vllm=VllmMapping("ngram", fields={"max_ngram_size": "prompt_lookup_max", "min_ngram_size": "prompt_lookup_min"},
                     draft=False),
    baselines={"hf-prompt-lookup": Baseline(
        ("num_draft_tokens", "max_ngram_size"), lambda config, target, draft, build: {
            "prompt_lookup_num_tokens": config.resolved("num_draft_tokens"),
            "max_matching_ngram_size": config.resolved("max_ngram_size")})},
)
