"""PromptLookupDrafter against a brute-force reference: incremental index, match rules, EOS, new sequences."""

import random

import pytest
import torch
from transformers import GenerationConfig

import hf_speculators as hs
from hf_speculators.drafters.prompt_lookup import NgramIndex


def brute_force_lookup(tokens: list[int], max_tokens: int, max_ngram_size: int, min_ngram_size: int, prefer: str,
                       eos_token_ids=()) -> list[int]:
    """The documented rule, by rescanning: longest suffix n-gram with an earlier occurrence that has a follower;
    the latest (or earliest) such occurrence; `max_tokens` tokens of what followed it, where a copy that reaches
    the end of the text repeats itself (the text from the follower on is a period); cut after the first EOS."""
    length = len(tokens)
    for size in range(min(max_ngram_size, length), min_ngram_size - 1, -1):
        suffix = tokens[length - size :]
        starts = [i for i in range(length - size) if tokens[i : i + size] == suffix]
        if starts:
            start = (starts[-1] if prefer == "latest" else starts[0]) + size
            period = length - start
            continuation = [tokens[start + j % period] for j in range(max_tokens)]
            for i, token in enumerate(continuation):
                if token in eos_token_ids:
                    return continuation[: i + 1]
            return continuation
    return []


class Prepared:
    """A prompt-lookup drafter with the state of one call."""

    def __init__(self, eos_token_id=None, **kwargs):
        self.drafter = hs.PromptLookupDrafter(**kwargs)
        self.state = self.drafter.new_state(None, GenerationConfig(eos_token_id=eos_token_id))

    def propose(self, input_ids, max_tokens):
        return self.drafter.propose(self.state, [input_ids], [max_tokens], [0])[0]

    def _index(self, row: int) -> NgramIndex:
        """Row `row`'s n-gram index, made now if the call has none yet."""
        return self.state.indexes.setdefault(row, NgramIndex(self.drafter.min_ngram_size, self.drafter.max_ngram_size))


def prepared_drafter(eos_token_id=None, **kwargs) -> Prepared:
    return Prepared(eos_token_id, **kwargs)


def proposal(drafter: Prepared, tokens: list[int], max_tokens: int) -> list[int]:
    draft = drafter.propose(torch.tensor([tokens]), max_tokens)
    assert draft.is_chain and draft.draft_probs is None
    return draft.token_ids.tolist()


def count_index_resets(index, monkeypatch) -> list:
    resets = []
    original = index._reset
    monkeypatch.setattr(index, "_reset", lambda: (resets.append(1), original())[1])
    return resets


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("prefer", ["latest", "earliest"])
@pytest.mark.parametrize("ngram_sizes", [(1, 3), (2, 4), (1, 1)], ids=lambda s: f"ngram{s[0]}-{s[1]}")
def test_incremental_index_matches_brute_force(monkeypatch, seed, prefer, ngram_sizes):
    """Grow a random sequence (small alphabet: many matches) a few tokens at a time, as decoding does."""
    min_ngram_size, max_ngram_size = ngram_sizes
    rng = random.Random(seed)
    eos = 3
    drafter = prepared_drafter(eos_token_id=eos, num_draft_tokens=5, min_ngram_size=min_ngram_size,
                               max_ngram_size=max_ngram_size, prefer=prefer)
    index = drafter._index(0)
    resets = count_index_resets(index, monkeypatch)
    tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
    num_matches = 0
    while len(tokens) < 120:
        max_tokens = rng.randrange(0, 7)
        expected = brute_force_lookup(tokens, max_tokens, max_ngram_size, min_ngram_size, prefer, {eos})
        assert proposal(drafter, tokens, max_tokens) == expected, tokens
        num_matches += bool(expected)
        tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
    assert resets == []  # the index grew with the sequence, it was never rebuilt
    assert num_matches > 20  # the comparison is not vacuous
    # every n-gram's follower positions were appended once each, in order
    for positions in index._followers.values():
        assert positions == sorted(set(positions))


@pytest.mark.parametrize("prefer, expected", [("latest", [9, 1, 2]), ("earliest", [5, 1, 2])])
def test_match_rule(prefer, expected):
    tokens = [1, 2, 5, 1, 2, 7, 1, 2, 9, 1, 2]  # (1, 2) was followed by 5, then 7, then 9
    assert proposal(prepared_drafter(prefer=prefer, max_ngram_size=2), tokens, 3) == expected


def test_longest_ngram_wins():
    # the 1-gram (4,) last continued with 8, but the 2-gram (6, 4) continued with 5
    tokens = [6, 4, 5, 0, 4, 8, 6, 4]
    assert proposal(prepared_drafter(max_ngram_size=2), tokens, 2) == [5, 0]
    assert proposal(prepared_drafter(max_ngram_size=1), tokens, 2) == [8, 6]


@pytest.mark.parametrize("eos_token_id", [9, [2, 9]], ids=["eos", "eos_list"])
def test_never_proposes_past_eos(eos_token_id):
    tokens = [1, 2, 9, 4, 4, 1, 2]  # (1, 2) was followed by EOS 9, then more text
    assert proposal(prepared_drafter(eos_token_id=eos_token_id, max_ngram_size=2), tokens, 5) == [9]
    assert proposal(prepared_drafter(max_ngram_size=2), tokens, 5) == [9, 4, 4, 1, 2]  # no EOS: no cut


@pytest.mark.parametrize(
    "first, second",
    [
        ([1, 2, 3, 1, 2, 4, 1, 2], [5, 6, 5]),  # shorter
        ([1, 2, 3, 1, 2, 4, 1, 2], [5, 6, 5, 6, 7, 5, 6, 8, 5, 6]),  # longer, another token where the first ended
        ([1, 2, 3, 1, 2], [3, 3, 3, 3, 2, 1]),  # longer, the same token where the first ended
    ],
    ids=["shorter", "longer_other_last_token", "longer_same_last_token"],
)
def test_a_new_sequence_resets_the_index(first, second):
    """The drafter used on another sequence (a new prompt via get_candidates) must not draft from the old one."""
    drafter = prepared_drafter(max_ngram_size=2)
    proposal(drafter, first, 4)
    assert proposal(drafter, second, 4) == brute_force_lookup(second, 4, 2, 1, "latest")


def test_each_call_has_a_fresh_index():
    """Each generate call starts from a fresh index, whatever the previous call's sequence was."""
    drafter = prepared_drafter(max_ngram_size=2)
    proposal(drafter, [1, 2, 3, 1, 2], 4)
    drafter.state = drafter.drafter.new_state(None, GenerationConfig())
    second = [3, 3, 3, 3, 2, 1]  # agrees with the first sequence at its last position
    assert proposal(drafter, second, 4) == brute_force_lookup(second, 4, 2, 1, "latest") == []


def test_no_match_gives_an_empty_draft():
    assert proposal(prepared_drafter(), [1, 2, 3, 4], 5) == []
    assert proposal(prepared_drafter(min_ngram_size=2, max_ngram_size=3), [1, 2, 3, 1], 5) == []
