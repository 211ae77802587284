"""The speculative decoding loop: `generate` (a transformers `custom_generate` callable) and `enable(model)`."""

import copy
import functools
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList, StopStringCriteria

from .cache import check_batch_support, check_tree_support, passed_cache, prepare_cache, slots_per_row
from .checks import check_attention, check_batch, check_input_ids, check_inputs, check_synced_gpus, left_padding
from .compiled import compiled_steps
from .config import SpeculativeConfig
from .drafters import Drafter
from .entry import ENABLED_ATTRIBUTE, is_enabled
from .floor import PlainFloor
from .loop import SpeculativeLoop
from .outputs import SpeculativeGenerateOutput
from .schedules import check_schedule, make_schedule
from .verifiers import Verifier, resolve_verifier

@dataclass(frozen=True)
class _Built:
    """A drafter and verifier built from a config, and what they were built for (see `_from_config`)."""

    settings: dict  # config.to_dict() when built: configs are mutable, so a snapshot, compared by value
    device: str
    dtype: torch.dtype
    tokenizer: object  # compared by identity (tokenizers define no equality)
    drafter: Drafter
    verifier: Verifier | None


# the model attribute that keeps the last `_Built` of `generate(speculative_config=...)`
BUILT_ATTRIBUTE = "_hf_speculators_built"


def _from_config(model, drafter, verifier, schedule, speculative_config, target_tokenizer) -> tuple:
    """The (drafter, verifier, schedule name) of the call: built from `speculative_config` when given; `verifier=`
    and `num_draft_tokens_schedule=` win over the config's.

    The build is kept on the model instance (`BUILT_ATTRIBUTE`) and reused while the config's fields, the model's
    device and dtype and the tokenizer are the same, so a draft model loads once, not on every call. A drafter that
    converts its module to each call's target itself (`converts_per_call`, the learned heads) is reused across
    devices and dtypes too: nothing is loaded from disk again. Kept on the
    instance rather than in a `weakref.WeakKeyDictionary` keyed by the model: a drafter may hold the model (layer
    skip drafts with its layers), and a weak-key entry whose value refers to its key is never freed; on the
    instance it is an ordinary reference cycle that dies with the model. One build per model: a changed config
    replaces it, so no draft model is held that no call uses any more.
    """
    if speculative_config is None:
        return drafter, verifier, check_schedule(schedule)
    if drafter is not None:
        raise ValueError(
            "Pass either candidate_generator= (a drafter) or speculative_config= (settings to build one), not both."
        )
    if not isinstance(speculative_config, SpeculativeConfig):
        raise ValueError(
            "speculative_config= must be a hf_speculators.SpeculativeConfig, e.g. "
            f"SpeculativeConfig.from_pretrained('demo-prompt-lookup'); got {type(speculative_config).__name__}."
        )
    schedule = check_schedule(schedule if schedule is not None else speculative_config.num_draft_tokens_schedule)
    settings, device, dtype = speculative_config.to_dict(), str(model.device), model.dtype
    built = model.__dict__.get(BUILT_ATTRIBUTE)
    if built is None or (built.settings, built.tokenizer) != (settings, target_tokenizer) or (
            (built.device, built.dtype) != (device, dtype) and not built.drafter.converts_per_call):
        setattr(model, BUILT_ATTRIBUTE, None)  # free the previous draft model before loading the next one
        drafter, config_verifier = speculative_config.build(model, target_tokenizer)
        built = _Built(settings, device, dtype, target_tokenizer, drafter, config_verifier)
        setattr(model, BUILT_ATTRIBUTE, built)
    return built.drafter, verifier if verifier is not None else built.verifier, schedule


def _default_generator(device: torch.device) -> torch.Generator:
    """A generator seeded from torch's global RNG, so that `torch.manual_seed(s)` makes a call reproducible."""
    return torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**62, (1,))))


