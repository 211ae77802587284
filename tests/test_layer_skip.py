"""LayerSkipDrafter: exact on every supported family, KV computed once per layer, cache safe on errors."""

import pytest
import torch
from transformers import DynamicCache, GemmaConfig, GenerationConfig, LogitsProcessor, LogitsProcessorList

import hf_speculators as hs
from hf_speculators.decoder_layers import DecoderLayers
from speculative_helpers import cache_kwargs, output_cache, plain_generate, prompt_ids, speculative_generate
from tiny_models import build_model

LAYERWISE_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gpt_neox", "gpt2")
NUM_LAYERS = 4
MAX_NEW_TOKENS = 30


@pytest.fixture(scope="module")
def deep_targets() -> dict:
    """4-layer fp32 models, so that exits after layers 1, 2 and 3 all leave layers to verify with."""
    return {arch: build_model(arch, hidden_size=48, num_layers=NUM_LAYERS, seed=1) for arch in LAYERWISE_ARCHS}


def layer_lengths(cache) -> set[int]:
    return {layer.get_seq_length() for layer in cache.layers}


@pytest.mark.parametrize("prompt", ["random", "repetitive", "one_token"])
@pytest.mark.parametrize("num_draft_tokens", [1, 3, 6])
@pytest.mark.parametrize("exit_layer", [1, 2, 3])
@pytest.mark.parametrize("arch", LAYERWISE_ARCHS)
def test_greedy_layer_skip_equals_plain_greedy(deep_targets, arch, exit_layer, num_draft_tokens, prompt):
    model, input_ids = deep_targets[arch], prompt_ids(prompt)
    expected = plain_generate(model, input_ids, max_new_tokens=MAX_NEW_TOKENS)
    drafter = hs.LayerSkipDrafter(exit_layer=exit_layer, num_draft_tokens=num_draft_tokens)
    out = speculative_generate(model, input_ids, drafter, max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True)
    assert out.sequences.tolist() == expected.tolist()
    # every layer of the shared cache holds the same tokens afterwards: all but the last one
    assert layer_lengths(output_cache(out)) == {out.sequences.shape[1] - 1}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_confidence_threshold_shortens_drafts_and_stays_exact(deep_targets, arch):
    model, input_ids = deep_targets[arch], prompt_ids("random")
    expected = plain_generate(model, input_ids, max_new_tokens=MAX_NEW_TOKENS)
    drafter = hs.LayerSkipDrafter(exit_layer=2, num_draft_tokens=6, confidence_threshold=0.5)
    out = speculative_generate(model, input_ids, drafter, max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True,
                               plain_floor=False)  # every step drafts: the floor reads the clock
    assert out.sequences.tolist() == expected.tolist()
    stats = out.speculative_stats
    assert stats.num_drafted_tokens < 6 * stats.num_drafts  # some drafts stopped early
    assert layer_lengths(output_cache(out)) == {out.sequences.shape[1] - 1}


def test_early_exits_of_random_models_are_sometimes_accepted(deep_targets):
    """The exactness tests above see acceptances as well as rejections."""
    drafter = hs.LayerSkipDrafter(exit_layer=3, num_draft_tokens=3)
    out = speculative_generate(deep_targets["llama"], prompt_ids("random"), drafter, max_new_tokens=MAX_NEW_TOKENS,
                               return_dict_in_generate=True, plain_floor=False)  # the floor reads the clock
    stats = out.speculative_stats
    assert 0 < stats.num_accepted_tokens < stats.num_drafted_tokens


