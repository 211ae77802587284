"""The benchmark's engines: the `generate` keywords that run each method, by hf_speculators (`custom_generate`) or
by transformers' own assisted generation (the baselines), and the assistant settings transformers is pinned to."""

import copy
from contextlib import contextmanager

from ...config.build import build_drafter, build_verifier
from ...config.methods import LOADED_DRAFT
from ...decoding import generate
from ...schedules import check_schedule
from ...verifiers import resolve_verifier
from .settings import BenchMethod

# transformers' methods whose draft length is the assistant's generation_config (pinned); MTP's and DFlash's is the
# model's own (its MTP layers, its block)
PINNED_TRANSFORMERS_METHODS = ("draft-model", "layer-skip", "gemma4-assistant")
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
    if method.engine == "transformers" and config.method == "dflash":  # the drafter's checkpoint as the assistant
        return {"speculation_type": "dflash", "assistant_model": build_drafter(config, target).model}
    if method.engine == "transformers" and config.method == "gemma4-assistant":  # its tokens: pinned_assistant_config
        return {"assistant_model": build_drafter(config, target).module_for(target.device, target.dtype)}
    if method.engine == "transformers":
        universal = {"tokenizer": tokenizer, "assistant_tokenizer": draft_tokenizer} if method.universal else {}
        if method.universal and do_sample:  # transformers 5.23 prunes the assistant's LM head in place: a copy
            universal["assistant_model"] = copy.deepcopy(draft)
        return {
            "prompt-lookup": {"prompt_lookup_num_tokens": config.resolved("num_draft_tokens"),
                              "max_matching_ngram_size": config.resolved("max_ngram_size")},
            # its tokens, schedule and threshold: pinned_assistant_config
            "draft-model": {"assistant_model": draft, **universal},
            "layer-skip": {"assistant_early_exit": config.exit_layer},  # the target is its own assistant
            "mtp": {"use_mtp": True},  # the MTP layers beside the target's checkpoint
        }[config.method]
    loaded = {"draft_model": draft, "draft_tokenizer": draft_tokenizer} if config.draft_model == LOADED_DRAFT else {}
    verifier = resolve_verifier(build_verifier(config), do_sample)
    return {"custom_generate": generate, "candidate_generator": build_drafter(config, target, tokenizer, **loaded),
            "verifier": verifier, "num_draft_tokens_schedule": check_schedule(config.num_draft_tokens_schedule),
            "target_tokenizer": tokenizer, "plain_floor": method.plain_floor}


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
