"""Per-position logits processing, target/draft probabilities and the residual distribution."""

import math
from collections.abc import Iterable

import torch
from transformers import (LogitsProcessorList, MinPLogitsWarper, PrefixConstrainedLogitsProcessor,
                          RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

# processors that transformers builds with state per batch row (repetition_penalty's per-row padding lengths,
# prefix_allowed_tokens_fn's batch_id): a row of a batch must reach them at its own place in the batch
PER_ROW_PROCESSORS = (RepetitionPenaltyLogitsProcessor, PrefixConstrainedLogitsProcessor)
# warpers that read neither the sequence nor other rows: a list of only these processes many rows in one call, with
# the same result as row by row (sampling at a temperature, top-k, top-p: what most sampling calls use)
ROW_INDEPENDENT_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


class RowOfBatch:
    """A generate call's logits processors applied to one row of its batch, called as a `LogitsProcessorList` is.

    The speculative loop processes each row on its own (`process_logits`), but transformers builds some processors
    for the whole batch (`PER_ROW_PROCESSORS`): those get the row as row `row` of `batch_size` copies of it, and
    keep that row's result; every other processor gets the row alone.

    Args:
        processors (`LogitsProcessorList`): the call's processors and warpers.
        batch_size (`int`): the call's batch size.
        row (`int`): the row's index in the batch.
    """

    def __init__(self, processors: LogitsProcessorList, batch_size: int, row: int):
        self.processors, self.batch_size, self.row = processors, batch_size, row

    def __bool__(self) -> bool:
        return bool(self.processors)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """Processes `scores` `(1, vocab_size)` of the row whose tokens are `input_ids` `(1, sequence_length)`."""
        for processor in self.processors:
            if isinstance(processor, PER_ROW_PROCESSORS):
                batch = processor(input_ids.expand(self.batch_size, -1), scores.expand(self.batch_size, -1).clone())
                scores = batch[self.row : self.row + 1]
            else:
                scores = processor(input_ids, scores)
        return scores


def _listed(logits_processor) -> LogitsProcessorList:
    """The processors of `logits_processor`, a `LogitsProcessorList` or a `RowOfBatch` of one."""
    return logits_processor.processors if isinstance(logits_processor, RowOfBatch) else logits_processor


def rows_independent(logits_processor) -> bool:
    """Whether every processor of `logits_processor` (a `LogitsProcessorList` or a `RowOfBatch` of one) is one of
    `ROW_INDEPENDENT_PROCESSORS`, so that many rows can be processed in one call."""
    return all(type(processor) in ROW_INDEPENDENT_PROCESSORS for processor in _listed(logits_processor))


def row_processors(processors: LogitsProcessorList, batch_size: int, row: int):
    """The call's processors for row `row` of a batch of `batch_size` (`RowOfBatch`), or `processors` themselves for
    a batch of one."""
    return processors if batch_size == 1 else RowOfBatch(processors, batch_size, row)


def process_logits(
    logits_processor: LogitsProcessorList | None, prefixes: Iterable[torch.LongTensor], logits: torch.FloatTensor
) -> torch.FloatTensor:
    """Applies the logits processors to every row of `logits`, each with its own prefix, as plain `generate` would.

    Row i is processed with `prefixes[i]`, the sequence whose next token it predicts (the committed tokens, then
    the draft tokens on the path to that position), so processors that read the sequence (repetition penalty,
    no-repeat n-gram, min_new_tokens) see what they would see in plain decoding. Logits are cast to float32
    first, as transformers does. `prefixes` is only read when there are processors (it may be a lazy generator).

    Args:
        logits_processor (`LogitsProcessorList`, *optional*): processors and warpers of the generate call.
        prefixes (`Iterable[torch.LongTensor]`): one `(1, prefix_length)` tensor per row of `logits`.
        logits (`torch.FloatTensor` of shape `(num_rows, vocab_size)`): raw logits.

    Returns:
        `torch.FloatTensor` of shape `(num_rows, vocab_size)`: the processed scores, in float32.
    """
    scores = logits.float()
    if not logits_processor:
        return scores
    if rows_independent(logits_processor):  # the prefix is not read: the first stands for all
        return _apply(logits_processor, next(iter(prefixes), None), scores.clone())
    return torch.cat([_apply(logits_processor, prefix, scores[i : i + 1].clone()) for i, prefix in enumerate(prefixes)])


def _apply(logits_processor, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
    """`logits_processor(input_ids, scores)`, a `LogitsProcessorList`'s processors called one after another as the
    list calls them when `generate` passes no keywords, without the list's `inspect.signature` of each per call (30 us
    of a 75 us call on a CPU)."""
    if isinstance(logits_processor, RowOfBatch):
        return logits_processor(input_ids, scores)
    for processor in logits_processor:
        scores = processor(input_ids, scores)
    return scores


def probabilities(scores: torch.FloatTensor, do_sample: bool) -> torch.FloatTensor:
    """The next-token distribution `(..., vocab_size)` of processed scores: softmax when sampling, else one-hot argmax.

    Greedy decoding is sampling from the one-hot distribution of the argmax, so a lossless verifier given these
    probabilities reproduces greedy output exactly.
    """
    if do_sample:
        return torch.softmax(scores, dim=-1)
    return torch.zeros_like(scores).scatter_(-1, scores.argmax(-1, keepdim=True), 1.0)


def residual_distribution(target_probs: torch.FloatTensor, draft_probs: torch.FloatTensor) -> torch.FloatTensor:
    """`norm(max(0, p - q))`, the distribution of the recovered token after a rejection (Leviathan et al. 2023).

    Args:
        target_probs (`torch.FloatTensor` of shape `(vocab_size,)`): p, the target's distribution.
        draft_probs (`torch.FloatTensor` of shape `(vocab_size,)`): q, the distribution the draft token came from.

    Returns:
        `torch.FloatTensor` of shape `(vocab_size,)`. Where p <= q everywhere (a rejection then has probability
        0 and only rounding got here), p itself.
    """
    residual = (target_probs - draft_probs).clamp_min(0)
    total = residual.sum()
    return residual / total if total > 0 else target_probs


def sample(probs: torch.FloatTensor, generator: torch.Generator | None) -> torch.LongTensor:
    """Draws one token from `probs` with the given generator, by inverting the cumulative distribution.

    On a CPU: one uniform u from `generator`; the token is the first whose cumulative probability (in float64)
    exceeds u times the total (kept below the total), so a token of probability 0 is never drawn. That costs a tenth
    to a fifth of `torch.multinomial` there (about 40 against 230 to 500 microseconds for 4,096 tokens), which a
    speculative step would call once per sampled draft token and once for its next token. On other devices, where
    a kernel launch costs either way (and MPS has no float64), `torch.multinomial`.

    Args:
        probs (`torch.FloatTensor` of shape `(vocab_size,)`): a distribution (non-negative, any positive total).
        generator (`torch.Generator`, *optional*): the source of the uniform, on `probs`' device.

    Returns:
        `torch.LongTensor` of shape `()`: the token.

    Raises:
        `ValueError`: on a CPU, `probs` whose total is not a positive finite number (NaN or infinite scores, e.g.
            after an overflow in half precision).
    """
    if probs.device.type != "cpu":
        return torch.multinomial(probs, 1, generator=generator)[0]
    cumulative = probs.double().cumsum(0)  # [vocab]
    total = float(cumulative[-1])
    if not 0 < total < math.inf:
        raise ValueError(f"Cannot sample from a distribution whose total is {total}: the scores hold NaN or infinite "
                         "values (an overflow in half precision?); use float32 or bfloat16.")
    uniform = torch.rand((1,), generator=generator, dtype=torch.float64, device=probs.device)
    threshold = (uniform * total).clamp_max(math.nextafter(total, 0.0))  # below the total, whatever the rounding
    return torch.searchsorted(cumulative, threshold, right=True)[0]


def one_hot_probs(token_ids: torch.LongTensor, vocab_size: int) -> torch.FloatTensor:
    """The distribution `(num_nodes, vocab_size)` of a deterministic drafter: all mass on each draft token."""
    probs = torch.zeros(len(token_ids), vocab_size, device=token_ids.device)
    return probs.scatter_(-1, token_ids[:, None], 1.0)
