"""DraftModelDrafter and TreeDrafter on a batch: rows exact against their own plain greedy output, ragged stopping,
the draft cache's rows, each row's tree as if drafted alone, seeded losslessness of batched rejection sampling, and
the draft models that refuse batches."""

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList
from transformers import TemperatureLogitsWarper, TopKLogitsWarper

import hf_speculators as hs
import hf_speculators.verifiers.rejection as rejection_module
from batch_helpers import PAD, batched_generate, laid_out, left_padded, two_token_joint
from speculative_helpers import PROMPTS, generated_token, make_drafter
from test_lossless import chi_square, chi_square_critical
from tiny_models import ARCHS, build_model

TREES = {"static": [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)],
         "dynamic": hs.DynamicTree(depth=4, top_k=3, num_nodes=8)}  # 8 of up to 30 nodes kept: shapes differ by row

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
    output = batch_generate(zoo.target(arch), make_drafter(kind, num_draft_tokens, zoo, arch),
                            plain_floor=False)  # every step drafts: the floor reads the clock
    assert_rows_match_references(zoo, arch, output)
    if kind == "noisy_draft_model":  # partly accepted: both verification outcomes ran
        stats = output.speculative_stats
        assert 0 < stats.num_accepted_tokens < stats.num_drafted_tokens


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_rows_stop_at_different_steps_and_leave_the_draft_cache(zoo, kind):
    """An EOS that the first row generates early: that row stops, the others run to max_new_tokens; from the next
    call on, the draft cache has no row for it."""
    arch = "llama"
    eos = generated_token(zoo, arch, "random", 3)
    assert all(eos not in zoo.reference(arch, name)[0, len(PROMPTS[name]):].tolist() for name in BATCH[1:])
    draft_model = zoo.noisy_draft(arch)
    drafter = (hs.DraftModelDrafter(draft_model, num_draft_tokens=3) if kind == "chain"
               else hs.TreeDrafter(draft_model, TREES["dynamic"]))
    cache_rows = []
    propose = drafter.propose

    def recording(state, input_ids, max_tokens, rows):
        drafts = propose(state, input_ids, max_tokens, rows)
        cache_rows.append((list(rows), state.draft_cache.rows, len(state.cached_ids)))
        return drafts

    drafter.propose = recording
    output = batch_generate(zoo.target(arch), drafter, eos_token_id=eos)
    assert_rows_match_references(zoo, arch, output, eos_token_id=eos)
    assert cache_rows[0][0] == [0, 1, 2] and [1, 2] in [rows for rows, _, _ in cache_rows]
    assert all(cached == rows and num_ids == len(rows) for rows, cached, num_ids in cache_rows)


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


# ---------------------------------------------------------------- token trees


@pytest.mark.parametrize("shape", TREES)
@pytest.mark.parametrize("arch", ARCHS)
def test_tree_rows_equal_their_own_greedy_output(zoo, arch, shape):
    """TreeDrafter at batch size 3: each row grows its own tree, the target scores rows of different tree shapes in
    one forward, and every row is exactly its own plain greedy output."""
    output = batch_generate(zoo.target(arch), hs.TreeDrafter(zoo.noisy_draft(arch), TREES[shape]),
                            plain_floor=False)  # every step drafts: the floor reads the clock
    assert_rows_match_references(zoo, arch, output)
    stats = output.speculative_stats
    assert stats.mean_acceptance_length > 1.5  # the noisy draft agrees often: tree paths are accepted
    assert stats.num_drafted_tokens > sum(stats.drafted_per_position)  # more nodes than depths: trees were drafted


def test_each_rows_tree_is_the_tree_it_gets_alone(zoo):
    """One batched draft forward per depth: each row's nodes see only their own ancestors (`Query.past_visible`), so
    the batch's trees are the trees each row gets in a call of its own, also when their shapes differ."""
    arch = "qwen2"
    drafter = hs.TreeDrafter(zoo.noisy_draft(arch), TREES["dynamic"])
    target, config = zoo.target(arch), GenerationConfig(do_sample=False)
    sequences = [zoo.reference(arch, name)[:, : len(PROMPTS[name]) + 6] for name in BATCH]
    batch, alone = drafter.new_state(target, config, batch_size=3), [drafter.new_state(target, config) for _ in BATCH]
    shapes = set()
    for cut, budgets in ((3, [4, 4, 4]), (1, [4, 2, 3]), (0, [4, 4, 0])):  # the committed text grows
        prefixes = [sequence[:, : sequence.shape[1] - cut] for sequence in sequences]
        drafts = drafter.propose(batch, prefixes, budgets, [0, 1, 2])
        for state, prefix, budget, draft in zip(alone, prefixes, budgets, drafts):
            (expected,) = drafter.propose(state, [prefix], [budget], [0])
            assert draft.token_ids.tolist() == expected.token_ids.tolist()
            assert draft.parent_ids.tolist() == expected.parent_ids.tolist()
            assert draft.tree.depth <= budget
            shapes.add(tuple(draft.parent_ids.tolist()))
    assert len(shapes) > 2  # rows of different tree shapes were drafted together
    assert batch.draft_cache.lengths.tolist() == [prefix.shape[1] for prefix in prefixes]  # the nodes were dropped


