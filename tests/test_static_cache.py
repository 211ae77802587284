"""transformers' StaticCache in the speculative loop (eager): exact output, length resets, buckets, refusals."""

import pytest
import torch
from transformers import StaticCache

import hf_speculators as hs
import hf_speculators.loop as loop
from hf_speculators.cache import RaggedCache
from hf_speculators.static_cache import MIN_BUCKET, length_bucket
from batch_helpers import MAX_NEW_TOKENS
from drafters_for_tests import WrongFirstTreeDrafter
from speculative_helpers import (cache_kwargs, make_drafter, output_cache, plain_generate, prompt_ids,
                                 speculative_generate)
from test_batch import BATCH_PROMPTS, batched, expected_batch, scripted
from test_compiled import compile_config, fresh_dynamo, unique_graphs
from tiny_models import build_model, build_target

STATIC = dict(cache_implementation="static")


@pytest.mark.parametrize("num_draft_tokens", [1, 4])
@pytest.mark.parametrize("kind", ["noisy_draft_model", "scripted", "adversary", "prompt_lookup"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_one_row_is_plain_greedy_output(zoo, arch, kind, num_draft_tokens):
    reference = zoo.reference(arch, "repetitive", max_new_tokens=MAX_NEW_TOKENS)
    drafter = make_drafter(kind, num_draft_tokens, zoo, arch, reference=reference)
    out = speculative_generate(zoo.target(arch), prompt_ids("repetitive"), drafter, return_dict_in_generate=True,
                               plain_floor=False, **STATIC)  # every step drafts: the floor reads the clock
    assert out.sequences.tolist() == reference.tolist()
    cache = output_cache(out)
    assert isinstance(cache, StaticCache)  # the loop's own bucketed cache, holding every token but the last
    assert cache.layers[0].max_cache_len == MIN_BUCKET
    assert int(cache.get_seq_length()) == reference.shape[1] - 1
    if kind in ("scripted", "adversary") and num_draft_tokens > 1:
        stats = out.speculative_stats
        assert stats.num_drafted_tokens > stats.num_accepted_tokens  # rejections did reset the length


@pytest.mark.parametrize("max_holes", [None, 0])
def test_batch_rows_are_their_own_plain_output(zoo, monkeypatch, max_holes):
    """Ragged rows over a static cache: holes masked over its whole length; `max_holes=0` compacts in place."""
    if max_holes is not None:
        monkeypatch.setattr(loop, "RaggedCache",
                            lambda cache, valid, _, **kwargs: RaggedCache(cache, valid, max_holes, **kwargs))
    drafter = scripted(zoo, "llama", BATCH_PROMPTS, 4, max_new_tokens=MAX_NEW_TOKENS)
    out = batched(zoo.target("llama"), drafter, **STATIC)
    assert torch.equal(out.sequences, expected_batch(zoo, "llama", BATCH_PROMPTS, max_new_tokens=MAX_NEW_TOKENS))


def test_batch_token_trees_are_their_own_plain_output(zoo):
    """Prompt lookup with two candidates per position drafts token trees for ragged rows over a static cache."""
    drafter = hs.PromptLookupDrafter(3, max_ngram_size=2, num_candidates=2)
    out = batched(zoo.target("llama"), drafter, plain_floor=False, **STATIC)
    assert torch.equal(out.sequences, expected_batch(zoo, "llama", BATCH_PROMPTS, max_new_tokens=MAX_NEW_TOKENS))
    assert out.speculative_stats.num_drafted_tokens > 0


def test_finished_rows_leave_a_static_batch(zoo):
    eos = int(zoo.reference("llama", "random", max_new_tokens=MAX_NEW_TOKENS)[0, len(prompt_ids("random")[0]) + 2])
    out = batched(zoo.target("llama"), hs.PromptLookupDrafter(3), eos_token_id=eos, **STATIC)
    expected = expected_batch(zoo, "llama", BATCH_PROMPTS, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos)
    assert torch.equal(out.sequences, expected)
    lengths = [row.num_generated_tokens for row in out.speculative_stats.row_stats]
    assert len(set(lengths)) > 1  # a row did leave early


def test_length_buckets():
    assert [length_bucket(n) for n in (1, 200, 256, 257, 600, 1252, 2048)] == [
        MIN_BUCKET, MIN_BUCKET, MIN_BUCKET, 320, 640, 1280, 2048]
    assert all(n <= length_bucket(n) <= 1.25 * n for n in range(MIN_BUCKET, 5000))


def test_prefilled_static_cache_continues(zoo):
    """A static cache that the caller prefilled and that holds the call: kept, its tokens not computed again."""
    model = zoo.target("llama")
    ids = prompt_ids("random")
    cache = StaticCache(config=model.config, max_cache_len=512)
    model(ids[:, :-2], use_cache=True, **cache_kwargs(model, cache))
    reference = zoo.reference("llama", "random", max_new_tokens=MAX_NEW_TOKENS)
    out = speculative_generate(model, ids, hs.PromptLookupDrafter(3), return_dict_in_generate=True,
                               **cache_kwargs(model, cache))
    assert out.sequences.tolist() == reference.tolist()
    assert output_cache(out) is cache


def test_refusals(zoo):
    model = zoo.target("llama")
    ids = prompt_ids("random")
    short = StaticCache(config=model.config, max_cache_len=16)
    model(ids, use_cache=True, **cache_kwargs(model, short))
    with pytest.raises(ValueError, match="fewer than the"):
        speculative_generate(model, ids, hs.PromptLookupDrafter(3), **cache_kwargs(model, short))
    sliding = build_model("qwen2_sliding", seed=1)
    with pytest.raises(ValueError, match="StaticLayer"):
        speculative_generate(sliding, ids, hs.PromptLookupDrafter(3), max_new_tokens=8, **STATIC)


@pytest.mark.parametrize("share_tokens", [False, True])
def test_token_trees_are_plain_greedy_output(zoo, share_tokens):
    """A tree's accepted path (never its first nodes here) is gathered into place in the static cache."""
    reference = zoo.reference("llama", "random", max_new_tokens=MAX_NEW_TOKENS)
    drafter = WrongFirstTreeDrafter(reference, 3, share_tokens=share_tokens)
    out = speculative_generate(zoo.target("llama"), prompt_ids("random"), drafter, return_dict_in_generate=True,
                               **STATIC)
    assert out.sequences.tolist() == reference.tolist()
    assert isinstance(output_cache(out), StaticCache)
    assert out.speculative_stats.num_accepted_tokens > 0


def test_a_tree_wider_than_the_estimate_grows_the_static_cache(zoo):
    """The call sizes its cache for `max_length` plus k tokens; a tree of 3 siblings per depth needs more near the
    end of a bucket, so the cache moves into the next bucket, its tokens kept."""
    model = zoo.target("llama")
    ids = torch.randint(1, model.config.vocab_size, (1, MIN_BUCKET - MAX_NEW_TOKENS - 3), generator=torch.Generator().manual_seed(0))
    reference = model.generate(ids, do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
    out = speculative_generate(model, ids, WrongFirstTreeDrafter(reference, 3, share_tokens=True),
                               return_dict_in_generate=True, **STATIC)
    assert out.sequences.tolist() == reference.tolist()
    assert output_cache(out).layers[0].max_cache_len == length_bucket(MIN_BUCKET + 1) > MIN_BUCKET


def test_compiled_token_trees_are_exact_in_few_graphs():
    """Trees under compile: each step's query is padded to a multiple of k + 1 slots, so trees of 3 siblings per
    depth (up to 9 nodes) run at widths 4, 8 and 12 only (dynamo's `"eager"` backend: graphs without code
    generation), and their accepted paths (never the first nodes) are gathered in place."""
    fresh_dynamo()
    model = hs.enable(build_target("llama"))
    config = compile_config("eager")
    for name in ("repetitive", "random"):
        ids = prompt_ids(name)
        reference = plain_generate(model, ids)
        out = model.generate(ids, candidate_generator=WrongFirstTreeDrafter(reference, 3, share_tokens=True),
                             do_sample=False, max_new_tokens=MAX_NEW_TOKENS, compile_config=config,
                             plain_floor=False, return_dict_in_generate=True, **STATIC)
        assert out.sequences.tolist() == reference.tolist()
        assert out.speculative_stats.num_accepted_tokens > MAX_NEW_TOKENS // 2
    assert 1 <= unique_graphs() <= 3  # compiled, at most one graph per width
