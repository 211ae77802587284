"""LookaheadDrafter: every window and n-gram token gets the logits of its own virtual sequence; the pool's rules;
greedy exactness alone and in batches; lossless sampling."""

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

import hf_speculators as hs
from hf_speculators.cache import RaggedCache
from hf_speculators.drafters.base import StepFeedback
from hf_speculators.query import Query, forward
from batch_helpers import PAD, batched_generate, laid_out
from speculative_helpers import PROMPTS, prompt_ids, speculative_generate
from test_batch import SAMPLING_PROMPTS, chi_square_ratio, exact_two_token_distribution, sampled_counts
from test_lossless import AlwaysAcceptVerifier
from tiny_models import ARCHS

BATCH_PROMPTS = ("random", "one_token", "repetitive")


def started(drafter, model=None):
    return drafter.new_state(model, GenerationConfig())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("settings", [(3, 4, 3), (2, 2, 1)], ids=["W3-N4-G3", "W2-N2-G1"])
def test_every_token_gets_the_logits_of_its_virtual_sequence(zoo, arch, settings):
    """A full window and a tree of pool n-grams in one forward: each n-gram node's logits are those of a plain
    forward over the committed text and its path; window token (j, i)'s over the committed text, level 0's columns
    0..i and column i of levels 1..j."""
    window_size, ngram_size, verification_set_size = settings
    model, drafter = zoo.target(arch), hs.LookaheadDrafter(*settings)
    committed = list(PROMPTS["random"])
    state = started(drafter, model)
    row = drafter._row(state, torch.tensor(committed), 0)
    row.levels = [[(11 * j + 7 * i) % 90 for i in range(window_size)] for j in range(ngram_size - 1)]
    for ngram in ([1, 2, 3, 4], [1, 2, 5, 6], [1, 9, 9, 9]):  # shared prefixes: a tree
        drafter._add(row, (committed[-1], *ngram[: ngram_size - 1]))
    draft = drafter.propose(state, [torch.tensor([committed])], [ngram_size - 1], [0])[0]
    assert draft.num_extra == window_size * (ngram_size - 1) and draft.num_nodes >= 1
    cache = RaggedCache(DynamicCache(config=model.config), torch.zeros(1, 0, dtype=torch.bool))
    forward(model, cache, Query.chain(torch.tensor([committed[:-1]]), torch.ones(1, len(committed) - 1, dtype=bool)))
    cache.append(torch.ones(1, len(committed) - 1, dtype=torch.bool))
    logits = forward(model, cache, Query.from_drafts(torch.tensor([committed[-1]]), [draft], PAD))[0]
    virtual = [[]] + [[*(draft.token_ids[n].item() for n in draft.tree.path(node))] for node in range(draft.num_nodes)]
    for j, level in enumerate(row.levels):
        for i in range(window_size):
            virtual.append(row.levels[0][: i + 1] + [row.levels[level_][i] for level_ in range(1, j + 1)])
    for slot, tokens in enumerate(virtual):
        expected = model(torch.tensor([committed + tokens])).logits[0, -1]
        torch.testing.assert_close(logits[slot], expected, rtol=1e-4, atol=1e-4, msg=f"slot {slot}: {tokens}")


def test_pool_is_keyed_by_first_token_bounded_deduplicated_and_seeded_from_the_text():
    drafter = hs.LookaheadDrafter(window_size=2, ngram_size=3, verification_set_size=2)
    state = started(drafter)
    row = drafter._row(state, torch.tensor([5, 6, 7, 5, 6, 8, 5, 6, 7]), 0)  # the text's 3-grams
    assert row.pool == {5: [(6, 7), (6, 8)], 6: [(7, 5), (8, 5)], 7: [(5, 6)], 8: [(5, 6)]}  # (5, 6, 7) once
    drafter._add(row, (5, 9, 9))
    assert row.pool[5] == [(6, 8), (9, 9)]  # the oldest evicted beyond G = 2
    drafter._add(row, (5, 9, 9))
    assert row.pool[5] == [(6, 8), (9, 9)]  # a known n-gram is not added again
    draft = drafter.propose(state, [torch.tensor([[5, 6, 7, 5, 6, 8, 5, 6, 7, 5]])], [1], [0])[0]
    assert draft.token_ids.tolist() == [9, 6] and draft.tree.depth == 1  # newest first, cut to the budget


