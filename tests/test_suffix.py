"""SuffixDrafter: speculation on a worked example, greedy exactness alone and in batches, lossless sampling, and the
cross-call memory (its effect, bound, eviction, clear, save and load)."""

import pytest
import torch

import hf_speculators as hs
from hf_speculators.drafters.suffix import SuffixCache, speculate
from batch_helpers import PAD, batched_generate, laid_out
from speculative_helpers import PROMPTS, plain_generate, prompt_ids, speculative_generate
from test_batch import SAMPLING_PROMPTS, chi_square_ratio, exact_two_token_distribution, sampled_counts
from test_lossless import AlwaysAcceptVerifier

BATCH_PROMPTS = ("random", "one_token", "repetitive")


def cached(*sequences, max_cached_requests=10) -> SuffixCache:
    cache = SuffixCache(max_cached_requests)
    for sequence in sequences:
        cache.add(list(sequence))
    return cache


@pytest.mark.parametrize("tree, expected", [
    (False, ([13, 14, 10], [-1, 0, 1])),  # the first of the two equally frequent continuations, followed on
    (True, ([13, 15, 14], [-1, -1, 0])),  # both continuations, then the most probable token next
])
def test_speculation_of_the_reference_example(tree, expected):
    """Arctic Inference's worked example: a cached output `10 11 12 13 14 10 11 12 15`, a context ending `10 11 12`:
    the match is 3 tokens long, each drafted token has probability 1/2, the score is 1.5."""
    draft = speculate(cached([10, 11, 12, 13, 14, 10, 11, 12, 15]).occurrences, [5, 10, 11, 12], max_tokens=3,
                      max_tree_depth=64, max_spec_factor=1.0, max_spec_offset=0.0, min_token_prob=0.1, tree=tree,
                      eos_token_ids=set())
    assert (draft.token_ids, draft.parent_ids) == expected
    assert draft.match_length == 3 and draft.score == pytest.approx(1.5)
    assert draft.probs == pytest.approx((0.5, 0.5, 0.5))
    cut = draft.truncated(2)  # best first: every kept token's parent is kept
    assert (cut.token_ids, cut.parent_ids) == (expected[0][:2], expected[1][:2]) and cut.score == pytest.approx(1.0)


def test_draft_length_follows_the_match_length_and_the_settings():
    cache = cached(list(range(20)))
    settings = dict(max_tree_depth=24, max_spec_offset=0.0, min_token_prob=0.1, tree=False, eos_token_ids=set())
    draft = speculate(cache.occurrences, [50, 3, 4], max_tokens=16, max_spec_factor=1.0, **settings)
    assert draft.match_length == 2 and draft.token_ids == [5, 6]  # floor(2 * 1.0) tokens
    draft = speculate(cache.occurrences, [50, 3, 4], max_tokens=16, max_spec_factor=2.5, **settings)
    assert draft.token_ids == [5, 6, 7, 8, 9]  # floor(2 * 2.5)
    draft = speculate(cache.occurrences, list(range(10)), max_tokens=4, max_spec_factor=1.0, **settings)
    assert draft.match_length == 10 and draft.token_ids == [10, 11, 12, 13]  # capped by max_tokens
    # a match as long as the depth allows leaves no room to draft: the same occurrence, matched shorter, drafts
    deep = speculate(cached(list(range(40))).occurrences, list(range(23)), max_tokens=8, max_spec_factor=1.0,
                     **settings)
    assert deep.token_ids == list(range(23, 31)) and deep.match_length == 16  # the longest match of budget 8
    draft = speculate(cache.occurrences, [2, 3], max_tokens=16, max_spec_factor=1.0,
                      **{**settings, "eos_token_ids": {4}})
    assert draft.token_ids == [4]  # the draft ends after an EOS token
    # a continuation seen once in three occurrences is below min_token_prob=0.4
    rare = cached([1, 2, 3], [1, 2, 3], [1, 2, 7])
    assert speculate(rare.occurrences, [1, 2], 4, 24, 1.0, 0.0, 0.4, False, set()).token_ids == [3]
    assert speculate(rare.occurrences, [1, 2], 4, 24, 1.0, 0.0, 0.4, True, set()).token_ids == [3]


