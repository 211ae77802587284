"""Suffix decoding: continue the text the way the most frequent continuations of its longest suffix match went, in
the call's own text and in what earlier calls of the same drafter generated (Oliaro et al. 2024, SuffixDecoding)."""

import heapq
import itertools
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..folders import write_folder
from ..draft import Draft
from .base import Drafter, DraftState
from .prompt_lookup import NgramIndex
from .spec import MethodSpec, Setting, Variant, VllmMapping

KEY_SIZE = 3  # longest n-gram the indexes look up directly; longer matches are found by comparing backwards
MAX_OCCURRENCES = 64  # occurrences of the matched n-gram examined per index and step (the most recent ones)
CACHE_FILE = "suffix_cache.json"

Occurrence = tuple[list[int], int]  # (a stored token sequence, the position right after the matched text in it)


class SuffixCache:
    """The cross-call memory of a `SuffixDrafter`: the token sequences earlier calls generated, indexed by n-gram.

    Each stored sequence is one finished row of an earlier call: its last `max_tree_depth - 1` prompt tokens (the
    context its first generated tokens followed) and its generated tokens. The n-grams of 1 to `KEY_SIZE` tokens map
    to the positions that followed them. The oldest sequence is evicted when `max_cached_requests` are stored. Safe
    for concurrent calls: every read and write holds one lock.

    Memory: about 0.5 kB per stored token (Python objects of the index), so `max_cached_requests` rows of `n`
    tokens take about `0.5 * n * max_cached_requests` kB (1,000 rows of 512 tokens: about 250 MB).

    Args:
        max_cached_requests (`int`): rows kept (0: nothing is kept).
    """

    def __init__(self, max_cached_requests: int):
        self.max_cached_requests = max_cached_requests
        self._lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        """Forgets every stored sequence."""
        with self._lock:
            self._sequences: OrderedDict[int, list[int]] = OrderedDict()  # oldest first
            self._followers: dict[tuple[int, ...], dict[int, list[int]]] = {}  # n-gram -> sequence id -> positions
            self._next_id = 0

    def __len__(self) -> int:
        return len(self._sequences)

    @property
    def sequences(self) -> list[list[int]]:
        """The stored sequences, oldest first (copies)."""
        with self._lock:
            return [list(tokens) for tokens in self._sequences.values()]

    @property
    def num_tokens(self) -> int:
        """Tokens stored over all sequences."""
        with self._lock:
            return sum(map(len, self._sequences.values()))

    def add(self, tokens: list[int]) -> None:
        """Stores `tokens` as the newest sequence, evicting the oldest ones over `max_cached_requests`."""
        if self.max_cached_requests == 0 or len(tokens) < 2:
            return
        with self._lock:
            seq_id, self._next_id = self._next_id, self._next_id + 1
            self._sequences[seq_id] = tokens
            for position in range(1, len(tokens)):
                for size in range(1, min(KEY_SIZE, position) + 1):
                    ngram = tuple(tokens[position - size : position])
                    self._followers.setdefault(ngram, {}).setdefault(seq_id, []).append(position)
            while len(self._sequences) > self.max_cached_requests:
                self._evict_oldest()

    def replace(self, sequences: Sequence[list[int]]) -> None:
        """Replaces the stored sequences with `sequences`, oldest first (the newest kept past
        `max_cached_requests`)."""
        self.clear()
        for sequence in sequences:
            self.add(sequence)

    def _evict_oldest(self) -> None:
        seq_id, tokens = self._sequences.popitem(last=False)
        for position in range(1, len(tokens)):
            for size in range(1, min(KEY_SIZE, position) + 1):
                ngram = tuple(tokens[position - size : position])
                by_sequence = self._followers.get(ngram)
                if by_sequence is not None and by_sequence.pop(seq_id, None) is not None and not by_sequence:
                    del self._followers[ngram]

    def occurrences(self, ngram: tuple[int, ...]) -> list[Occurrence]:
        """The `MAX_OCCURRENCES` most recent occurrences of `ngram` that have a token after them, oldest first."""
        with self._lock:
            by_sequence = self._followers.get(ngram, {})
            found = []
            for seq_id in reversed(by_sequence):
                tokens = self._sequences[seq_id]
                found.extend((tokens, position) for position in reversed(by_sequence[seq_id]))
                if len(found) >= MAX_OCCURRENCES:
                    break
            return found[:MAX_OCCURRENCES][::-1]


def _local_occurrences(index: NgramIndex, ngram: tuple[int, ...]) -> list[Occurrence]:
    positions = index.followers(ngram)
    return [(index.tokens, position) for position in positions[-MAX_OCCURRENCES:]]


