"""Working on every transformers release we declare (5.23 and 5.24 are tested in CI): the cache argument's name read
from the models' own signatures, a caller's cache under either name, the output's cache field, no warning from any
of our calls, and caches that cannot be cropped refused before any forward."""

import inspect
import warnings
from contextlib import contextmanager

import pytest
import torch
from transformers import DynamicCache, Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import logging as transformers_logging

import hf_speculators as hs
from eagle_heads import random_eagle3
from hf_speculators.cache import CACHE_ARGUMENT_NAMES, cache_argument, passed_cache
from hf_speculators.outputs import CACHE_FIELD
from hf_speculators.drafters.gemma4_assistant import gemma4_assistant_unsupported
from native_models import build_dflash, build_gemma4, build_mtp_target
from speculative_helpers import cache_kwargs, prompt_ids, speculative_generate, transformers_warnings
from tiny_models import VOCAB_SIZE, build_model, build_target

NEW_TOKENS = 8


def test_the_cache_argument_is_read_from_each_forwards_own_signature(zoo):
    target, neox = zoo.target("llama"), zoo.target("gpt_neox")
    for module in (target, target.model.layers[0], neox, neox.gpt_neox.layers[0]):
        parameters = inspect.signature(type(module).forward).parameters
        assert cache_argument(module) == next(name for name in CACHE_ARGUMENT_NAMES if name in parameters)
    assert cache_argument(neox.gpt_neox.layers[0]) == "layer_past"  # GPT-NeoX's decoder layers, on every release
    with pytest.raises(ValueError, match=r"Linear.forward takes no cache argument \(looked for cache / past_key_values"):
        cache_argument(torch.nn.Linear(2, 2))


def test_the_output_carries_the_cache_where_transformers_own_outputs_do(zoo):
    assert CACHE_FIELD in GenerateDecoderOnlyOutput.__dataclass_fields__
    out = speculative_generate(zoo.target("llama"), prompt_ids("random"), hs.PromptLookupDrafter(),
                               max_new_tokens=NEW_TOKENS, return_dict_in_generate=True)
    assert getattr(out, CACHE_FIELD).get_seq_length() == out.sequences.shape[1] - 1