@pytest.mark.parametrize("use_tree_spec", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_output_is_plain_greedy_output_and_memory_helps_a_repeat(zoo, arch, use_tree_spec):
    model = zoo.target(arch)
    drafter = hs.SuffixDrafter(num_draft_tokens=8, use_tree_spec=use_tree_spec)
    forwards = []
    for name in ("repetitive", "random", "repetitive"):
        out = speculative_generate(model, prompt_ids(name), drafter, return_dict_in_generate=True)
        assert torch.equal(out.sequences, zoo.reference(arch, name))
        forwards.append(out.speculative_stats.num_target_forwards)
    assert len(drafter.cache) == 2 + 1  # every call's output kept
    assert forwards[2] < forwards[0] / 2  # the repeat drafts what the first call generated


@pytest.mark.parametrize("use_tree_spec", [False, True], ids=["chain", "tree"])
def test_every_row_of_a_batch_is_its_plain_greedy_output(zoo, use_tree_spec):
    model, prompts = zoo.target("llama"), [PROMPTS[name] for name in BATCH_PROMPTS]
    expected = laid_out(prompts, [zoo.reference("llama", name)[0].tolist() for name in BATCH_PROMPTS])
    drafter = hs.SuffixDrafter(num_draft_tokens=5, use_tree_spec=use_tree_spec)
    for _ in range(2):  # the second call drafts from the first call's rows too
        out = batched_generate(model, drafter, prompts)
        assert torch.equal(out.sequences, expected)
    assert out.speculative_stats.num_accepted_tokens > 20


def test_sampling_is_lossless_and_the_test_catches_a_lossy_verifier(zoo):
    """Rows alternate two prompts over 40 calls of one drafter (its memory grows with the sampled outputs); each
    row's first two tokens follow its own prompt's distribution; keeping every draft token fails by far."""
    model, names = zoo.target("llama"), SAMPLING_PROMPTS * 16
    counts, accepted = sampled_counts(model, names, drafter=hs.SuffixDrafter(num_draft_tokens=3))
    assert accepted > 100
    for name in SAMPLING_PROMPTS:
        assert chi_square_ratio(counts[name], exact_two_token_distribution(model, name)) < 1, name
    counts, _ = sampled_counts(model, names, verifier=AlwaysAcceptVerifier(),
                               drafter=hs.SuffixDrafter(num_draft_tokens=3))
    assert any(chi_square_ratio(counts[name], exact_two_token_distribution(model, name)) > 5
               for name in SAMPLING_PROMPTS)


def test_memory_is_bounded_and_evicts_the_oldest_call():
    cache = cached([1, 2, 3, 4], [5, 6, 7], [8, 9, 1, 2, 7], max_cached_requests=2)
    assert cache.sequences == [[5, 6, 7], [8, 9, 1, 2, 7]]
    assert [position for _, position in cache.occurrences((1, 2))] == [4]  # [1, 2, 3, 4] left the index
    assert cache.occurrences((3,)) == []
    def positions(cache):  # n-gram -> the positions after it, per stored row in order (ids aside)
        return {ngram: list(by_row.values()) for ngram, by_row in cache._followers.items()}

    assert positions(cache) == positions(cached([5, 6, 7], [8, 9, 1, 2, 7]))  # the kept rows' index, nothing else
    assert cached([1, 2, 3], max_cached_requests=0).sequences == []  # 0: no memory


def test_memory_keeps_the_prompt_tail_and_the_output_and_can_be_cleared_saved_and_loaded(zoo, tmp_path):
    """... and a call inside `memory_kept` (the bench's warm-up) leaves it as it was."""
    model = zoo.target("llama")
    drafter = hs.SuffixDrafter(max_tree_depth=4)
    speculative_generate(model, prompt_ids("random"), drafter)
    reference = zoo.reference("llama", "random")[0].tolist()
    assert drafter.cache.sequences == [reference[len(PROMPTS["random"]) - 3 :]]  # 3 prompt tokens, then the output
    with drafter.memory_kept():
        speculative_generate(model, prompt_ids("repetitive"), drafter)
        assert len(drafter.cache) == 2
    assert drafter.cache.sequences == [reference[len(PROMPTS["random"]) - 3 :]]
    path = drafter.save_cache(tmp_path / "memory")
    other = hs.SuffixDrafter(max_cached_requests=5)
    other.load_cache(path.parent)
    assert other.cache.sequences == drafter.cache.sequences
    drafter.clear_cache()
    assert drafter.cache.sequences == [] and len(drafter.cache) == 0
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a suffix cache"):
        other.load_cache(path.parent)
    with pytest.raises(FileNotFoundError):
        other.load_cache(tmp_path / "missing")


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tree_depth": 1}, "max_tree_depth"), ({"max_cached_requests": -1}, "max_cached_requests"),
    ({"max_spec_factor": -1.0}, "max_spec_factor"), ({"min_token_prob": 1.5}, "min_token_prob"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hs.SuffixDrafter(**kwargs)