@dataclass(frozen=True)
class SuffixDraft:
    """A suffix-decoding draft before it becomes a `Draft`: tokens, parent indices (-1: the last committed token),
    best first, each token's frequency-estimated probability `probs` (its path's, so a chain's never rise) and
    `match_length` (tokens of the context matched)."""

    token_ids: list[int]
    parent_ids: list[int]
    probs: tuple[float, ...] = ()
    match_length: int = 0

    @property
    def score(self) -> float:
        """The sum of `probs`: the expected number of accepted tokens under the frequency estimate."""
        return sum(self.probs)

    def truncated(self, num_tokens: int) -> "SuffixDraft":
        """The draft's first `num_tokens` tokens: best first, so every kept token's parent is kept."""
        return SuffixDraft(self.token_ids[:num_tokens], self.parent_ids[:num_tokens], self.probs[:num_tokens],
                           self.match_length)


def _expand(occurrences: list[Occurrence], budget: int, min_token_prob: float, tree: bool,
            eos_token_ids: set[int]) -> tuple[list[int], list[int], tuple[float, ...]]:
    """The best `budget` continuation tokens of `occurrences`, best first (a token's probability: the share of the
    occurrences at its parent that continue with it, times its parent's probability); a chain of the most frequent
    continuation unless `tree`. Stops at tokens below `min_token_prob` and after an EOS token. Returns the tokens,
    their parents' indices and their probabilities."""
    tokens, parents, probs = [], [], []
    heap, order = [], itertools.count()

    def push(node: int, at: list[Occurrence], prob: float) -> None:
        groups: dict[int, list[Occurrence]] = {}  # next token -> occurrences that continue with it, oldest first
        for sequence, position in at:
            if position < len(sequence):
                groups.setdefault(sequence[position], []).append((sequence, position + 1))
        ranked = sorted(groups.items(), key=lambda item: -len(item[1]))  # stable: a tie goes to the earliest
        for token, group in ranked if tree else ranked[:1]:
            child_prob = prob * len(group) / len(at)
            if child_prob < min_token_prob:
                break
            heapq.heappush(heap, (-child_prob, next(order), node, token, group))

    push(-1, occurrences, 1.0)
    while heap and len(tokens) < budget:
        negative_prob, _, parent, token, group = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        probs.append(-negative_prob)
        if token not in eos_token_ids:
            push(len(tokens) - 1, group, -negative_prob)
    return tokens, parents, tuple(probs)


def speculate(occurrences_of, context: list[int], max_tokens: int, max_tree_depth: int, max_spec_factor: float,
              max_spec_offset: float, min_token_prob: float, tree: bool, eos_token_ids: set[int]) -> SuffixDraft:
    """The best draft after `context` from one index (SuffixDecoding's speculation, with n-gram lookups).

    The longest suffix of `context` of at most `KEY_SIZE` tokens that the index holds gives the candidate
    occurrences (`occurrences_of(ngram)`); each one's match is extended backwards, up to `max_tree_depth - 1`
    tokens. For every match length `p`, the occurrences matching at least `p` tokens give a draft of at most
    `min(max_tokens, floor(p * max_spec_factor + max_spec_offset), max_tree_depth - p)` tokens (`_expand`); the
    highest score wins, the longer match on a tie. (Match lengths with the same occurrences are drafted once, at
    the length of the largest budget: a longer draft of the same occurrences scores at least as high.)
    """
    max_match = min(len(context), max_tree_depth - 1)
    for key_size in range(min(KEY_SIZE, max_match), 0, -1):
        occurrences = occurrences_of(tuple(context[-key_size:]))
        if occurrences:
            break
    else:
        return SuffixDraft([], [])
    matched = []  # (match length, sequence, position)
    for sequence, position in occurrences:
        length = key_size
        while length < max_match and position - length > 0 and sequence[position - length - 1] == context[-length - 1]:
            length += 1
        matched.append((length, sequence, position))

    def budget(match_length: int) -> int:
        return min(max_tokens, math.floor(match_length * max_spec_factor + max_spec_offset),
                   max_tree_depth - match_length)

    best, shortest = SuffixDraft([], []), key_size
    for longest in sorted({length for length, _, _ in matched}):
        # every match length in [shortest, longest] has the same occurrences: the one of the largest budget
        # (the longest on a tie) drafts the most
        match_length = max(range(shortest, longest + 1), key=lambda length: (budget(length), length))
        chosen = [(sequence, position) for length, sequence, position in matched if length >= longest]
        shortest = longest + 1
        if budget(match_length) < 1:
            continue
        draft = SuffixDraft(*_expand(chosen, budget(match_length), min_token_prob, tree, eos_token_ids), match_length)
        if draft.token_ids and draft.score >= best.score:
            best = draft
    return best


@dataclass
class SuffixState(DraftState):
    """A call's n-gram index per row over its prompt and output (keyed by the row's index in the batch)."""

    indexes: dict = field(default_factory=dict)