@torch.no_grad()
def generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    generation_config: GenerationConfig | None = None,
    synced_gpus: bool = False,
    candidate_generator: Drafter | None = None,
    verifier: str | Verifier | None = None,
    generator: torch.Generator | None = None,
    speculative_streamer=None,
    target_tokenizer=None,
    speculative_config: SpeculativeConfig | None = None,
    num_draft_tokens_schedule: str | None = None,
    plain_floor: bool | None = None,
    **model_kwargs,
) -> torch.LongTensor | SpeculativeGenerateOutput:
    """Speculative decoding with the `custom_generate` signature of transformers' `generate`.

    Use it as `model.generate(**inputs, custom_generate=hf_speculators.generate, candidate_generator=drafter)`
    (or `speculative_config=config` instead of a drafter), or call `hf_speculators.enable(model)` once and pass
    `candidate_generator=` or `speculative_config=` to `model.generate` directly (which also carries
    `streamer=`, `tokenizer=` and `stop_strings=`). Each step the drafter proposes draft
    tokens, the target scores all of them in one forward, the verifier keeps a prefix plus one bonus or
    recovered token, and the rejected tokens are dropped from the target's KV cache (speculative decoding,
    Leviathan et al. 2023; speculative sampling, Chen et al. 2023).

    Args:
        model (`PreTrainedModel`): the target, a decoder-only causal LM (transformers passes it).
        input_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`): the prompt, or left-padded prompts
            (with their `attention_mask`): one `SpeculativeLoop` serves both, each row verified on its
            own, every row exactly its own plain output (greedy) or lossless (sampling).
        logits_processor (`LogitsProcessorList`): as prepared by transformers' `generate`.
        stopping_criteria (`StoppingCriteriaList`): as prepared by transformers' `generate`.
        generation_config (`GenerationConfig`): as prepared by transformers' `generate`.
        synced_gpus (`bool`): must be `False`: multi-GPU synchronisation is not supported (a clear error; transformers
            drops `synced_gpus=` before calling a custom generate callable, so it is caught by `enable(model)`'s
            wrapper).
        candidate_generator (`Drafter`): the drafter, e.g. `PromptLookupDrafter()` or `DraftModelDrafter(draft)`.
            Required unless `speculative_config` is given.
        verifier (`str` or `Verifier`, *optional*): `"exact"`, `"rejection"` or a `Verifier`; by default exact
            for greedy decoding and rejection sampling when `do_sample=True`.
        generator (`torch.Generator`, *optional*): the only source of randomness; by default one seeded from
            torch's global RNG.
        speculative_streamer (`BaseStreamer`, *optional*): receives the prompt, then every committed token once.
            transformers does not pass `streamer=` to custom_generate callables; `enable(model)` maps it here.
        target_tokenizer (`PreTrainedTokenizerBase`, *optional*): the target's tokenizer, for the drafter's
            vocabulary check; `enable(model)` maps `tokenizer=` here.
        speculative_config (`SpeculativeConfig`, *optional*): settings to build the drafter and verifier from,
            instead of `candidate_generator`; an explicit `verifier=` overrides the config's verification. The
            drafter is built on the first call and reused by later calls with equal settings on this model (a
            changed config, tokenizer, device or dtype rebuilds it; it is kept on the model and dies with it).
        num_draft_tokens_schedule (`str`, *optional*): how many draft tokens each step asks for (a key of
            `hf_speculators.schedules.SCHEDULES`): `"constant"` (the default, or the config's): the drafter's
            `num_draft_tokens` every step; `"heuristic"`: transformers' `num_assistant_tokens_schedule="heuristic"`
            rule (+2 after a fully accepted draft, -1 otherwise, from `num_draft_tokens`); `"goodput"`: the length
            in `0..num_draft_tokens` of the highest expected tokens per second, from the acceptance and costs
            measured during the call (0: a plain one-token step). For a tree it is the depth.
        plain_floor (`bool`, *optional*): beneath the schedule, each row runs plain one-token steps while its
            drafts, as measured in this call, bring fewer tokens per second than plain steps would, and drafts
            again now and then to check (`hf_speculators.floor`; `speculative_stats.num_floor_steps` counts the
            plain steps). `False`: every step drafts what the schedule asks. Default: on under greedy decoding
            (the output is the same either way), off under sampling, where the floor's clock reads would make a
            seeded sample differ from run to run (still lossless); pass `True` to have it there too. Off by default
            for a drafter with a floor of its own (`Drafter.has_own_floor`: `HybridDrafter`, the default job's,
            which holds its model drafter back itself): the loop's floor would judge its cheap model-free drafts by
            its model drafts' costs.

    Returns:
        `torch.LongTensor` of shape `(batch_size, sequence_length + new_tokens)` (rows that stopped early padded
        with the pad token), or with `return_dict_in_generate=True` a `SpeculativeGenerateOutput` whose
        `speculative_stats` holds the acceptance figures (for a batch, with `row_stats`; no cache).

    Raises:
        `ValueError`: before any forward, for a missing drafter, both a drafter and a speculative config, a
            config that cannot be built (see `SpeculativeConfig.build`), an unknown `num_draft_tokens_schedule`,
            beam search, `num_return_sequences > 1`, an empty prompt, a padded single prompt, a static cache that
            cannot serve (sliding-window layers, a prefilled one too short), token trees on a static cache, for
            a batch: right padding, a drafter that cannot batch, token trees, a streamer, `output_scores` or
            `output_logits`, no pad or EOS token, a prefilled cache or non-full-attention cache layers; an unknown
            verifier, a verifier that cannot serve the decoding mode, or a drafter built for another vocabulary.
    """
    if generation_config is None:
        raise ValueError(
            "Call speculative generate through transformers: model.generate(**inputs, "
            "custom_generate=hf_speculators.generate, candidate_generator=drafter), or hf_speculators.enable(model) "
            "then model.generate(**inputs, candidate_generator=drafter); it needs the generation config they prepare."
        )
    check_input_ids(input_ids)
    logits_processor = logits_processor if logits_processor is not None else LogitsProcessorList()
    stopping_criteria = stopping_criteria if stopping_criteria is not None else StoppingCriteriaList()
    candidate_generator, verifier, schedule = _from_config(
        model, candidate_generator, verifier, num_draft_tokens_schedule, speculative_config, target_tokenizer
    )
    check_synced_gpus(synced_gpus)
    check_inputs(model, input_ids, generation_config, candidate_generator, model_kwargs)
    verifier = resolve_verifier(verifier, generation_config.do_sample)
    batch_size = input_ids.shape[0]
    check_attention(model, candidate_generator, batch_size)
    pad_token_id = check_batch(generation_config, speculative_streamer) if batch_size > 1 else 0
    num_pads = left_padding(model_kwargs.get("attention_mask"), input_ids) if batch_size > 1 else [0]
    num_slots = slots_per_row(generation_config.max_length, candidate_generator.num_draft_tokens, batch_size)
    cache = prepare_cache(passed_cache(model_kwargs), model.config, num_slots)
    if batch_size > 1:
        check_batch_support(cache, model.config, generation_config.max_length)
    if candidate_generator.drafts_trees:
        check_tree_support(cache, model.config, generation_config.max_length)
    generator = generator if generator is not None else _default_generator(_logits_device(model, input_ids))
    schedule = make_schedule(schedule, candidate_generator.num_draft_tokens)
    compiled = compiled_steps(model, cache, generation_config, candidate_generator)
    loop = SpeculativeLoop(model, candidate_generator, verifier, schedule, generation_config, logits_processor,
                           stopping_criteria, generator, target_tokenizer, speculative_streamer, pad_token_id,
                           compiled=compiled, floor=_floor(plain_floor, generation_config, candidate_generator))
    loop.prefill(input_ids, num_pads, cache)
    while not loop.step():
        pass
    output = loop.output()
    return output if generation_config.return_dict_in_generate else output.sequences