@pytest.mark.parametrize("name", ["installed", "past_key_values"])
def test_a_cache_passed_under_either_name_is_continued(zoo, name):
    """The second call continues the first one's cache: equal to one plain call of the whole length. The
    installed release's name (`cache` from 5.24 on; 5.23's generate refuses it) and the older one both reach us."""
    target, ids = zoo.target("llama"), prompt_ids("random")
    name = cache_argument(target) if name == "installed" else name
    first = speculative_generate(target, ids, hs.PromptLookupDrafter(), max_new_tokens=NEW_TOKENS,
                                 return_dict_in_generate=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the caller's own use of the name its release deprecates
        second = speculative_generate(target, first.sequences, hs.PromptLookupDrafter(), max_new_tokens=NEW_TOKENS,
                                      **{name: getattr(first, CACHE_FIELD)})
    assert torch.equal(second, zoo.reference("llama", "random", max_new_tokens=2 * NEW_TOKENS))


def test_two_different_caches_are_refused():
    with pytest.raises(ValueError, match=r"Two caches were passed, cache= and past_key_values="):
        passed_cache({"cache": DynamicCache(), "past_key_values": DynamicCache()})


# ---------------------------------------------------------------- no warning from one speculative call


@contextmanager
def every_warning():
    """Collects every Python warning (whatever module it is attributed to: torch's `Module.__call__` for a
    deprecated forward argument) and every transformers log record at WARNING or above (`warning_once`'s memory
    cleared, so one an earlier test caused shows again)."""
    with transformers_warnings() as records, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught, records


def _mtp_case(zoo):
    target, mtp_model = build_mtp_target("deepseek_v3")
    return target, hs.MTPDrafter(mtp_model)


def _gemma4_case(zoo):
    """A tiny Gemma 4 target and assistant; a batch runs with a cache of full-attention layers (the window covers
    every slot), as `cache=DynamicCache()` gives."""
    unsupported = gemma4_assistant_unsupported()
    if unsupported is not None:
        pytest.skip(str(unsupported))
    target, assistant = build_gemma4()
    return target, hs.Gemma4AssistantDrafter(assistant)


# (target, drafter) per drafter family that runs a forward with a cache of ours
DRAFT_CASES = {
    "prompt_lookup": lambda zoo: (zoo.target("llama"), hs.PromptLookupDrafter()),
    "draft_model": lambda zoo: (zoo.target("llama"), hs.DraftModelDrafter(zoo.noisy_draft("llama"))),
    "draft_model_tree": lambda zoo: (zoo.target("llama"),
                                     hs.TreeDrafter(zoo.noisy_draft("llama"), [(0,), (1,), (0, 0)])),
    "layer_skip": lambda zoo: (zoo.target("llama"), hs.LayerSkipDrafter(exit_layer=1)),
    "layer_skip_gpt_neox": lambda zoo: (zoo.target("gpt_neox"), hs.LayerSkipDrafter(exit_layer=1)),
    "eagle3": lambda zoo: (build_model("llama", num_layers=4, seed=1), hs.EagleDrafter(random_eagle3())),
    "mtp": _mtp_case,
    "dflash": lambda zoo: (zoo.target("llama"), hs.DFlashDrafter(build_dflash(zoo.target("llama")))),
    "gemma4_assistant": _gemma4_case,
    "hybrid": lambda zoo: (zoo.target("llama"), hs.HybridDrafter(hs.SuffixDrafter(),
                                                                 hs.DraftModelDrafter(zoo.noisy_draft("llama")))),
}


@pytest.mark.parametrize("case", DRAFT_CASES)
@pytest.mark.parametrize("batch_size", [1, 2])
def test_one_speculative_call_raises_no_warning_at_all(zoo, case, batch_size):
    target, drafter = DRAFT_CASES[case](zoo)
    ids = prompt_ids("random").expand(batch_size, -1)
    cache = {} if case != "gemma4_assistant" or batch_size == 1 else cache_kwargs(target, DynamicCache())
    with every_warning() as (caught, logged):
        out = speculative_generate(target, ids, drafter, max_new_tokens=NEW_TOKENS, return_dict_in_generate=True,
                                   pad_token_id=0, **cache)
    assert [f"{w.category.__name__}: {w.message} ({w.filename})" for w in caught] == []
    assert [record.getMessage() for record in logged] == []
    assert out.sequences.shape == (batch_size, ids.shape[1] + NEW_TOKENS)


def test_the_collector_sees_a_deprecated_forward_argument():
    """The control: a warning attributed to torch's module code, which pyproject's filter would miss."""
    target = build_target("llama")
    old_name = "past_key_values" if cache_argument(target) == "cache" else None
    with every_warning() as (caught, logged):
        transformers_logging.get_logger("transformers.generation.utils").warning_once("a warning")
        if old_name is not None:
            target(prompt_ids("random"), **{old_name: DynamicCache(config=target.config)})
    assert [record.getMessage() for record in logged] == ["a warning"]
    assert old_name is None or any("past_key_values" in str(w.message) for w in caught)


# ---------------------------------------------------------------- caches that cannot be cropped


def tiny_hybrid():
    """A tiny Qwen3-Next: a gated-DeltaNet (linear-attention) layer, whose cache keeps a recurrent state, then a
    full-attention layer."""
    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"])
    return Qwen3NextForCausalLM(config).eval()


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_cache_that_cannot_be_cropped_is_refused_before_any_forward(zoo, role):
    hybrid = tiny_hybrid()
    target = hybrid if role == "target" else zoo.target("llama")
    drafter = hs.PromptLookupDrafter() if role == "target" else hs.DraftModelDrafter(hybrid)
    forwards = []
    handles = [model.register_forward_pre_hook(lambda *_: forwards.append(1)) for model in (hybrid, target)]
    try:
        with pytest.raises(ValueError, match=r"cache layers \['LinearAttentionLayer'\] cannot do .*layer types: "
                                             r"\['full_attention', 'linear_attention'\]\): use plain generate"):
            speculative_generate(target, torch.tensor([[1, 2, 3, 4]]), drafter, max_new_tokens=NEW_TOKENS)
    finally:
        for handle in handles:
            handle.remove()
    assert forwards == []
