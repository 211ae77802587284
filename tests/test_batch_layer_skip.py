"""LayerSkipDrafter on a batch: every row its own plain greedy output, every layer of the cache fed the same slots."""


import pytest
import torch
from transformers import DynamicCache, GenerationConfig

import hf_speculators as hs
from hf_speculators import loop
from hf_speculators.cache import RaggedCache
from hf_speculators.query import Query
from hf_speculators.target import TargetForward
from hf_speculators.decoder_layers import DecoderLayers
from batch_helpers import PAD, batched_generate, laid_out
from speculative_helpers import PROMPTS, cache_kwargs
from tiny_models import VOCAB_SIZE, build_model

ARCHS = ("llama", "qwen2", "gpt_neox", "gpt2")
NUM_LAYERS = 4
MAX_NEW_TOKENS = 20
# 8, 1, 9 and 2 tokens: every row is left-padded but the third
BATCH_PROMPTS = (PROMPTS["random"], PROMPTS["one_token"], PROMPTS["repetitive"], (5, 9))


@pytest.fixture(scope="module")
def deep_targets() -> dict:
    """4-layer fp32 models (as in test_layer_skip.py), so that exit layers 1 and 3 both leave layers to verify."""
    return {arch: build_model(arch, hidden_size=48, num_layers=NUM_LAYERS, seed=1) for arch in ARCHS}


def own_outputs(model, prompts, **kwargs) -> torch.LongTensor:
    """Each row's own unbatched plain greedy output, laid out as plain batched `generate` lays rows out."""
    return laid_out(prompts, [model.generate(torch.tensor([p]), do_sample=False, pad_token_id=PAD, **kwargs)[0].tolist()
                              for p in prompts])


def batched(model, drafter, prompts=BATCH_PROMPTS, **kwargs):
    return batched_generate(model, drafter, prompts, **{"max_new_tokens": MAX_NEW_TOKENS, **kwargs})


@pytest.mark.parametrize("exit_layer", [1, 3])
@pytest.mark.parametrize("num_draft_tokens", [1, 3, 5])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_row_equals_its_own_plain_greedy_output(deep_targets, arch, num_draft_tokens, exit_layer):
    model = deep_targets[arch]
    # an EOS that the first row generates early: rows stop at different steps (EOS or max_new_tokens)
    eos = own_outputs(model, BATCH_PROMPTS[:1], max_new_tokens=MAX_NEW_TOKENS)[0, len(BATCH_PROMPTS[0]) + 4]
    kwargs = {"max_new_tokens": MAX_NEW_TOKENS, "eos_token_id": int(eos)}
    expected = own_outputs(model, BATCH_PROMPTS, **kwargs)
    out = batched(model, hs.LayerSkipDrafter(exit_layer=exit_layer, num_draft_tokens=num_draft_tokens), **kwargs)
    assert out.sequences.tolist() == expected.tolist()
    assert len({row.num_steps for row in out.speculative_stats.row_stats}) > 1  # rows stopped at different steps
    assert out.speculative_stats.num_accepted_tokens > 0


def test_every_layer_sees_each_slot_once_and_no_full_forward_runs_after_prefill(deep_targets):
    """KV reuse in a batch: verification runs only layers >= E over the slots layers < E cached while drafting.

    Every decoder layer is fed the same slots (so the RaggedCache describes every layer), and the whole model's
    forward runs only for the prefill and for a step in which no row had room for a draft.
    """
    model = deep_targets["llama"]
    tokens_per_layer, full_forwards = [0] * NUM_LAYERS, []

    def count(index):
        def hook(module, args, kwargs):
            hidden_states = args[0] if args else kwargs["hidden_states"]
            tokens_per_layer[index] += hidden_states.shape[0] * hidden_states.shape[1]
        return hook

    hooks = [layer.register_forward_pre_hook(count(i), with_kwargs=True)
             for i, layer in enumerate(DecoderLayers(model).layers)]
    hooks.append(model.register_forward_pre_hook(lambda module, args: full_forwards.append(1)))
    cache = DynamicCache(config=model.config)
    try:
        out = batched(model, hs.LayerSkipDrafter(exit_layer=2, num_draft_tokens=4), **cache_kwargs(model, cache))
    finally:
        for hook in hooks:
            hook.remove()
    assert len(set(tokens_per_layer)) == 1
    assert len({layer.get_seq_length() for layer in cache.layers}) == 1
    stats = out.speculative_stats
    assert stats.num_drafts > 0
    assert len(full_forwards) < stats.num_target_forwards  # the steps with a draft ran no whole forward
    assert out.sequences.tolist() == own_outputs(model, BATCH_PROMPTS, max_new_tokens=MAX_NEW_TOKENS).tolist()


