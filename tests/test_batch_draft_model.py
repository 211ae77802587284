"""DraftModelDrafter on a batch: rows exact against their own plain greedy output, ragged stopping, the draft cache's
rows, seeded losslessness of batched rejection sampling, and the drafters that refuse batches."""

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList
from transformers import TemperatureLogitsWarper, TopKLogitsWarper

import hf_speculators as hs
from batch_helpers import PAD, batched_generate, laid_out, left_padded, two_token_joint
from speculative_helpers import PROMPTS, generated_token, make_drafter
from test_lossless import chi_square, chi_square_critical
from tiny_models import ARCHS, build_model

BATCH = ("random", "repetitive", "one_token")  # prompts of 8, 9 and 1 tokens


def batch_generate(model, drafter, names=BATCH, **kwargs):
    return batched_generate(model, drafter, [PROMPTS[name] for name in names], **kwargs)


def assert_rows_match_references(zoo, arch, output, names=BATCH, **reference_kwargs):
    """Row i is its own plain greedy output, then PAD to the batch's width."""
    own = [zoo.reference(arch, name, **reference_kwargs)[0].tolist() for name in names]
    assert torch.equal(output.sequences, laid_out([PROMPTS[name] for name in names], own))


@pytest.mark.parametrize("num_draft_tokens", [1, 3, 5])
@pytest.mark.parametrize("kind", ["draft_model", "noisy_draft_model"])
@pytest.mark.parametrize("arch", ARCHS)
def test_rows_equal_their_own_greedy_output(zoo, arch, kind, num_draft_tokens):
    output = batch_generate(zoo.target(arch), make_drafter(kind, num_draft_tokens, zoo, arch))
    assert_rows_match_references(zoo, arch, output)
    if kind == "noisy_draft_model":  # partly accepted: both verification outcomes ran
        stats = output.speculative_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_rows_stop_at_different_steps_and_leave_the_draft_cache(zoo):
    """An EOS that the first row generates early: that row stops, the others run to max_new_tokens; from the next
    call on, the draft cache has no row for it."""
    arch = "llama"
    eos = generated_token(zoo, arch, "random", 3)
    assert all(eos not in zoo.reference(arch, name)[0, len(PROMPTS[name]):].tolist() for name in BATCH[1:])
    drafter = hs.DraftModelDrafter(zoo.noisy_draft(arch), num_draft_tokens=3)
    cache_rows = []
    propose_batch = drafter.propose_batch

    def recording(input_ids, max_tokens, rows):
        drafts = propose_batch(input_ids, max_tokens, rows)
        cache_rows.append((list(rows), drafter._batch_cache.batch_size, len(drafter._batch_cached_ids)))
        return drafts

    drafter.propose_batch = recording
    output = batch_generate(zoo.target(arch), drafter, eos_token_id=eos)
    assert_rows_match_references(zoo, arch, output, eos_token_id=eos)
    assert cache_rows[0][0] == [0, 1, 2] and [1, 2] in [rows for rows, _, _ in cache_rows]
    assert all(batch_size == num_ids == len(rows) for rows, batch_size, num_ids in cache_rows)


def test_draft_scores_see_each_rows_own_tokens(zoo):
    """With no_repeat_ngram_size each row's draft scores are processed with that row's own tokens: the target as its
    own draft model then has every draft token accepted, and the rows stay exact."""
    arch, names = "qwen2", ("random", "repetitive")
    output = batch_generate(zoo.target(arch), hs.DraftModelDrafter(zoo.target(arch), 3), names, no_repeat_ngram_size=2)
    assert_rows_match_references(zoo, arch, output, names, no_repeat_ngram_size=2)
    assert output.speculative_stats.acceptance_rate == 1.0


def test_quantized_self_draft(zoo):
    """An int8 (torchao) copy of the target drafts for a batch; rows stay exact."""
    pytest.importorskip("torchao")
    arch = "llama"
    drafter = hs.DraftModelDrafter.from_target(zoo.target(arch), "int8", num_draft_tokens=3)
    output = batch_generate(zoo.target(arch), drafter)
    assert_rows_match_references(zoo, arch, output)
    assert output.speculative_stats.acceptance_rate > 0.5  # a near copy of the target: most drafts accepted


def test_batched_rejection_sampling_keeps_each_rows_distribution(zoo):
    """First two tokens of each row of a batch of prompts of different lengths (each prompt in three rows), sampled
    with top-k and temperature through the batched draft model: distributed as plain sampling of that prompt alone.

    Calls `hs.generate` directly with the processors transformers would build, to keep 300 runs fast."""
    model, prompts = zoo.target("llama"), ("random", "one_token")
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(3)])
    joints = [two_token_joint(model, torch.tensor([PROMPTS[name]]), warpers) for name in prompts]
    input_ids, attention_mask = left_padded([PROMPTS[name] for name in prompts * 3])
    width = input_ids.shape[1]
    config = GenerationConfig(do_sample=True, max_length=width + 2, top_k=3, temperature=0.8, num_beams=1,
                              num_return_sequences=1, output_scores=False, output_logits=False,
                              return_dict_in_generate=True, pad_token_id=PAD)
    stopping = StoppingCriteriaList([MaxLengthCriteria(width + 2)])
    generator = torch.Generator().manual_seed(0)
    counts = [torch.zeros_like(joint) for joint in joints]
    num_accepted = num_draft_tokens = 0
    for _ in range(300):
        drafter = hs.DraftModelDrafter(zoo.noisy_draft("llama"), num_draft_tokens=2)
        out = hs.generate(model, input_ids, logits_processor=warpers, stopping_criteria=stopping,
                          generation_config=config, candidate_generator=drafter, generator=generator,
                          attention_mask=attention_mask)
        for i, row in enumerate(out.sequences[:, width:].tolist()):
            counts[i % len(prompts)][row[0], row[1]] += 1
        num_accepted += out.speculative_stats.num_accepted_tokens
        num_draft_tokens += out.speculative_stats.num_draft_tokens
    assert 0 < num_accepted < num_draft_tokens  # accepted draft tokens and recovered tokens both occur
    for row_counts, joint in zip(counts, joints):
        statistic = chi_square(row_counts, joint) / chi_square_critical(int((joint > 0).sum()) - 1)
        assert statistic < 1, statistic


def test_tree_drafter_refuses_a_batch(zoo):
    drafter = hs.TreeDrafter(zoo.draft("llama"), tree={"depth": 3, "top_k": 2, "num_nodes": 6})
    with pytest.raises(ValueError, match=r"TreeDrafter drafts token trees \(DynamicTree\(depth=3, top_k=2, "
                                         r"num_nodes=6\)\), which batch size > 1 does not support yet: for a batch "
                                         r"use DraftModelDrafter\(draft_model, num_draft_tokens=3\)"):
        batch_generate(zoo.target("llama"), drafter)


def test_a_sliding_window_draft_model_refuses_a_batch(zoo):
    drafter = hs.DraftModelDrafter(build_model("qwen2_sliding", hidden_size=16), num_draft_tokens=3)
    with pytest.raises(ValueError, match=r"The draft model cannot draft for a batch: Speculative generate with "
                                         r"batch size > 1 needs full-attention cache layers; this model's cache has "
                                         r"\['DynamicSlidingWindowLayer'\]"):
        batch_generate(zoo.target("qwen2"), drafter)
