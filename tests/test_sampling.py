"""Logits processing of several rows at once: the same scores as row by row, only where no processor reads the
sequence."""

import pytest
import torch
from transformers import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from hf_speculators.sampling import RowOfBatch, process_logits, rows_independent

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