@pytest.mark.parametrize("max_holes", [0, 10**6])
def test_compacting_every_step_or_never_changes_nothing(deep_targets, monkeypatch, max_holes):
    """Compaction gathers every layer's slots, the drafted early ones included; holes may also pile up."""
    monkeypatch.setattr(loop, "RaggedCache", lambda cache, valid, _, **kwargs: RaggedCache(cache, valid, max_holes, **kwargs))
    model = deep_targets["gpt_neox"]
    out = batched(model, hs.LayerSkipDrafter(exit_layer=2, num_draft_tokens=3))
    assert out.sequences.tolist() == own_outputs(model, BATCH_PROMPTS, max_new_tokens=MAX_NEW_TOKENS).tolist()


def test_one_token_prompts_draft_from_the_first_step(deep_targets):
    """Without a prefill forward the cache is still empty; the first step drafts into it anyway."""
    model, prompts = deep_targets["qwen2"], ((33,), (71,), (5,))
    events = []
    hooks = [model.register_forward_pre_hook(lambda module, args: events.append("whole model")),
             DecoderLayers(model).layers[0].register_forward_pre_hook(lambda module, args: events.append("layer 0"))]
    try:
        out = batched(model, hs.LayerSkipDrafter(exit_layer=3, num_draft_tokens=3), prompts=prompts)
    finally:
        for hook in hooks:
            hook.remove()
    assert out.sequences.tolist() == own_outputs(model, prompts, max_new_tokens=MAX_NEW_TOKENS).tolist()
    assert events[:2] == ["layer 0", "layer 0"]  # drafting, not a whole forward, ran first


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_confidence_threshold_and_a_draft_vocabulary_stay_exact(deep_targets, arch):
    model = deep_targets[arch]
    drafter = hs.LayerSkipDrafter(exit_layer=2, num_draft_tokens=6, confidence_threshold=0.3,
                                  draft_vocab=list(range(0, VOCAB_SIZE, 2)))
    out = batched(model, drafter)
    assert out.sequences.tolist() == own_outputs(model, BATCH_PROMPTS, max_new_tokens=MAX_NEW_TOKENS).tolist()
    stats = out.speculative_stats
    assert stats.num_drafted_tokens < 6 * stats.num_drafts  # some rows' drafts stopped early


def test_batched_sampling_is_seeded(deep_targets):
    def sampled(seed: int):
        drafter = hs.LayerSkipDrafter(exit_layer=2, num_draft_tokens=3)
        return batched(deep_targets["qwen2"], drafter, do_sample=True, top_k=0,
                       generator=torch.Generator().manual_seed(seed), plain_floor=False).sequences.tolist()

    assert sampled(3) == sampled(3) != sampled(4)


def test_verifying_other_slots_than_the_drafted_ones_raises(deep_targets):
    model = deep_targets["llama"]
    ragged = RaggedCache(DynamicCache(config=model.config), torch.zeros(2, 0, dtype=torch.bool))
    drafter = hs.LayerSkipDrafter(exit_layer=1, num_draft_tokens=3)
    state = drafter.new_state(model, GenerationConfig(do_sample=False), cache=ragged, batch_size=2)
    proposal = drafter.propose(state, [torch.tensor([[4, 8]]), torch.tensor([[7]])], [3, 1], [0, 1])
    assert [draft.num_nodes for draft in proposal] == [3, 1]
    assert proposal.resume.valid.tolist() == [[True] * 4, [True, True, False, False]]
    query = Query.chain(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="must cover exactly the query slots the loop built"):
        TargetForward(model, drafter.target_needs(model))(ragged, query, proposal.resume)
