"""The speculative decoding loop: `generate` (a transformers `custom_generate` callable) and `enable(model)`."""

import copy
import functools
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList, StopStringCriteria

from .batch_decoding import BatchedSpeculativeDecoding, left_padding
from .cache import check_batch_support, check_tree_support, keep_accepted, prepare_cache, truncate
from .config import SpeculativeConfig
from .drafters import Drafter
from .metrics import SpeculativeStats, clock
from .outputs import SpeculativeGenerateOutput, commit_tokens
from .sampling import RowOfBatch, process_logits
from .schedules import DraftLengthSchedule, check_schedule, make_schedule
from .tree import TokenTree
from .types import Draft
from .verifiers import Verifier, resolve_verifier

# model_kwargs that transformers prepares for a decoding method; the loop sets its own forward arguments
HANDLED_MODEL_KWARGS = {"attention_mask", "position_ids", "use_cache", "past_key_values", "logits_to_keep"}


def _check_inputs(model, input_ids: torch.LongTensor, generation_config: GenerationConfig, drafter, model_kwargs) -> None:
    """Raises `ValueError` for every input the loop does not serve, before any forward runs."""
    if not isinstance(drafter, Drafter):
        raise ValueError(
            "Speculative generate needs candidate_generator= set to a drafter, e.g. "
            "hf_speculators.PromptLookupDrafter() or hf_speculators.DraftModelDrafter(draft_model), or "
            f"speculative_config= set to a hf_speculators.SpeculativeConfig; got {type(drafter).__name__}."
        )
    if model.config.is_encoder_decoder:
        raise ValueError("Speculative generate supports decoder-only models; this model is an encoder-decoder.")
    if generation_config.num_beams > 1:
        raise ValueError(f"Beam search (num_beams={generation_config.num_beams}) is not supported: set num_beams=1.")
    if generation_config.num_return_sequences > 1:
        raise ValueError(
            f"num_return_sequences={generation_config.num_return_sequences} is not supported: set it to 1 and "
            "repeat the prompt in the batch instead (one row per sample)."
        )
    if input_ids.shape[1] == 0:
        raise ValueError("The prompt is empty: pass at least one token (e.g. the BOS token).")
    attention_mask = model_kwargs.get("attention_mask")
    if input_ids.shape[0] == 1 and attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("The attention mask has padding; a single sequence needs none. Pass the prompt unpadded.")
    unknown = sorted(k for k, v in model_kwargs.items() if k not in HANDLED_MODEL_KWARGS and v is not None)
    if unknown:
        raise ValueError(f"Speculative generate does not support these model inputs: {unknown}.")


def _check_batch(drafter: Drafter, generation_config: GenerationConfig, streamer) -> int:
    """Raises `ValueError` for what a batch (batch size > 1) does not serve; returns the pad token id."""
    drafter.check_batch_support()
    if streamer is not None:
        raise ValueError("A streamer takes one sequence: stream with batch size 1, or drop streamer= for a batch.")
    if generation_config.output_scores or generation_config.output_logits:
        raise ValueError(
            "output_scores and output_logits are not supported with batch size > 1 (rows take different numbers "
            "of steps): use batch size 1 for them."
        )
    eos = generation_config.eos_token_id
    pad = generation_config.pad_token_id
    pad = pad if pad is not None else (eos if isinstance(eos, int) or eos is None else eos[0])
    if pad is None:
        raise ValueError(
            "A batch needs pad_token_id (or eos_token_id) to pad the shorter rows: pass pad_token_id= to generate."
        )
    return int(pad)


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
    device and dtype and the tokenizer are the same, so a draft model loads once, not on every call. Kept on the
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
    if built is None or (built.settings, built.device, built.dtype, built.tokenizer) != (
            settings, device, dtype, target_tokenizer):
        setattr(model, BUILT_ATTRIBUTE, None)  # free the previous draft model before loading the next one
        drafter, config_verifier = speculative_config.build(model, target_tokenizer)
        built = _Built(settings, device, dtype, target_tokenizer, drafter, config_verifier)
        setattr(model, BUILT_ATTRIBUTE, built)
    return built.drafter, verifier if verifier is not None else built.verifier, schedule


