"""The benchmark's engines: the `generate` keywords that run each method, by hf_speculators (`custom_generate`) or
by transformers' own assisted generation (the baselines), and the assistant settings transformers is pinned to."""

import copy
from contextlib import contextmanager

from transformers import CompileConfig

from ...compiled import COMPILED_DEVICE_TYPES
from ...config.build import build_drafter, build_verifier
from ...config.methods import LOADED_DRAFT
from ...decoding import generate
from ...schedules import check_schedule
from ...verifiers import resolve_verifier
from .settings import BenchMethod, baseline_of

# transformers reads these from the ASSISTANT's generation_config; generate() keywords for them are ignored (5.23)
PINNED_ASSISTANT_CONFIG = {"num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}


def generate_kwargs(method: BenchMethod, target, draft, do_sample: bool, tokenizer=None,
                    draft_tokenizer=None) -> dict:
    """The `model.generate` keywords that select `method` (decoding mode and lengths are added by the caller).

    Args:
        method (`BenchMethod`): the method and its engine.
        target (`PreTrainedModel`): the target model.
        draft (`PreTrainedModel`, *optional*): the loaded draft model, for the methods that take one.
        do_sample (`bool`): whether the run samples (it picks our default verifier).
        tokenizer, draft_tokenizer (`PreTrainedTokenizerBase`, *optional*): the target's and the draft's; they reach
            our drafters (a draft of another tokenizer) and transformers' universal assisted generation.
    """
    config = method.config
    if method.engine == "transformers":  # the spec's `Baseline`; its draft length pinned: pinned_assistant_config
        baseline = baseline_of(method)
        keywords = baseline.kwargs(config, target, draft, lambda: build_drafter(config, target))
        if baseline.universal:
            keywords.update(tokenizer=tokenizer, assistant_tokenizer=draft_tokenizer)
        if baseline.universal and do_sample:  # transformers 5.23 prunes the assistant's LM head in place: a copy
            keywords["assistant_model"] = copy.deepcopy(draft)
        return keywords
    loaded = {"draft_model": draft, "draft_tokenizer": draft_tokenizer} if config.draft_model == LOADED_DRAFT else {}
    verifier = resolve_verifier(build_verifier(config), do_sample)
    return {"custom_generate": generate, "candidate_generator": build_drafter(config, target, tokenizer, **loaded),
            "verifier": verifier, "num_draft_tokens_schedule": check_schedule(config.num_draft_tokens_schedule),
            "target_tokenizer": tokenizer, "plain_floor": method.plain_floor}


def compiled_kwargs(target) -> dict:
    """The `generate` keywords of compiled decoding, the same for plain decoding and every method: transformers'
    static cache (`cache_implementation="static"`) and its default `CompileConfig` (inductor, `"reduce-overhead"`),
    told to compile on devices transformers compiles on only when told (`_compile_all_devices`: the CPU)."""
    config = CompileConfig()
    if target.device.type not in COMPILED_DEVICE_TYPES:
        config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}


@contextmanager
def pinned_assistant_config(draft, num_draft_tokens: int, confidence_threshold: float = 0.0):
    """Pins transformers' assisted generation to `num_draft_tokens` per step, constant, and the confidence cut-off
    (none by default).

    transformers 5.23 reads these settings from the assistant's own `generation_config` (defaults: 20 tokens,
    threshold 0.4) and ignores them as `generate()` keywords, so they are set there and restored afterwards.
    """
    config = draft.generation_config
    pinned = {"num_assistant_tokens": num_draft_tokens, **PINNED_ASSISTANT_CONFIG,
              "assistant_confidence_threshold": confidence_threshold}
    saved = {key: getattr(config, key, None) for key in pinned}
    try:
        for key, value in pinned.items():
            setattr(config, key, value)
        yield
    finally:
        for key, value in saved.items():
            setattr(config, key, value)
