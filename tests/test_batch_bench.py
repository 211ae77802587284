"""Tests of the benchmark's --batch-size: grouping and padding, per-row records, skipped methods, the CLI flag."""

import copy

import pytest
import torch

torch.set_num_threads(1)

from test_benchmark import K, NEW_TOKENS, bench, draft, target, tokenizer  # noqa: E402, F401 (fixtures)

from hf_speculators.tools import cli  # noqa: E402
from hf_speculators.tools.bench.batches import make_batches, padding_overhead, row_new_ids, row_stats  # noqa: E402
from hf_speculators.tools.bench import Prompt  # noqa: E402
from hf_speculators.metrics import SpeculativeStats  # noqa: E402

PAD = 2
PROMPTS = [  # different lengths, so that the batches need padding
    Prompt("the cat sat on a mat and the cat sat on", "writing", 1),
    Prompt("dog ran to park", "qa", 2),
    Prompt("the cat sat on a mat", "qa", 3),
    Prompt("ball then dog ran to park with ball then dog", "writing", 4),
    Prompt("mat and", "qa", 5),
]


def encoded(*lengths):
    return [(torch.arange(3, 3 + n)[None], n == 4) for n in lengths]


def test_make_batches_groups_in_order_and_pads_left():
    batches = make_batches(encoded(3, 5, 2, 4, 1), batch_size=2, pad_token_id=PAD)
    assert [b.indices for b in batches] == [[0, 1], [2, 3], [4]]
    first = batches[0]
    assert first.input_ids.tolist() == [[PAD, PAD, 3, 4, 5], [3, 4, 5, 6, 7]]
    assert first.attention_mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert (first.prompt_tokens, first.num_pad_tokens, first.pad_token_id) == ([3, 5], 2, PAD)
    assert batches[1].truncated == [False, True]
    last = batches[2]  # a batch of one prompt runs as batch size 1 does: no mask, no padding
    assert last.attention_mask is None and last.input_ids.tolist() == [[3]] and last.num_pad_tokens == 0


def test_batch_size_one_keeps_every_prompt_alone():
    batches = make_batches(encoded(3, 5), batch_size=1, pad_token_id=None)
    assert [(b.indices, b.attention_mask) for b in batches] == [([0], None), ([1], None)]


def test_row_new_ids_stop_after_the_first_eos():
    sequences = torch.tensor([[9, 9, 5, 2, 2, 2], [9, 9, 5, 6, 7, 8], [PAD, 9, 2, 5, 2, 2]])
    rows = row_new_ids(sequences, width=2, eos_token_id=[2, 7])
    assert [row.tolist() for row in rows] == [[5, 2], [5, 6, 7], [2]]
    assert [row.tolist() for row in row_new_ids(sequences[:1], 2, None)] == [[5, 2, 2, 2]]


def test_row_stats_take_the_rows_figures_and_a_share_of_the_time():
    rows = [SpeculativeStats(num_drafts=1, num_accepted_tokens=1), SpeculativeStats(num_drafts=2)]
    total = SpeculativeStats(draft_time=0.4, verify_time=2.0, row_stats=rows)
    second = row_stats(total, 1, 2)
    assert (second.num_drafts, second.num_accepted_tokens, second.draft_time, second.verify_time) == (2, 0, 0.2, 1.0)
    single = SpeculativeStats(num_drafts=3, draft_time=0.1)
    assert row_stats(single, 0, 1) is single and row_stats(None, 0, 1) is None


@pytest.fixture(scope="module")
def batched(target, draft, tokenizer):
    return bench(target, draft, tokenizer, prompts=PROMPTS, methods=["prompt-lookup", "prompt-lookup-tree",
                                                                     "hf-prompt-lookup"], batch_size=2, verbose=False)


