"""DraftModelDrafter keeps its KV cache across steps: one forward per draft token, no re-prefill."""

import copy

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

import hf_speculators as hs
from speculative_helpers import (
    PROMPTS,
    assert_same_tokens,
    prompt_ids,
    recording_forward_lengths,
    speculative_generate,
)
from tiny_models import ARCHS, build_draft

PROMPT = "random"
PROMPT_LENGTH = len(PROMPTS[PROMPT])


def generate_recording_draft_forwards(zoo, arch, draft_model, num_draft_tokens, max_new_tokens):
    drafter = hs.DraftModelDrafter(draft_model, num_draft_tokens=num_draft_tokens)
    with recording_forward_lengths(draft_model) as lengths:
        out = speculative_generate(zoo.target(arch), prompt_ids(PROMPT), drafter, max_new_tokens=max_new_tokens,
                                   plain_floor=False,
                                   return_dict_in_generate=True)
    assert_same_tokens(out.sequences, zoo.reference(arch, PROMPT, max_new_tokens=max_new_tokens))
    return out.speculative_stats, lengths


@pytest.mark.parametrize("arch", ARCHS)
def test_all_accepting_draft_runs_k_forwards_per_step(zoo, arch):
    """With the target as its own draft every token is accepted; each step then feeds the draft only the two
    tokens it has not seen (the last draft token and the bonus token) and drafts k tokens in k forwards."""
    k, steps = 4, 5
    stats, lengths = generate_recording_draft_forwards(zoo, arch, copy.deepcopy(zoo.target(arch)), k, steps * (k + 1))
    assert stats.num_accepted_tokens == stats.num_drafted_tokens == steps * k
    assert stats.num_drafts == steps
    assert len(lengths) == steps * k
    # step 1: the prompt once, then one token per forward; later steps: 2 new tokens, then one per forward
    assert lengths == [PROMPT_LENGTH] + [1] * (k - 1) + ([2] + [1] * (k - 1)) * (steps - 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_rejecting_draft_rolls_its_cache_back_instead_of_prefilling(zoo, arch):
    """A smaller draft gets tokens rejected: its cache is cropped to the accepted prefix, never rebuilt."""
    k = 4
    stats, lengths = generate_recording_draft_forwards(zoo, arch, zoo.draft(arch), k, 24)
    assert stats.num_accepted_tokens < stats.num_drafted_tokens  # rejections happened
    assert len(lengths) == stats.num_drafted_tokens  # one forward per draft token
    assert lengths[0] == PROMPT_LENGTH
    assert max(lengths[1:]) <= 2  # after the prefill: never more than the two tokens the draft has not seen


def test_a_new_generate_call_starts_a_new_draft_cache(zoo):
    """The same drafter object on another prompt re-prefills: no KV state leaks across generate calls."""
    draft_model = zoo.draft("llama")
    drafter = hs.DraftModelDrafter(draft_model, num_draft_tokens=3)
    speculative_generate(zoo.target("llama"), prompt_ids("random"), drafter, max_new_tokens=8)
    with recording_forward_lengths(draft_model) as lengths:
        out = speculative_generate(zoo.target("llama"), prompt_ids("repetitive"), drafter, max_new_tokens=8)
    assert_same_tokens(out, zoo.reference("llama", "repetitive", max_new_tokens=8))
    assert lengths[0] == len(PROMPTS["repetitive"])


def test_greedy_draft_is_the_draft_models_own_greedy_continuation(zoo):
    """propose() called step by step on growing sequences equals the draft model's plain greedy output."""
    draft_model = zoo.draft("qwen2")
    drafter = hs.DraftModelDrafter(draft_model, num_draft_tokens=3)
    state = drafter.new_state(zoo.target("qwen2"), GenerationConfig(do_sample=False))
    sequence = zoo.reference("qwen2", PROMPT)
    for length in range(PROMPT_LENGTH, PROMPT_LENGTH + 12, 3):  # the committed text grows by 3 each call
        prefix = sequence[:, :length]
        (draft,) = drafter.propose(state, [prefix], [3], [0])
        expected = draft_model.generate(prefix, max_new_tokens=3, do_sample=False)[0, length:]
        assert draft.draft_probs is None
        assert_same_tokens(draft.token_ids, expected)


def test_sampled_draft_probs_are_the_processed_draft_distribution(zoo):
    """With sampling, draft_probs row i is softmax of the draft's processed scores after the first i tokens."""
    draft_model = zoo.draft("gpt2")
    drafter = hs.DraftModelDrafter(draft_model, num_draft_tokens=3)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(20)])
    state = drafter.new_state(zoo.target("gpt2"), GenerationConfig(do_sample=True), logits_processor=processors,
                              generator=torch.Generator().manual_seed(0))
    prefix = prompt_ids(PROMPT)
    (draft,) = drafter.propose(state, [prefix], [3], [0])
    assert draft.draft_probs.shape == (3, 96)
    for i in range(3):
        context = torch.cat([prefix, draft.token_ids[None, :i]], dim=-1)
        with torch.no_grad():
            logits = draft_model(context).logits[:, -1]
        expected = torch.softmax(processors(context, logits), dim=-1)[0]
        torch.testing.assert_close(draft.draft_probs[i], expected, rtol=1e-4, atol=1e-6)
        assert draft.draft_probs[i, draft.token_ids[i]] > 0


def test_sliding_window_draft_model(zoo):
    """A draft model with sliding-window layers: rolling its own cache back past the window needs the same
    `activate_past_recording()` the target's cache gets, or `crop` fails once the window is full."""
    draft_model = build_draft("qwen2_sliding", num_layers=2)
    assert "sliding_attention" in draft_model.config.layer_types
    drafter = hs.DraftModelDrafter(draft_model, num_draft_tokens=4)
    out = speculative_generate(zoo.target("qwen2_sliding"), prompt_ids(PROMPT), drafter)
    assert_same_tokens(out, zoo.reference("qwen2_sliding", PROMPT))