def test_the_window_makes_levels_then_ngrams():
    drafter = hs.LookaheadDrafter(window_size=2, ngram_size=3, verification_set_size=4)
    state = started(drafter)
    drafter.propose(state, [torch.tensor([[1, 2, 3]])], [2], [0])
    row = state.rows[0]
    assert row.levels == [[2, 3]]  # the last W prompt tokens

    def feed(next_level):  # window logits whose last level's argmax is `next_level`
        logits = torch.zeros(len(row.levels) * 2, 50)
        logits[-2:, :].scatter_(1, torch.tensor(next_level)[:, None], 1.0)
        drafter.observe(state, StepFeedback(rows=[0], positions=[2], extra_logits=[logits]))

    feed([10, 11])
    assert row.levels == [[2, 3], [10, 11]] and 2 not in row.pool  # warming up: no n-gram yet
    feed([20, 21])
    assert row.levels == [[10, 11], [20, 21]]
    assert (10, 20) in row.pool[2] and (11, 21) in row.pool[3]  # each column's n-gram, keyed by its first token


@pytest.mark.parametrize("settings", [(4, 3, 4), (2, 2, 1), (5, 4, 3)])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_plain_greedy_output(zoo, arch, settings):
    accepted = 0
    for name in ("repetitive", "random"):
        out = speculative_generate(zoo.target(arch), prompt_ids(name), hs.LookaheadDrafter(*settings),
                                   return_dict_in_generate=True)
        assert torch.equal(out.sequences, zoo.reference(arch, name))
        accepted += out.speculative_stats.num_accepted_tokens
    assert accepted > 0


def test_every_row_of_a_batch_is_its_plain_greedy_output(zoo):
    model, prompts = zoo.target("llama"), [PROMPTS[name] for name in BATCH_PROMPTS]
    out = batched_generate(model, hs.LookaheadDrafter(), prompts, plain_floor=False)
    assert torch.equal(out.sequences, laid_out(prompts, [zoo.reference("llama", n)[0].tolist() for n in BATCH_PROMPTS]))
    assert out.speculative_stats.num_accepted_tokens > 5


class SeededLookahead(hs.LookaheadDrafter):
    """Lookahead whose pool starts with given n-grams too (the likely ones: in two sampled tokens the window has no
    time to find any)."""

    def __init__(self, seeds: list[tuple[int, ...]]):
        super().__init__(window_size=2, ngram_size=3, verification_set_size=4)
        self.seeds = seeds

    def _row(self, state, tokens, row):
        seeded = row in state.rows
        lookahead = super()._row(state, tokens, row)
        for ngram in [] if seeded else self.seeds:
            self._add(lookahead, ngram)
        return lookahead


def test_sampling_is_lossless_and_the_test_catches_a_lossy_verifier(zoo):
    """Rows alternate two prompts; the pool holds the four likeliest two-token continuations of each prompt (a tree
    whose paths are accepted, partly accepted or rejected); the first two sampled tokens follow the target's
    distribution, and keeping every draft token fails by far."""
    model, names = zoo.target("llama"), SAMPLING_PROMPTS * 16
    exact = {name: exact_two_token_distribution(model, name) for name in SAMPLING_PROMPTS}
    seeds = [(PROMPTS[name][-1], *divmod(pair, exact[name].shape[1]))
             for name in SAMPLING_PROMPTS for pair in exact[name].flatten().topk(4).indices.tolist()]
    counts, accepted = sampled_counts(model, names, drafter=SeededLookahead(seeds))
    assert accepted > 100
    for name in SAMPLING_PROMPTS:
        assert chi_square_ratio(counts[name], exact[name]) < 1, name
    counts, _ = sampled_counts(model, names, verifier=AlwaysAcceptVerifier(), drafter=SeededLookahead(seeds))
    assert all(chi_square_ratio(counts[name], exact[name]) > 5 for name in SAMPLING_PROMPTS)


@pytest.mark.parametrize("kwargs, message", [
    ({"window_size": 0}, "window_size"), ({"ngram_size": 1}, "ngram_size"),
    ({"verification_set_size": 0}, "verification_set_size"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hs.LookaheadDrafter(**kwargs)