class SuffixDrafter(Drafter):
    """Drafts the most frequent continuations of the text's longest suffix match (SuffixDecoding, Oliaro et al.,
    arXiv 2411.04975), in the call's own prompt and output and in what earlier calls of this drafter generated.

    Two indexes are searched each step, the call's own (one per row: its prompt and output so far) and the drafter's
    cross-call memory (`SuffixCache`: earlier calls' outputs, with the last prompt tokens before them); the draft
    with the higher score wins, the call's own on a tie (as Arctic Inference does). In an index, the longer the match
    of the text's last tokens, the longer the draft may be: `floor(match_length * max_spec_factor + max_spec_offset)`
    tokens, at most `num_draft_tokens`, and the match and the draft together at most `max_tree_depth` tokens. A
    draft token's probability is estimated by frequency: the share of the occurrences continuing its parent's path
    that continue with it, times its parent's probability; tokens below `min_token_prob` are not drafted, and a
    draft ends after an EOS token. With `use_tree_spec=False` the draft is a chain of the most frequent continuation;
    with `True` a token tree of the most probable tokens, best first. The score is the sum of the draft tokens'
    probabilities (the accepted tokens expected under that estimate; `HybridDrafter` compares it with a model
    drafter's). Drafts are deterministic (`draft_probs=None`): lossless under rejection sampling.

    The names are vLLM's and Arctic Inference's (`suffix_decoding_max_tree_depth`, `max_spec_factor`,
    `max_spec_offset`, `min_token_prob`, `suffix_decoding_max_cached_requests`, `use_tree_spec`). Where the reference
    walks a suffix tree, this implementation looks up the last 1 to 3 tokens in an n-gram index and extends each
    occurrence's match backwards (`speculate`), examining the 64 most recent occurrences per index and step: the
    same drafts when the text has few occurrences of its last tokens, in pure Python with no build step.

    The cross-call memory is the one state this drafter keeps between calls (a completed call adds each row; a
    call that raised adds nothing); `clear_cache`, `save_cache` and `load_cache` manage it, and `cache` holds it.
    It is bounded by `max_cached_requests` rows (the oldest evicted first; about 0.5 kB per stored token, see
    `SuffixCache`).

    Args:
        num_draft_tokens (`int`, defaults to 16): the most draft tokens per step (vLLM's `num_speculative_tokens`).
        max_tree_depth (`int`, defaults to 24): the most tokens of a match and its draft together.
        max_cached_requests (`int`, defaults to 1000): earlier rows kept in the cross-call memory (0: none).
        max_spec_factor (`float`, defaults to 1.0): draft tokens allowed per matched token.
        max_spec_offset (`float`, defaults to 0.0): draft tokens allowed besides those.
        min_token_prob (`float`, defaults to 0.1): the lowest estimated probability of a drafted token.
        use_tree_spec (`bool`, defaults to `False`): draft a token tree instead of a chain.

    Raises:
        `ValueError`: `max_tree_depth` below 2, `max_cached_requests` below 0, `max_spec_factor` below 0 or
            `min_token_prob` outside [0, 1].
    """

    name = "suffix"
    state_class = SuffixState

    def __init__(self, num_draft_tokens: int = 16, max_tree_depth: int = 24, max_cached_requests: int = 1000,
                 max_spec_factor: float = 1.0, max_spec_offset: float = 0.0, min_token_prob: float = 0.1,
                 use_tree_spec: bool = False):
        super().__init__(num_draft_tokens)
        if isinstance(max_tree_depth, bool) or not isinstance(max_tree_depth, int) or max_tree_depth < 2:
            raise ValueError(f"max_tree_depth must be an integer >= 2, got {max_tree_depth!r}.")
        if isinstance(max_cached_requests, bool) or not isinstance(max_cached_requests, int) or max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be an integer >= 0, got {max_cached_requests!r}.")
        if not max_spec_factor >= 0:
            raise ValueError(f"max_spec_factor must be >= 0, got {max_spec_factor!r}.")
        if not 0 <= min_token_prob <= 1:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob!r}.")
        self.max_tree_depth, self.max_spec_factor, self.max_spec_offset = max_tree_depth, max_spec_factor, max_spec_offset
        self.min_token_prob, self.use_tree_spec = min_token_prob, bool(use_tree_spec)
        self.cache = SuffixCache(max_cached_requests)

    @property
    def drafts_trees(self) -> bool:
        return self.use_tree_spec

    def scored_draft(self, state: SuffixState, input_ids: torch.LongTensor, max_tokens: int, row: int) -> SuffixDraft:
        """Row `row`'s best draft after `input_ids` `(1, sequence_length)`, at most `max_tokens` deep, with its
        score: the call's own index first, the cross-call memory if it scores higher."""
        index = state.indexes.get(row)
        if index is None:
            index = state.indexes[row] = NgramIndex(1, KEY_SIZE)
        index.update(input_ids)
        settings = dict(max_tokens=max_tokens, max_tree_depth=self.max_tree_depth,
                        max_spec_factor=self.max_spec_factor, max_spec_offset=self.max_spec_offset,
                        min_token_prob=self.min_token_prob, tree=self.use_tree_spec,
                        eos_token_ids=state.eos_token_ids)
        context = index.tokens[-self.max_tree_depth :]
        best = speculate(lambda ngram: _local_occurrences(index, ngram), context, **settings)
        if len(self.cache):
            cached = speculate(self.cache.occurrences, context, **settings)
            best = cached if cached.score > best.score else best
        return best

    def draft_row(self, state: SuffixState, input_ids: torch.LongTensor, max_tokens: int, row: int) -> Draft:
        draft = self.scored_draft(state, input_ids, max_tokens, row)
        return Draft.from_lists(draft.token_ids, draft.parent_ids, device=input_ids.device)

    def finish(self, state: SuffixState, sequences: Sequence[torch.LongTensor], prompt_lengths: Sequence[int]) -> dict:
        """Adds every row's output, after its last `max_tree_depth - 1` prompt tokens, to the cross-call memory."""
        for sequence, prompt_length in zip(sequences, prompt_lengths):
            if sequence.shape[1] > prompt_length:
                self.cache.add(sequence[0, max(0, prompt_length - self.max_tree_depth + 1) :].tolist())
        return {}

    def clear_cache(self) -> None:
        """Forgets what earlier calls generated."""
        self.cache.clear()

    def save_cache(self, directory: str | Path) -> Path:
        """Writes the cross-call memory to `directory/suffix_cache.json` (the folder is written all at once);
        returns the file's path."""
        text = json.dumps({"sequences": self.cache.sequences})
        directory = Path(directory)
        write_folder(directory, lambda folder: (folder / CACHE_FILE).write_text(text, encoding="utf-8"))
        return directory / CACHE_FILE

    def load_cache(self, directory: str | Path) -> None:
        """Replaces the cross-call memory with the one `save_cache` wrote to `directory` (the newest rows kept
        when it holds more than `max_cached_requests`).

        Raises:
            `FileNotFoundError`: no `suffix_cache.json` in `directory`.
            `ValueError`: a file that is not a saved suffix cache.
        """
        path = Path(directory) / CACHE_FILE
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            sequences = saved["sequences"]
            if not all(isinstance(s, list) and all(isinstance(t, int) for t in s) for s in sequences):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path} is not a suffix cache written by SuffixDrafter.save_cache.") from None
        self.cache.replace(sequences)

    @contextmanager
    def memory_kept(self) -> Iterator[None]:
        """Puts the cross-call memory back as it was on entry when the block ends."""
        kept = self.cache.sequences
        try:
            yield
        finally:
            self.cache.replace(kept)

    def __repr__(self) -> str:
        return (
            f"SuffixDrafter(num_draft_tokens={self.num_draft_tokens}, max_tree_depth={self.max_tree_depth}, "
            f"max_cached_requests={self.cache.max_cached_requests}, max_spec_factor={self.max_spec_factor}, "
            f"max_spec_offset={self.max_spec_offset}, min_token_prob={self.min_token_prob}, "
            f"use_tree_spec={self.use_tree_spec})"
        )


