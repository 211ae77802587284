"""SpeculativeStats: recording steps and the derived acceptance figures."""

import json

import pytest

from hf_speculators import SpeculativeStats

# (num_draft_tokens, num_accepted, num_generated) per step
STEPS = [(4, 4, 5), (4, 1, 2), (0, 0, 1), (2, 0, 1), (5, 3, 4)]


def recorded(steps=STEPS) -> SpeculativeStats:
    stats = SpeculativeStats()
    for step in steps:
        stats.record(*step)
    return stats


def test_record_accumulates_counts():
    stats = recorded()
    assert stats.num_steps == stats.num_target_forwards == 5
    assert stats.num_drafts == 4  # the empty draft is a step but not a draft
    assert stats.num_drafted_tokens == 15
    assert stats.num_accepted_tokens == 8
    assert stats.num_generated_tokens == 13


def test_per_position_counts():
    stats = recorded()
    assert stats.drafted_per_position == [4, 4, 3, 3, 1]
    assert stats.accepted_per_position == [3, 2, 2, 1, 0]
    assert stats.acceptance_rate_per_position == [3 / 4, 2 / 4, 2 / 3, 1 / 3, 0.0]


def test_acceptance_rate_and_mean_acceptance_length():
    stats = recorded()
    assert stats.acceptance_rate == pytest.approx(8 / 15)
    assert stats.mean_acceptance_length == pytest.approx(1 + 8 / 4)  # bonus included, per non-empty draft


def test_vllm_metrics_use_vllms_names_and_divide_by_every_draft():
    """vLLM's per-position rate is accepted at i over all drafts (4 here), ours over the drafts reaching i."""
    metrics = recorded().vllm_metrics()
    assert metrics["num_drafts"] == 4 and metrics["num_draft_tokens"] == 15 and metrics["num_accepted_tokens"] == 8
    assert metrics["num_accepted_tokens_per_pos"] == [3, 2, 2, 1, 0]
    assert metrics["acceptance_rate_per_position"] == [3 / 4, 2 / 4, 2 / 4, 1 / 4, 0.0]
    assert metrics["mean_acceptance_length"] == pytest.approx(3.0)
    assert SpeculativeStats().vllm_metrics()["acceptance_rate_per_position"] == []


def test_nothing_drafted():
    stats = recorded([(0, 0, 1), (0, 0, 1)])
    assert stats.acceptance_rate == 0.0
    assert stats.mean_acceptance_length == 1.0
    assert stats.acceptance_rate_per_position == []
    assert SpeculativeStats().mean_acceptance_length == 1.0


def test_record_does_not_count_the_prefill():
    """The loop counts the prefill forward itself: record() adds exactly one forward per step."""
    stats = SpeculativeStats(num_target_forwards=1)
    stats.record(3, 3, 4)
    assert stats.num_target_forwards == 2 and stats.num_steps == 1


def test_to_dict_is_json_with_derived_figures():
    stats = recorded()
    stats.verifier, stats.drafter, stats.lossless = "exact", "PromptLookupDrafter(...)", True
    data = json.loads(json.dumps(stats.to_dict()))
    assert data["acceptance_rate"] == pytest.approx(8 / 15)
    assert data["mean_acceptance_length"] == pytest.approx(3.0)
    assert data["acceptance_rate_per_position"] == pytest.approx([0.75, 0.5, 2 / 3, 1 / 3, 0.0])
    assert data["drafted_per_position"] == [4, 4, 3, 3, 1]
    assert data["verifier"] == "exact" and data["lossless"] is True


def test_default_instances_share_no_lists():
    first, second = SpeculativeStats(), SpeculativeStats()
    first.record(2, 1, 2)
    assert second.drafted_per_position == [] and second.num_steps == 0
