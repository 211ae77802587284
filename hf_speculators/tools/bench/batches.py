"""The benchmark's batches: prompts grouped in order, left padded, and each generate call's rows taken apart again.

`run_benchmark(batch_size=B)` runs every method once per batch of B prompts (the last batch may be smaller). Each
row is measured on its own new tokens (up to its first EOS, padding excluded), gets its own `SpeculativeStats`
(the row's figures from `SpeculativeStats.row_stats`) and a share of the call's time, so that per-row records sum
to the batch's totals.
"""

from dataclasses import dataclass, replace

import torch

from ...metrics import SpeculativeStats


@dataclass(frozen=True)
class Batch:
    """Prompts that one generate call runs together.

    Attributes:
        indices (`list[int]`): the prompts' positions in the benchmark's prompt list.
        input_ids (`torch.LongTensor` of shape `(rows, width)`): the prompts, left padded to the longest.
        attention_mask (`torch.LongTensor` of shape `(rows, width)`, *optional*): 0 on padding; `None` for a batch
            of one prompt (called as today: no mask, no padding).
        prompt_tokens (`list[int]`): each row's own prompt length in tokens.
        truncated (`list[bool]`): whether each prompt was cut to the prompt budget.
        pad_token_id (`int`, *optional*): the padding token (`None` for a batch of one prompt).
    """

    indices: list[int]
    input_ids: torch.LongTensor
    attention_mask: torch.LongTensor | None
    prompt_tokens: list[int]
    truncated: list[bool]
    pad_token_id: int | None = None

    @property
    def num_pad_tokens(self) -> int:
        """Left padding slots in the batch's prompts."""
        return len(self.indices) * self.input_ids.shape[1] - sum(self.prompt_tokens)


def make_batches(encoded: list[tuple[torch.LongTensor, bool]], batch_size: int, pad_token_id: int | None) -> list[Batch]:
    """Groups encoded prompts in order into batches of `batch_size`, each left padded with `pad_token_id`.

    Args:
        encoded (`list[tuple[torch.LongTensor, bool]]`): each prompt's ids `(1, prompt_tokens)` and whether it was
            truncated.
        batch_size (`int`): prompts per batch (>= 1); the last batch holds the rest.
        pad_token_id (`int`, *optional*): the padding token (needed when `batch_size > 1`).
    """
    batches = []
    for start in range(0, len(encoded), batch_size):
        group = encoded[start : start + batch_size]
        lengths = [ids.shape[1] for ids, _ in group]
        indices, truncated = list(range(start, start + len(group))), [cut for _, cut in group]
        if len(group) == 1:
            batches.append(Batch(indices, group[0][0], None, lengths, truncated))
            continue
        width = max(lengths)
        input_ids = torch.stack([torch.nn.functional.pad(ids[0], (width - ids.shape[1], 0), value=pad_token_id)
                                 for ids, _ in group])
        attention_mask = (torch.arange(width) >= width - torch.tensor(lengths)[:, None]).long()
        batches.append(Batch(indices, input_ids, attention_mask.to(input_ids.device), lengths, truncated,
                             pad_token_id))
    return batches


def pad_token(tokenizer) -> int | None:
    """The batches' padding token: the tokenizer's pad token, else its EOS token (as left-padded batching does)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def row_new_ids(sequences: torch.LongTensor, width: int, eos_token_id) -> list[torch.LongTensor]:
    """Each row's new tokens: after the `width` prompt slots, up to and including its first EOS token.

    Args:
        sequences (`torch.LongTensor` of shape `(rows, width + new)`): a generate call's output.
        width (`int`): the (padded) prompt width.
        eos_token_id (`int` or `list[int]`, *optional*): the EOS token(s); `None` keeps every new slot.
    """
    eos = torch.tensor([] if eos_token_id is None else eos_token_id, dtype=torch.long).flatten()
    rows = []
    for new in sequences[:, width:].cpu():
        ends = torch.isin(new, eos).nonzero()
        rows.append(new[: int(ends[0]) + 1] if len(ends) else new)
    return rows


def row_stats(stats: SpeculativeStats | None, row: int, num_rows: int) -> SpeculativeStats | None:
    """Row `row`'s figures of a generate call's `stats`, with an even share of the call's drafting and verification
    seconds (rows are timed together) and, on row 0 only, the call's `drafter_stats` (so sums over rows give the
    call's); `stats` itself for a single sequence, `None` for methods without stats."""
    if stats is None or not stats.row_stats:
        return stats
    return replace(stats.row_stats[row], draft_time=stats.draft_time / num_rows,
                   verify_time=stats.verify_time / num_rows, drafter_stats=stats.drafter_stats if row == 0 else {})


def batch_skip_reason(generate_kwargs: dict) -> str | None:
    """Why a method's generate keywords cannot run a batch of several prompts, or `None` if they can (every drafter
    of ours batches; transformers' assisted generation does not)."""
    transformers_method = {"prompt_lookup_num_tokens", "assistant_model", "assistant_early_exit",
                           "use_mtp"} & set(generate_kwargs)
    return "transformers' assisted generation supports batch size 1 only" if transformers_method else None


def padding_overhead(records: list[dict]) -> dict[str, float] | None:
    """Padding figures of a batched run's plain baseline, from its records (`None` for batch size 1).

    Returns:
        `{"prompt_padding": share of prompt slots that are left padding, "finished_rows": share of plain batched
        decoding's row-steps spent on rows that had already finished}`.
    """
    batches: dict[int, list[dict]] = {}
    for record in (r for r in records if r["method"] == "plain" and "batch_index" in r):
        batches.setdefault(record["batch_index"], []).append(record)
    if all(len(rows) == 1 for rows in batches.values()):
        return None
    plain = [r for rows in batches.values() for r in rows]
    pads = sum(r["batch_pad_tokens"] for rows in batches.values() for r in rows[:1])
    prompt_slots = pads + sum(r["prompt_tokens"] for r in plain)
    row_steps = sum(len(rows) * max(r["new_tokens"] for r in rows) for rows in batches.values())
    new_tokens = sum(r["new_tokens"] for r in plain)
    return {"prompt_padding": pads / prompt_slots, "finished_rows": 1 - new_tokens / row_steps if row_steps else 0.0}
