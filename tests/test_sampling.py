"""Sampling one token by inverting the cumulative distribution (chi-square against the distribution, with broken
controls), and logits processing of several rows at once (the same scores as row by row, only where no processor
reads the sequence)."""

import pytest
import torch
from transformers import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from hf_speculators.sampling import RowOfBatch, process_logits, rows_independent, sample
from test_lossless import chi_square, chi_square_critical

PROBS = torch.tensor([0.0, 0.1, 0.0, 0.25, 0.05, 0.6, 0.0])  # zeros inside and at both ends
NUM_DRAWS = 20_000
BROKEN_SAMPLERS = {
    "biased": lambda probs, generator: sample(probs**0.8, generator),  # a little flatter than the distribution
    "off_by_one": lambda probs, generator: (sample(probs, generator) + 1) % len(probs),
}


def statistic(sampler, probs: torch.Tensor = PROBS) -> float:
    """Pearson's statistic of `NUM_DRAWS` seeded draws over its 0.1% critical value (pass below 1; infinite when a
    token of probability 0 is drawn)."""
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.stack([sampler(probs, generator) for _ in range(NUM_DRAWS)]), minlength=len(probs))
    return chi_square(counts, probs / probs.sum()) / chi_square_critical(int((probs > 0).sum()) - 1)


@pytest.mark.parametrize("scale", [1.0, 3.0], ids=["normalized", "unnormalized"])
def test_sample_draws_from_the_distribution(scale):
    assert statistic(sample, PROBS * scale) < 1


@pytest.mark.parametrize("broken", BROKEN_SAMPLERS)
def test_the_statistic_rejects_a_broken_sampler(broken):
    assert statistic(BROKEN_SAMPLERS[broken]) > 5


def test_sample_never_draws_past_the_last_token_of_positive_probability():
    generator = torch.Generator().manual_seed(0)
    one_token = torch.tensor([0.0, 0.0, 1.0, 0.0])
    assert {int(sample(one_token, generator)) for _ in range(200)} == {2}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_sample_refuses_scores_that_overflowed(bad):
    with pytest.raises(ValueError, match="NaN or infinite"):
        sample(torch.tensor([0.5, bad]), None)

WARPERS = {
    "temperature": [TemperatureLogitsWarper(0.7)],
    "temperature_top_k_top_p": [TemperatureLogitsWarper(0.7), TopKLogitsWarper(5), TopPLogitsWarper(0.9)],
    "min_p": [TemperatureLogitsWarper(1.3), MinPLogitsWarper(0.05)],
}


def row_by_row(processors, prefixes, logits):
    return torch.cat([processors(prefix, logits[i : i + 1].float().clone()) for i, prefix in enumerate(prefixes)])


def logits_with_ties(num_rows: int = 5, vocab_size: int = 64) -> torch.Tensor:
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(0))
    logits[:, 10:14] = logits[:, 9:10]  # ties where top-k and top-p cut
    return logits


@pytest.mark.parametrize("batch_row", [None, 1], ids=["batch_of_one", "row_of_a_batch"])
@pytest.mark.parametrize("warpers", WARPERS)
def test_row_independent_warpers_give_the_row_by_row_scores(warpers, batch_row):
    processors = LogitsProcessorList(WARPERS[warpers])
    if batch_row is not None:
        processors = RowOfBatch(processors, batch_size=3, row=batch_row)
    logits = logits_with_ties()
    prefixes = [torch.arange(n + 1)[None] for n in range(len(logits))]
    assert rows_independent(processors)
    assert torch.equal(process_logits(processors, prefixes, logits), row_by_row(processors, prefixes, logits))


def test_a_processor_that_reads_the_sequence_keeps_each_row_on_its_own_prefix():
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), RepetitionPenaltyLogitsProcessor(2.0)])
    logits = logits_with_ties(num_rows=2)
    prefixes = [torch.tensor([[3]]), torch.tensor([[7]])]  # each row penalizes its own token
    scores = process_logits(processors, prefixes, logits)
    assert not rows_independent(processors)
    assert torch.equal(scores, row_by_row(processors, prefixes, logits))
    assert scores[0, 3] != logits[0, 3] / 0.7 and scores[1, 3] == logits[1, 3] / 0.7