def test_batched_records_one_per_prompt_and_method(batched):
    methods = ["plain", "prompt-lookup", "prompt-lookup-tree"]  # token trees batch too
    # written as measured: batch by batch, method by method, row by row
    rows = [[0, 1], [2, 3], [4]]
    assert [(r["prompt_index"], r["method"]) for r in batched.records] == [
        (i, m) for batch in rows for m in methods for i in batch]
    plain = [r for r in batched.records if r["method"] == "plain"]
    assert [r["batch_index"] for r in plain] == [0, 0, 1, 1, 2]
    assert [r["batch_rows"] for r in plain] == [2, 2, 2, 2, 1]
    for r in batched.records:
        prompt = PROMPTS[r["prompt_index"]]
        assert (r["question_id"], r["category"]) == (prompt.question_id, prompt.category)
        assert r["prompt_tokens"] == len(prompt.text.split())  # the row's own tokens, not the padded width
        assert 1 <= r["new_tokens"] <= NEW_TOKENS
        assert r["seconds"] == pytest.approx(r["batch_seconds"] / r["batch_rows"])
        assert r["provenance"]["run"]["settings"]["batch_size"] == 2
    pads = [r["batch_pad_tokens"] for r in batched.records[::6]]
    assert pads == [11 - 4, 10 - 6, 0]


def test_batched_rows_match_plain_batched_and_report_their_own_stats(batched):
    assert batched.ok and all(r["identical_to_plain"] for r in batched.records)
    lookups = [r for r in batched.records if r["method"] == "prompt-lookup"]
    assert all(r["mean_acceptance_length"] >= 1.0 and r["num_drafts"] is not None for r in lookups)
    assert all(r["draft_lengths"] and max(len(r["drafted_per_position"]), 1) <= K for r in lookups)
    summary = batched.summary["all"]
    plain = [r for r in batched.records if r["method"] == "plain"]
    batch_seconds = {r["batch_index"]: r["batch_seconds"] for r in plain}
    assert summary["plain"]["tokens_per_s"] == pytest.approx(
        sum(r["new_tokens"] for r in plain) / sum(batch_seconds.values()))  # total tokens over total batch time


def test_methods_that_cannot_batch_are_skipped_with_the_reason(batched, capsys):
    assert set(batched.skipped) == {"hf-prompt-lookup"}  # every drafter of ours batches, trees included
    assert "batch size 1 only" in batched.skipped["hf-prompt-lookup"]
    assert batched.records[0]["provenance"]["run"]["skipped_methods"] == batched.skipped
    table = batched.table()
    assert "skipped hf-prompt-lookup: transformers' assisted generation supports batch size 1 only" in table
    assert "padding (plain batched)" in table


def test_padding_overhead_counts_left_padding_and_finished_rows():
    def record(batch, tokens, prompt, pads):
        return {"method": "plain", "batch_index": batch, "new_tokens": tokens, "prompt_tokens": prompt,
                "batch_pad_tokens": pads}

    records = [record(0, 8, 3, 2), record(0, 4, 5, 2), record(1, 6, 4, 0)]
    assert padding_overhead(records) == {"prompt_padding": 2 / 14, "finished_rows": 1 - 18 / 22}
    assert padding_overhead([{"method": "plain", "new_tokens": 1}]) is None


def test_batch_size_one_records_are_batches_of_one_row(target, tokenizer):
    result = bench(target, None, tokenizer, prompts=PROMPTS[:2], methods=["prompt-lookup"], verbose=False)
    assert all(r["batch_rows"] == 1 and r["batch_pad_tokens"] == 0 for r in result.records)
    assert [r["batch_index"] for r in result.records] == [0, 0, 1, 1]
    assert result.skipped == {} and result.records[0]["provenance"]["run"]["settings"]["batch_size"] == 1


@pytest.mark.parametrize("batch_size", [0, True, 1.5])
def test_bad_batch_size_raises(target, tokenizer, batch_size):
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        bench(target, None, tokenizer, methods=["prompt-lookup"], batch_size=batch_size, verbose=False)


def test_batches_need_a_pad_or_eos_token(target, tokenizer):
    bare = copy.deepcopy(tokenizer)
    bare.eos_token = None
    with pytest.raises(ValueError, match="give the tokenizer a pad_token or an eos_token"):
        bench(target, None, bare, methods=["prompt-lookup"], batch_size=2, verbose=False)


def test_cli_batch_size_flag():
    parser = cli.build_parser()
    assert parser.parse_args(["bench", "--prompts", "p.jsonl"]).batch_size == 1
    assert parser.parse_args(["bench", "--prompts", "p.jsonl", "--batch-size", "4"]).batch_size == 4
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--prompts", "p.jsonl", "--batch-size", "four"])