def _floor(plain_floor: bool | None, generation_config: GenerationConfig, drafter) -> PlainFloor | None:
    """The call's floor: `plain_floor`, or by default on under greedy decoding for a drafter without a floor of its
    own (see `generate`)."""
    if plain_floor is None:
        plain_floor = not generation_config.do_sample and not drafter.has_own_floor
    return PlainFloor() if plain_floor else None

def _logits_device(model, input_ids: torch.LongTensor) -> torch.device:
    """Where the target's logits (and so every sampling draw) live: its LM head's device, which differs from the
    input's under `device_map` sharding."""
    head = model.get_output_embeddings()
    return head.weight.device if head is not None else input_ids.device


def _take_stop_strings(model, kwargs: dict):
    """Removes the stop strings from `kwargs` and the generation config, and returns them.

    transformers builds its `StopStringCriteria` only with a tokenizer, which it does not keep for custom
    generate callables; the wrapper builds the criteria itself instead. A config that holds stop strings is
    replaced by a copy without them, into which the call's generation arguments are merged: transformers
    deprecates passing a `generation_config` together with generation arguments.
    """
    config = kwargs.get("generation_config") or model.generation_config
    stop_strings = kwargs.pop("stop_strings", None) or config.stop_strings
    if config.stop_strings:
        config = copy.deepcopy(config)
        config.stop_strings = None
        kwargs.pop("generation_config", None)
        model_kwargs = config.update(**kwargs)  # sets the generation arguments, returns the others
        kwargs.clear()
        kwargs.update(model_kwargs, generation_config=config)
    return stop_strings


