"""Greedy speculative decoding reproduces `model.generate(do_sample=False)` token for token (fp32)."""

import pytest
import torch

import hf_speculators as hs
from drafters_for_tests import OracleDrafter
from speculative_helpers import (
    DRAFTER_KINDS,
    MAX_NEW_TOKENS,
    NUM_DRAFT_TOKENS,
    PROMPTS,
    assert_cache_matches_sequence,
    assert_same_tokens,
    cache_kwargs,
    check_exact,
    generated_token,
    make_drafter,
    output_cache,
    plain_generate,
    prompt_ids,
    recording_forward_lengths,
    speculative_generate,
)
from tiny_models import ARCHS

ALL_ARCHS = pytest.mark.parametrize("arch", ARCHS)


@ALL_ARCHS
@pytest.mark.parametrize("prompt", ["random", "repetitive"])
@pytest.mark.parametrize("num_draft_tokens", NUM_DRAFT_TOKENS)
@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_greedy_output_equals_plain_generate(zoo, arch, kind, num_draft_tokens, prompt):
    check_exact(zoo, arch, prompt, kind, num_draft_tokens)


@ALL_ARCHS
def test_reference_outputs_are_not_trivial_loops(zoo, arch):
    """The tiny models are fp32 and in eval mode, and varied enough that exactness tests compare real text."""
    model = zoo.target(arch)
    assert model.dtype == torch.float32 and not model.training
    for prompt in ("random", "repetitive"):
        new_tokens = zoo.reference(arch, prompt)[0, len(PROMPTS[prompt]) :].tolist()
        assert len(new_tokens) == MAX_NEW_TOKENS
        assert len(set(new_tokens)) >= 8, new_tokens


@ALL_ARCHS
@pytest.mark.parametrize("kind", ["prompt_lookup", "draft_model", "noisy_draft_model", "oracle", "adversary"])
def test_one_token_prompt(zoo, arch, kind):
    out, _ = check_exact(zoo, arch, "one_token", kind, 4)
    # no prefill forward: the single prompt token is the first step's pending token
    assert out.speculative_stats.num_target_forwards == out.speculative_stats.num_steps


@ALL_ARCHS
@pytest.mark.parametrize("kind", ["prompt_lookup", "draft_model", "noisy_draft_model"])
def test_rejection_verifier_is_exact_when_greedy(zoo, arch, kind):
    """With do_sample=False the target distribution is one-hot: lossless rejection sampling is greedy decoding."""
    expected = zoo.reference(arch, "repetitive")
    drafter = make_drafter(kind, 4, zoo, arch)
    out = speculative_generate(zoo.target(arch), prompt_ids("repetitive"), drafter, verifier="rejection",
                               generator=torch.Generator().manual_seed(0))
    assert_same_tokens(out, expected)


@pytest.mark.parametrize("num_draft_tokens", [2, 8])
@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_sliding_window_layers(zoo, kind, num_draft_tokens):
    """Qwen2 with a 5-token sliding-window layer: rolling back must restore the tokens the window dropped."""
    out, _ = check_exact(zoo, "qwen2_sliding", "random", kind, num_draft_tokens)
    layer_types = [type(layer).__name__ for layer in output_cache(out).layers]
    assert any("Sliding" in name for name in layer_types), layer_types


# ---------------------------------------------------------------- EOS


@ALL_ARCHS
@pytest.mark.parametrize("num_draft_tokens", [2, 8])
@pytest.mark.parametrize("kind", DRAFTER_KINDS)
@pytest.mark.parametrize("eos_positions", [(5,), (7, 3)], ids=["one_eos", "two_eos"])
def test_stops_at_eos_like_plain_generate(zoo, arch, kind, num_draft_tokens, eos_positions):
    eos = [generated_token(zoo, arch, "random", p) for p in eos_positions]
    eos_token_id = eos[0] if len(eos) == 1 else eos
    expected = zoo.reference(arch, "random", eos_token_id=eos_token_id)
    assert expected.shape[1] <= len(PROMPTS["random"]) + max(eos_positions) + 1  # the edge case is exercised
    assert int(expected[0, -1]) in eos
    check_exact(zoo, arch, "random", kind, num_draft_tokens, eos_token_id=eos_token_id)


@ALL_ARCHS
def test_eos_inside_an_accepted_draft_ends_generation_there(zoo, arch):
    """A draft may run past EOS; the target accepts it all, but the output must still end at the EOS."""
    prompt_length = len(PROMPTS["random"])
    eos = generated_token(zoo, arch, "random", 3)
    expected = zoo.reference(arch, "random", eos_token_id=eos)
    drafter = OracleDrafter(zoo.reference(arch, "random"), num_draft_tokens=8)  # the no-EOS continuation
    out = speculative_generate(zoo.target(arch), prompt_ids("random"), drafter, eos_token_id=eos,
                               return_dict_in_generate=True)
    assert_same_tokens(out.sequences, expected)
    assert_cache_matches_sequence(out)
    eos_index = expected.shape[1] - prompt_length - 1
    assert len(drafter.proposals[0]) > eos_index + 1 and drafter.proposals[0][eos_index] == eos
    assert out.speculative_stats.num_generated_tokens == expected.shape[1] - prompt_length