# ---------------------------------------------------------------- lossless sampling


SAMPLING_PROMPTS = ("random", "one_token")


def sampled_joint_counts(zoo, make_drafter, num_runs: int, temperature: float) -> tuple[list, list, int, int]:
    """First two tokens of each row of a batch of prompts of different lengths (each prompt in three rows), sampled
    with top-k and temperature through `make_drafter()`'s drafts: per prompt, the counts and the exact joint
    distribution of plain sampling of that prompt alone, and the draft tokens accepted and drafted.

    Calls `hs.generate` directly with the processors transformers would build, to keep the runs fast."""
    model = zoo.target("llama")
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(3)])
    joints = [two_token_joint(model, torch.tensor([PROMPTS[name]]), warpers) for name in SAMPLING_PROMPTS]
    input_ids, attention_mask = left_padded([PROMPTS[name] for name in SAMPLING_PROMPTS * 3])
    width = input_ids.shape[1]
    config = GenerationConfig(do_sample=True, max_length=width + 2, top_k=3, temperature=temperature, num_beams=1,
                              num_return_sequences=1, output_scores=False, output_logits=False,
                              return_dict_in_generate=True, pad_token_id=PAD)
    stopping = StoppingCriteriaList([MaxLengthCriteria(width + 2)])
    generator = torch.Generator().manual_seed(0)
    counts = [torch.zeros_like(joint) for joint in joints]
    num_accepted = num_draft_tokens = 0
    for _ in range(num_runs):
        out = hs.generate(model, input_ids, logits_processor=warpers, stopping_criteria=stopping,
                          generation_config=config, candidate_generator=make_drafter(), generator=generator,
                          attention_mask=attention_mask)
        for i, row in enumerate(out.sequences[:, width:].tolist()):
            counts[i % len(SAMPLING_PROMPTS)][row[0], row[1]] += 1
        num_accepted += out.speculative_stats.num_accepted_tokens
        num_draft_tokens += out.speculative_stats.num_drafted_tokens
    return counts, joints, num_accepted, num_draft_tokens


def chi_square_ratios(counts: list, joints: list) -> list[float]:
    """Per prompt, Pearson's statistic over its upper 0.1% quantile (pass below 1)."""
    return [chi_square(row_counts, joint) / chi_square_critical(int((joint > 0).sum()) - 1)
            for row_counts, joint in zip(counts, joints)]


SAMPLING_DRAFTERS = {  # the drafter, the number of runs and the temperature
    "chain": (lambda zoo: hs.DraftModelDrafter(zoo.noisy_draft("llama"), num_draft_tokens=2), 300, 0.8),
    # deterministic trees, every node verified as one-hot: three children of the root (each row's whole top-3
    # support, so every first token is a tried sibling) and a grandchild under two; a flatter distribution
    # (temperature 1.5) makes the order in which siblings are tried matter
    "tree": (lambda zoo: hs.TreeDrafter(zoo.noisy_draft("llama"), [(0,), (1,), (2,), (0, 0), (1, 0)]), 200, 1.5),
}


@pytest.mark.parametrize("kind", SAMPLING_DRAFTERS)
def test_batched_rejection_sampling_keeps_each_rows_distribution(zoo, kind):
    """Each row's first two tokens, sampled through a batched draft model (a chain, or a tree per row), are
    distributed as plain sampling of that row's prompt alone."""
    make, num_runs, temperature = SAMPLING_DRAFTERS[kind]
    counts, joints, num_accepted, num_draft_tokens = sampled_joint_counts(zoo, lambda: make(zoo), num_runs,
                                                                          temperature)
    assert 0 < num_accepted < num_draft_tokens  # accepted draft tokens and recovered tokens both occur
    assert all(ratio < 1 for ratio in chi_square_ratios(counts, joints)), chi_square_ratios(counts, joints)


def test_the_tree_sampling_test_catches_a_broken_verifier(zoo, monkeypatch):
    """The same statistic fails by far when a rejected sibling leaves p unchanged for the next sibling and for the
    recovered token (the residual ignored): the test sees the error it guards against."""
    monkeypatch.setattr(rejection_module, "residual_distribution", lambda target_probs, draft_probs: target_probs)
    make, num_runs, temperature = SAMPLING_DRAFTERS["tree"]
    counts, joints, _, _ = sampled_joint_counts(zoo, lambda: make(zoo), num_runs, temperature)
    assert all(ratio > 2 for ratio in chi_square_ratios(counts, joints)), chi_square_ratios(counts, joints)


def test_a_sliding_window_draft_model_refuses_a_batch(zoo):
    drafter = hs.DraftModelDrafter(build_model("qwen2_sliding", hidden_size=16), num_draft_tokens=3)
    with pytest.raises(ValueError, match=r"The draft model cannot draft for a batch: Speculative generate with "
                                         r"batch size > 1 needs full-attention cache layers; this model's cache has "
                                         r"\['DynamicSlidingWindowLayer'\]"):
        batch_generate(zoo.target("qwen2"), drafter)