@pytest.mark.parametrize("arch", LAYERWISE_ARCHS)
def test_every_layer_sees_every_token_once_and_no_full_forward_runs_after_prefill(deep_targets, arch):
    """KV reuse: the draft's layers < E are not recomputed by verification, which runs only layers >= E.

    Every fed token, draft tokens included, passes through each decoder layer exactly once (so all layers count
    the same tokens), and the whole model's forward runs only for the prefill and a step without a draft.
    """
    model = deep_targets[arch]
    layers = DecoderLayers(model).layers
    tokens_per_layer = [0] * NUM_LAYERS
    full_forwards = []

    def count(index):
        def hook(module, args, kwargs):
            tokens_per_layer[index] += (args[0] if args else kwargs["hidden_states"]).shape[1]
        return hook

    hooks = [layer.register_forward_pre_hook(count(i), with_kwargs=True) for i, layer in enumerate(layers)]
    hooks.append(model.register_forward_pre_hook(lambda module, args: full_forwards.append(1)))
    try:
        drafter = hs.LayerSkipDrafter(exit_layer=2, num_draft_tokens=4)
        out = speculative_generate(model, prompt_ids("random"), drafter, max_new_tokens=MAX_NEW_TOKENS,
                                   return_dict_in_generate=True)
    finally:
        for hook in hooks:
            hook.remove()
    stats = out.speculative_stats
    prefill = prompt_ids("random").shape[1] - 1
    # the prefill, and the last step if the length budget left no room for a draft
    assert len(full_forwards) == 1 + stats.num_steps - stats.num_drafts
    # per step: the pending token and the k draft tokens
    assert tokens_per_layer == [prefill + stats.num_steps + stats.num_drafted_tokens] * NUM_LAYERS


def test_rejection_sampling_with_layer_skip_is_seeded_and_keeps_the_cache_consistent(deep_targets):
    model = deep_targets["qwen2"]

    def sampled(seed: int):
        drafter = hs.LayerSkipDrafter(exit_layer=2, num_draft_tokens=3)
        return speculative_generate(model, prompt_ids("random"), drafter, do_sample=True, top_k=0,
                                    generator=torch.Generator().manual_seed(seed), return_dict_in_generate=True,
                                    plain_floor=False)  # the floor reads the clock

    first, again, other = sampled(3), sampled(3), sampled(4)
    assert first.sequences.tolist() == again.sequences.tolist() != other.sequences.tolist()
    assert first.speculative_stats.lossless and first.speculative_stats.verifier == "rejection"
    assert layer_lengths(output_cache(first)) == {first.sequences.shape[1] - 1}


