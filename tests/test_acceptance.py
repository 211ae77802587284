"""The speculative stats count exactly what the test drafters' known acceptance patterns imply."""

import pytest

from drafters_for_tests import OracleDrafter
from speculative_helpers import (
    MAX_NEW_TOKENS,
    NUM_DRAFT_TOKENS,
    PROMPTS,
    check_exact,
    generated_token,
    prompt_ids,
    speculative_generate,
)
from tiny_models import ARCHS


def expected_num_steps(num_correct: int, num_draft_tokens: int, max_new_tokens: int = MAX_NEW_TOKENS) -> int:
    """Steps of a drafter whose first `num_correct` tokens are right, under the length budget (no EOS)."""
    remaining, steps = max_new_tokens, 0
    while remaining > 0:
        budget = min(num_draft_tokens, remaining - 1)
        remaining -= min(num_correct, budget) + 1
        steps += 1
    return steps


def assert_stats_match_proposals(stats, drafter) -> None:
    """What the stats say was proposed is what the drafter returned."""
    assert stats.num_drafted_tokens == sum(map(len, drafter.proposals))
    assert stats.num_drafts == sum(1 for p in drafter.proposals if p)
    assert stats.num_generated_tokens == MAX_NEW_TOKENS
    assert stats.num_target_forwards == stats.num_steps + 1  # the prefill


@pytest.mark.parametrize("num_draft_tokens", NUM_DRAFT_TOKENS)
@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_drafts_are_all_accepted(zoo, arch, num_draft_tokens):
    out, drafter = check_exact(zoo, arch, "random", "oracle", num_draft_tokens, floor=False)
    stats = out.speculative_stats
    assert_stats_match_proposals(stats, drafter)
    assert stats.num_accepted_tokens == stats.num_drafted_tokens > 0
    assert stats.acceptance_rate == 1.0
    assert stats.accepted_per_position == stats.drafted_per_position
    assert stats.num_steps == expected_num_steps(num_draft_tokens, num_draft_tokens)
    assert stats.mean_acceptance_length == 1 + stats.num_drafted_tokens / stats.num_drafts


@pytest.mark.parametrize("num_draft_tokens", NUM_DRAFT_TOKENS)
@pytest.mark.parametrize("arch", ARCHS)
def test_adversary_drafts_are_never_accepted(zoo, arch, num_draft_tokens):
    out, drafter = check_exact(zoo, arch, "random", "adversary", num_draft_tokens, floor=False)
    stats = out.speculative_stats
    assert_stats_match_proposals(stats, drafter)
    assert stats.num_drafted_tokens > 0
    assert stats.num_accepted_tokens == 0
    assert stats.acceptance_rate == 0.0
    assert stats.mean_acceptance_length == 1.0
    assert stats.num_steps == MAX_NEW_TOKENS  # one token per target forward, like plain decoding
    assert set(stats.accepted_per_position) == {0}


@pytest.mark.parametrize("num_correct", [0, 1, 3, 4, 5])
@pytest.mark.parametrize("arch", ARCHS)
def test_scripted_drafts_accept_exactly_n_per_step(zoo, arch, num_correct):
    num_draft_tokens = 5
    out, drafter = check_exact(zoo, arch, "random", "scripted", num_draft_tokens, num_correct=num_correct,
                                  floor=False)
    stats = out.speculative_stats
    assert_stats_match_proposals(stats, drafter)
    assert stats.num_accepted_tokens == sum(min(num_correct, len(p)) for p in drafter.proposals)
    for position, (drafted, accepted) in enumerate(zip(stats.drafted_per_position, stats.accepted_per_position)):
        assert accepted == (drafted if position < num_correct else 0)
    assert stats.num_steps == expected_num_steps(num_correct, num_draft_tokens)


def test_stats_count_only_accepted_tokens_that_reach_the_output(zoo):
    """The target accepts a whole draft that runs past EOS, but generation stops at the EOS: the tokens after it
    never reach the output. `num_generated_tokens` is documented as the tokens added to the sequence (accepted,
    bonus and recovered), and `mean_acceptance_length` as tokens gained per draft, so the dropped tokens must
    not count as accepted."""
    eos = generated_token(zoo, "llama", "random", 3)
    drafter = OracleDrafter(zoo.reference("llama", "random"), num_draft_tokens=8)  # drafts past the EOS
    out = speculative_generate(zoo.target("llama"), prompt_ids("random"), drafter, eos_token_id=eos,
                               return_dict_in_generate=True)
    stats = out.speculative_stats
    num_new_tokens = out.sequences.shape[1] - len(PROMPTS["random"])
    assert num_new_tokens <= 4 and len(drafter.proposals[0]) == 8  # the stop fell inside the first draft
    assert stats.num_generated_tokens == num_new_tokens
    assert stats.num_accepted_tokens <= stats.num_generated_tokens
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_noisy_draft_model_is_partly_accepted(zoo, arch):
    """The noisy draft exercises what the small random draft cannot: drafts accepted up to a middle position."""
    out, _ = check_exact(zoo, arch, "random", "noisy_draft_model", 4, floor=False)
    stats = out.speculative_stats
    assert 0 < stats.num_accepted_tokens < stats.num_drafted_tokens
    assert 0 < stats.accepted_per_position[1] < stats.drafted_per_position[1]