class _SpeculativeDecoding:
    """The state of one speculative generate call: models, cache, processors, stats and optional outputs."""

    def __init__(self, model, drafter: Drafter, verifier: Verifier, schedule: DraftLengthSchedule, cache,
                 generation_config, logits_processor, stopping_criteria, generator, streamer):
        self.model, self.drafter, self.verifier, self.schedule, self.cache = model, drafter, verifier, schedule, cache
        self.generation_config, self.generator, self.streamer = generation_config, generator, streamer
        self.logits_processor, self.stopping_criteria = logits_processor, stopping_criteria
        self.stats = SpeculativeStats(lossless=verifier.lossless, verifier=verifier.name, drafter=repr(drafter))
        self.scores = [] if generation_config.output_scores else None
        self.raw_logits = [] if generation_config.output_logits else None
        self.device = model.device  # model.device walks the parameters: read it once

    def _clock(self) -> float:
        return clock(self.device)

    def prefill(self, input_ids: torch.LongTensor) -> None:
        """Puts all prompt tokens but the last into the cache; the last one is pending for the first step.

        The drafter's `target_forward` runs it, so drafters that read the target's hidden states see the prompt's."""
        start = self._clock()
        truncate(self.cache, input_ids.shape[1] - 1)
        num_cached = self.cache.get_seq_length()
        if input_ids.shape[1] - 1 > num_cached:
            no_draft = TokenTree.chain(0, input_ids.device)
            self.drafter.target_forward(self.model, self.cache, input_ids[:, num_cached:-1], no_draft,
                                        input_ids.shape[1] - 1, 1)
            self.stats.num_target_forwards += 1
        self.stats.verify_time += self._clock() - start

    def step(self, input_ids: torch.LongTensor) -> tuple[torch.LongTensor, bool]:
        """One step: draft, one target forward, verify, compact the cache, commit. Returns (ids, finished)."""
        # 1. draft as deep as the schedule says and the length budget leaves room for (the next token takes one place)
        start = self._clock()
        num_cached = self.cache.get_seq_length()  # before drafting: a drafter may write into the cache (layer skip)
        budget = min(self.schedule.draft_length, self.generation_config.max_length - input_ids.shape[1] - 1)
        draft = self.drafter.propose(input_ids, budget) if budget > 0 else Draft.empty(input_ids.device)
        tree = draft.tree  # a chain is the tree whose every node has one child
        if not tree.is_chain:
            check_tree_support(self.cache)
        verify_start = self._clock()
        self.stats.draft_time += verify_start - start
        # 2. one target forward over the pending tokens and every draft node (a tree with its own 4D mask)
        step_ids = torch.cat([input_ids[:, num_cached:], draft.token_ids[None].to(input_ids.device)], dim=-1)
        logits = self.drafter.target_forward(self.model, self.cache, step_ids, tree, input_ids.shape[1],
                                             draft.num_nodes + 1)
        # 3. logits processors per row, each with the committed tokens and its node's path as the prefix
        prefixes = tree.prefixes(input_ids, draft.token_ids, range(-1, draft.num_nodes))
        scores = process_logits(self.logits_processor, prefixes, logits)  # [num_nodes + 1, vocab]
        # 4. verification keeps a root-to-leaf path of the draft and picks the next (bonus or recovered) token
        verdict = self.verifier(draft, scores, do_sample=self.generation_config.do_sample, generator=self.generator)
        # 5. keep the target's KV of the accepted path only
        keep_accepted(self.cache, verdict.accepted_nodes, draft.num_nodes)
        # 6. commit token by token so that EOS, max length and stop strings cut exactly where plain generate would
        new_tokens = torch.cat([draft.token_ids[verdict.accepted_nodes], verdict.next_token[None]])
        rows = [0] + [node + 1 for node in verdict.accepted_nodes.tolist()]  # the row of scores of each new token
        input_ids, committed, finished = self._commit(input_ids, new_tokens, rows, scores, logits)
        end = self._clock()
        self.stats.verify_time += end - verify_start
        self.stats.record(draft.num_nodes, min(verdict.num_accepted, committed), committed, depth=tree.depth,
                          draft_length=budget)
        # 7. the schedule learns from what this step cost and accepted (timings from the clock reads above)
        self.schedule.update(budget, draft.num_nodes, tree.depth, verdict.num_accepted, verify_start - start,
                             end - verify_start)
        return input_ids, finished

    def _commit(self, input_ids, new_tokens, rows, scores, logits) -> tuple[torch.LongTensor, int, bool]:
        """Appends `new_tokens` (token i scored by row `rows[i]`) until a stopping criterion is met."""
        input_ids, committed, finished = commit_tokens(input_ids, new_tokens, scores[rows], self.stopping_criteria)
        if self.scores is not None:
            self.scores.extend(scores[row : row + 1] for row in rows[:committed])
        if self.raw_logits is not None:
            self.raw_logits.extend(logits[row : row + 1].float() for row in rows[:committed])
        if self.streamer is not None:
            self.streamer.put(new_tokens[:committed].cpu())
        return input_ids, committed, finished

    def output(self, input_ids: torch.LongTensor) -> SpeculativeGenerateOutput:
        truncate(self.cache, input_ids.shape[1] - 1)  # as after plain generate: every token but the last
        return SpeculativeGenerateOutput(
            sequences=input_ids,
            scores=None if self.scores is None else tuple(self.scores),
            logits=None if self.raw_logits is None else tuple(self.raw_logits),
            past_key_values=self.cache,
            speculative_stats=self.stats,
        )


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
            (with their `attention_mask`): a batch runs as `BatchedSpeculativeDecoding`, each row verified on its
            own, every row exactly its own plain output (greedy) or lossless (sampling).
        logits_processor, stopping_criteria, generation_config: as prepared by transformers' `generate`.
        synced_gpus (`bool`): accepted for the signature; multi-GPU synchronisation is not supported.
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

    Returns:
        `torch.LongTensor` of shape `(batch_size, sequence_length + new_tokens)` (rows that stopped early padded
        with the pad token), or with `return_dict_in_generate=True` a `SpeculativeGenerateOutput` whose
        `speculative_stats` holds the acceptance figures (for a batch, with `row_stats`; no `past_key_values`).

    Raises:
        `ValueError`: before any forward, for a missing drafter, both a drafter and a speculative config, a
            config that cannot be built (see `SpeculativeConfig.build`), an unknown `num_draft_tokens_schedule`,
            beam search, `num_return_sequences > 1`, an empty prompt, a padded single prompt, a static cache, for
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
    logits_processor = logits_processor if logits_processor is not None else LogitsProcessorList()
    stopping_criteria = stopping_criteria if stopping_criteria is not None else StoppingCriteriaList()
    candidate_generator, verifier, schedule = _from_config(
        model, candidate_generator, verifier, num_draft_tokens_schedule, speculative_config, target_tokenizer
    )
    _check_inputs(model, input_ids, generation_config, candidate_generator, model_kwargs)
    verifier = resolve_verifier(verifier, generation_config.do_sample)
    batched = input_ids.shape[0] > 1
    pad_token_id = _check_batch(candidate_generator, generation_config, speculative_streamer) if batched else None
    num_pads = left_padding(model_kwargs.get("attention_mask"), input_ids) if batched else None
    cache = prepare_cache(model_kwargs.get("past_key_values"), model.config)
    if batched:
        check_batch_support(cache)
    generator = generator if generator is not None else _default_generator(input_ids.device)
    # a batch's drafter processes each row on its own, as row 0 of the batch (draft scores only steer acceptance)
    draft_processors = RowOfBatch(logits_processor, input_ids.shape[0], 0) if batched else logits_processor
    candidate_generator.prepare(model, generation_config, draft_processors, generator, target_tokenizer, cache)
    schedule = make_schedule(schedule, candidate_generator.num_draft_tokens)
    if batched:
        output = _generate_batch(model, candidate_generator, verifier, schedule, cache, generation_config,
                                 logits_processor, stopping_criteria, generator, pad_token_id, input_ids, num_pads)
    else:
        output = _generate_one(model, candidate_generator, verifier, schedule, cache, generation_config,
                               logits_processor, stopping_criteria, generator, speculative_streamer, input_ids)
    return output if generation_config.return_dict_in_generate else output.sequences