def test_a_speculative_config_builds_a_layer_skip_drafter(deep_targets):
    model = deep_targets["llama"]
    config = hs.SpeculativeConfig(method="layer-skip", exit_layer=2, num_draft_tokens=3)
    out = model.generate(prompt_ids("random"), custom_generate=hs.generate, speculative_config=config,
                         do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
    assert out.tolist() == plain_generate(model, prompt_ids("random"), max_new_tokens=MAX_NEW_TOKENS).tolist()
    drafter, _ = hs.SpeculativeConfig(method="layer-skip", exit_layer=2, confidence_threshold=0.4).build(model)
    assert (drafter.exit_layer, drafter.confidence_threshold) == (2, 0.4)


# ---------------------------------------------------------------- exception safety


class RaiseAtCall(LogitsProcessor):
    """Raises on its `n`-th call: the first call scores the first draft token of the first step."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt("stop")
        return scores


@pytest.mark.parametrize("where", ["while drafting", "while verifying"])
def test_an_interrupted_step_leaves_every_layer_of_the_cache_as_before_the_step(deep_targets, where):
    model, input_ids = deep_targets["llama"], prompt_ids("random")
    cache = DynamicCache(config=model.config)
    drafter = hs.LayerSkipDrafter(exit_layer=2, num_draft_tokens=4)
    hooks = []
    if where == "while drafting":
        processors = LogitsProcessorList([RaiseAtCall(3)])  # the third draft token: layers < 2 hold two more
    else:
        processors = LogitsProcessorList()
        failing = DecoderLayers(model).layers[3]  # after layer 2 has cached the step's tokens
        calls = []

        def fail(module, args, kwargs):
            calls.append(1)
            if len(calls) == 2:  # the first call is the prefill's; the second, the first step's verification
                raise KeyboardInterrupt("stop")

        hooks.append(failing.register_forward_pre_hook(fail, with_kwargs=True))
    try:
        with pytest.raises(KeyboardInterrupt):
            speculative_generate(model, input_ids, drafter, logits_processor=processors, **cache_kwargs(model, cache))
    finally:
        for hook in hooks:
            hook.remove()
    assert layer_lengths(cache) == {input_ids.shape[1] - 1}  # the prefill only: the first step left no trace


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("exit_layer", [0, -1, 1.5, True, "2"])
def test_an_invalid_exit_layer_raises_at_construction(exit_layer):
    with pytest.raises(ValueError, match="exit_layer must be an integer >= 1"):
        hs.LayerSkipDrafter(exit_layer=exit_layer)


@pytest.mark.parametrize("threshold", [-0.1, 1, 1.5, True, "0.5"])
def test_an_invalid_confidence_threshold_raises_at_construction(threshold):
    with pytest.raises(ValueError, match=r"confidence_threshold must be a number in \[0, 1\)"):
        hs.LayerSkipDrafter(exit_layer=1, confidence_threshold=threshold)


def test_an_exit_layer_at_the_models_depth_raises_before_any_forward(deep_targets):
    with pytest.raises(ValueError, match=r"exit_layer=4 leaves no layer to verify with: this model has 4 layers; "
                                         r"choose an exit layer from 1 to 3"):
        speculative_generate(deep_targets["llama"], prompt_ids("random"), hs.LayerSkipDrafter(exit_layer=4))


def test_a_model_type_it_does_not_know_raises_naming_it():
    config = GemmaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = torch.nn.Module()
    model.config = config
    with pytest.raises(ValueError, match=r"this model is 'gemma', whose forward may do more .*scaled embeddings"):
        DecoderLayers(model)


def test_a_model_without_a_final_norm_raises_naming_what_is_missing():
    model = build_model("llama", num_layers=2)
    model.model.norm = None
    with pytest.raises(ValueError, match=r"LlamaModel has no final norm \(looked for the attribute norm / "
                                         r"final_layer_norm / ln_f\)"):
        DecoderLayers(model)


def test_sliding_window_layers_shorter_than_max_length_raise():
    model = build_model("qwen2_sliding", num_layers=2)
    with pytest.raises(ValueError, match=r"DynamicSlidingWindowLayer with a window of 5 tokens, shorter than "
                                         r"max_length=\d+\. Lower max_length to the window"):
        speculative_generate(model, prompt_ids("random"), hs.LayerSkipDrafter(exit_layer=1))


def test_sliding_window_layers_that_hold_the_whole_sequence_are_exact():
    model = build_model("qwen2_sliding", num_layers=2)
    input_ids = prompt_ids("one_token")  # 1 prompt token + 4 new = the 5-token window
    expected = plain_generate(model, input_ids, max_new_tokens=4)
    out = speculative_generate(model, input_ids, hs.LayerSkipDrafter(exit_layer=1, num_draft_tokens=2),
                               max_new_tokens=4)
    assert out.tolist() == expected.tolist()


def test_transformers_own_assisted_loop_gets_a_clear_error():
    with pytest.raises(RuntimeError, match="shares the target's KV cache and runs only inside hf_speculators.generate"):
        hs.LayerSkipDrafter(exit_layer=1).get_candidates(prompt_ids("random"))


def test_starting_without_the_targets_cache_raises(deep_targets):
    with pytest.raises(ValueError, match="drafts into the target's own KV cache"):
        hs.LayerSkipDrafter(exit_layer=1).new_state(deep_targets["llama"], GenerationConfig())


@pytest.mark.parametrize("implementation", ["flash_attention_2", "paged_attention"])
def test_an_attention_implementation_without_custom_masks_raises_before_any_forward(implementation):
    model = build_model("llama", num_layers=2)
    model.config._attn_implementation = implementation  # set directly: the kernels are not installed here
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    with pytest.raises(ValueError, match=rf"attn_implementation='{implementation}' cannot take: load the target "
                                         r"with attn_implementation=\"sdpa\""):
        speculative_generate(model, prompt_ids("random"), hs.LayerSkipDrafter(exit_layer=1))
    assert not forwards


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_eager_and_sdpa_targets_are_exact(implementation):
    model = build_model("llama", hidden_size=48, num_layers=NUM_LAYERS, seed=1)
    model.set_attn_implementation(implementation)
    input_ids = prompt_ids("random")
    expected = plain_generate(model, input_ids, max_new_tokens=MAX_NEW_TOKENS)
    out = speculative_generate(model, input_ids, hs.LayerSkipDrafter(exit_layer=2, num_draft_tokens=3),
                               max_new_tokens=MAX_NEW_TOKENS)
    assert out.tolist() == expected.tolist()