# suffix decoding's settings, which method "hybrid" takes too
SUFFIX_SETTINGS = (
    Setting("max_tree_depth", low=1, help="suffix, hybrid: the most tokens of a match and its draft together (default 24)"),
    Setting("max_cached_requests", low=0,
            help="suffix, hybrid: earlier outputs the drafter remembers across calls (default 1000; 0: none)"),
    Setting("max_spec_factor", float, low=0, help="suffix, hybrid: draft tokens allowed per matched token (default 1.0)"),
    Setting("max_spec_offset", float, help="suffix, hybrid: draft tokens allowed besides those (default 0.0)"),
    Setting("min_token_prob", float, low=0, high=1,
            help="suffix, hybrid: the lowest frequency-estimated probability drafted (default 0.1)"),
    Setting("use_tree_spec", bool, flag=False),
)
SUFFIX_SPEC = MethodSpec(
    "suffix", SuffixDrafter, settings=SUFFIX_SETTINGS, variants={"suffix": Variant()},
    vllm=VllmMapping("suffix", fields={name: f"suffix_decoding_{name}" for name in (
        "max_tree_depth", "max_cached_requests", "max_spec_factor", "min_token_prob")}, draft=False,
        needs="vLLM's suffix method needs the arctic-inference package beside vLLM (`pip install "
              "arctic-inference==0.1.1`, the version vLLM 0.32 asks for; it builds from source where it has no "
              "wheel): without it vLLM refuses to start"),
)