def _generate_one(model, drafter, verifier, schedule, cache, generation_config, logits_processor,
                  stopping_criteria, generator, streamer, input_ids) -> SpeculativeGenerateOutput:
    """The loop for one sequence."""
    run = _SpeculativeDecoding(model, drafter, verifier, schedule, cache, generation_config, logits_processor,
                               stopping_criteria, generator, streamer)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    run.prefill(input_ids)
    finished = False
    while not finished:
        input_ids, finished = run.step(input_ids)
    if streamer is not None:
        streamer.end()
    return run.output(input_ids)


def _generate_batch(model, drafter, verifier, schedule, cache, generation_config, logits_processor,
                    stopping_criteria, generator, pad_token_id, input_ids, num_pads) -> SpeculativeGenerateOutput:
    """The loop for a batch of left-padded prompts (`BatchedSpeculativeDecoding`)."""
    run = BatchedSpeculativeDecoding(model, drafter, verifier, schedule, cache, generation_config, logits_processor,
                                     stopping_criteria, generator, pad_token_id)
    run.prefill(input_ids, num_pads)
    while not run.step():
        pass
    return run.output()


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
        The same `model`, for chaining.

    Raises:
        `ValueError` (from the wrapper): `stop_strings=` without `tokenizer=`; `verifier=`, `generator=` or
            `num_draft_tokens_schedule=` without `candidate_generator=` or `speculative_config=`.
    """
    if getattr(model.generate, "_hf_speculators_enabled", False):
        return model
    plain_generate = model.generate

    @functools.wraps(plain_generate)
    def generate_with_speculation(*args, candidate_generator=None, speculative_config=None, verifier=None,
                                  generator=None, num_draft_tokens_schedule=None, streamer=None, tokenizer=None,
                                  stopping_criteria=None, **kwargs):
        if candidate_generator is None and speculative_config is None:
            if verifier is not None or generator is not None or num_draft_tokens_schedule is not None:
                raise ValueError(
                    "verifier=, generator= and num_draft_tokens_schedule= need candidate_generator= (a drafter) or "
                    "speculative_config= to take effect."
                )
            return plain_generate(*args, streamer=streamer, tokenizer=tokenizer, stopping_criteria=stopping_criteria,
                                  **kwargs)
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

    generate_with_speculation._hf_speculators_enabled = True
    model.generate = generate_with_speculation
    return model