def enable(model):
    """Lets `model.generate` take `candidate_generator=` or `speculative_config=` (and `verifier=`, `generator=`,
    `num_draft_tokens_schedule=`).

    Only this model instance changes: its `generate` becomes a wrapper that, when a drafter or a speculative
    config is given, calls the original with `custom_generate=hf_speculators.generate` and carries what
    transformers drops for custom callables: `streamer=` (streamed token by token as usual), `tokenizer=` and
    `stop_strings=` (turned into a `StopStringCriteria`). Without either it is plain `generate`. Calling `enable`
    twice is harmless.

    Args:
        model (`PreTrainedModel`): a decoder-only causal LM.

    Returns:
        `PreTrainedModel`: the same `model`, for chaining.

    Raises:
        `ValueError` (from the wrapper): `synced_gpus=True` with speculation; `stop_strings=` without `tokenizer=`; `verifier=`, `generator=` or
            `num_draft_tokens_schedule=` without `candidate_generator=` or `speculative_config=`.
    """
    if is_enabled(model):
        return model
    plain_generate = model.generate

    @functools.wraps(plain_generate)
    def generate_with_speculation(*args, candidate_generator=None, speculative_config=None, verifier=None,
                                  generator=None, num_draft_tokens_schedule=None, streamer=None, tokenizer=None,
                                  stopping_criteria=None, synced_gpus=None, **kwargs):
        if candidate_generator is None and speculative_config is None:
            if verifier is not None or generator is not None or num_draft_tokens_schedule is not None:
                raise ValueError(
                    "verifier=, generator= and num_draft_tokens_schedule= need candidate_generator= (a drafter) or "
                    "speculative_config= to take effect."
                )
            return plain_generate(*args, streamer=streamer, tokenizer=tokenizer, stopping_criteria=stopping_criteria,
                                  synced_gpus=synced_gpus, **kwargs)
        check_synced_gpus(bool(synced_gpus))  # transformers would drop it before a custom generate callable
        custom = kwargs.pop("custom_generate", generate)
        if custom is not generate:
            raise ValueError(f"custom_generate={custom!r} cannot be combined with speculative decoding.")
        criteria = StoppingCriteriaList(stopping_criteria or [])
        stop_strings = _take_stop_strings(model, kwargs)
        if stop_strings:
            if tokenizer is None:
                raise ValueError("stop_strings= needs tokenizer= to find the strings in the generated tokens.")
            criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
        return plain_generate(
            *args, custom_generate=generate, candidate_generator=candidate_generator,
            speculative_config=speculative_config, verifier=verifier, generator=generator,
            num_draft_tokens_schedule=num_draft_tokens_schedule, speculative_streamer=streamer, target_tokenizer=tokenizer, stopping_criteria=criteria, **kwargs,
        )

    setattr(generate_with_speculation, ENABLED_ATTRIBUTE, True)
    model.generate = generate_with_speculation
    return model