# ---------------------------------------------------------------- length limit


@ALL_ARCHS
@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 6, 9])
@pytest.mark.parametrize("kind", ["prompt_lookup", "draft_model", "noisy_draft_model", "oracle", "adversary"])
def test_max_new_tokens_edges(zoo, arch, kind, max_new_tokens):
    """k=5: a draft of 5 would cross the limit for every max_new_tokens here but 9 (and its second step)."""
    prompt_length = len(PROMPTS["repetitive"])
    out, drafter = check_exact(zoo, arch, "repetitive", kind, 5, max_new_tokens=max_new_tokens)
    assert out.sequences.shape[1] == prompt_length + max_new_tokens
    assert out.speculative_stats.num_generated_tokens == max_new_tokens
    for input_length, max_tokens in getattr(drafter, "calls", []):
        # a draft never asks for more tokens than fit before the limit, the next (bonus) token included
        assert input_length + max_tokens + 1 <= prompt_length + max_new_tokens


@ALL_ARCHS
@pytest.mark.parametrize("kind", ["prompt_lookup", "oracle"])
def test_max_length_limit(zoo, arch, kind):
    max_length = len(PROMPTS["repetitive"]) + 7
    out, _ = check_exact(zoo, arch, "repetitive", kind, 5, max_new_tokens=None, max_length=max_length)
    assert out.sequences.shape[1] == max_length


# ---------------------------------------------------------------- logits processors


def processor_settings(zoo, arch: str, setting: str) -> dict:
    if setting == "repetition_penalty":
        return dict(repetition_penalty=1.3)
    if setting == "no_repeat_ngram":
        return dict(no_repeat_ngram_size=2)
    if setting == "min_new_tokens":
        # an EOS that plain greedy decoding emits second: min_new_tokens must hold it back until token 8
        return dict(min_new_tokens=8, eos_token_id=generated_token(zoo, arch, "repetitive", 1))
    if setting == "bad_words":
        # ban the second generated token after the first: depends on the draft prefix at each position
        return dict(bad_words_ids=[[generated_token(zoo, arch, "repetitive", i) for i in (0, 1)]])
    if setting == "begin_suppress":
        # only the first generated token may not be the one plain decoding picks
        return dict(begin_suppress_tokens=[generated_token(zoo, arch, "repetitive", 0)])
    if setting == "forced_eos":
        # the last position (max_length - 1) is forced to token 7, whatever the draft proposes there
        return dict(forced_eos_token_id=7, max_new_tokens=11)
    raise ValueError(setting)


PROCESSOR_SETTINGS = ["repetition_penalty", "no_repeat_ngram", "min_new_tokens", "bad_words", "begin_suppress",
                      "forced_eos"]


@ALL_ARCHS
@pytest.mark.parametrize("kind", DRAFTER_KINDS)
@pytest.mark.parametrize("setting", PROCESSOR_SETTINGS)
def test_logits_processors(zoo, arch, setting, kind):
    settings = processor_settings(zoo, arch, setting)
    expected = zoo.reference(arch, "repetitive", **settings)
    without = {key: settings[key] for key in ("eos_token_id", "max_new_tokens") if key in settings}
    assert not torch.equal(expected, zoo.reference(arch, "repetitive", **without))  # the processor matters here
    check_exact(zoo, arch, "repetitive", kind, 3, **settings)


@ALL_ARCHS
def test_continues_from_the_returned_cache(zoo, arch):
    """The returned cache holds every token but the last, so it can seed the next call (a chat turn)."""
    model = zoo.target(arch)
    first = speculative_generate(model, prompt_ids("random"), hs.PromptLookupDrafter(4), max_new_tokens=10,
                                 return_dict_in_generate=True)
    next_turn = torch.cat([first.sequences, torch.tensor([[5, 9, 5]])], dim=-1)
    with recording_forward_lengths(model) as lengths:
        out = speculative_generate(model, next_turn, hs.PromptLookupDrafter(4), max_new_tokens=10,
                                   return_dict_in_generate=True, **cache_kwargs(model, output_cache(first)))
    assert_same_tokens(out.sequences, plain_generate(model, next_turn, max_new_tokens=10))
    assert_cache_matches_sequence(out)
    # the cached prefix was reused: the prefill ran only what the cache lacked (the last token of the first
    # call and the 3 new ones, less the pending last token), not the whole prompt
    assert lengths[0] == 3
