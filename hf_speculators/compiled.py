"""Compiled decoding steps: whether a call compiles the target's verify forward, and the fixed query width it runs at.

The switch is transformers' own (`GenerationMixin._valid_auto_compile_criteria` in 5.23 and 5.24): a static cache
(`cache_implementation="static"`, or a `StaticCache` passed), `disable_compile` unset, and a CUDA, XPU, Neuron or
TPU device, or any device when `generation_config.compile_config._compile_all_devices` is set (how the bench
compiles on the CPU, for plain decoding and ours alike). The forward is `model.get_compiled_call(compile_config)`,
the one transformers' plain decoding uses. Prefill forwards (each prompt's own length) run eagerly; every decoding
step's query is padded to `num_draft_tokens + 1` slots (gpt-fast's and vLLM's fixed verify width; a hybrid's
to the smallest of its two drafters' widths that holds it, `Drafter.draft_lengths`), its masks span
the static cache's length (`RaggedCache.query_inputs`), so after warm-up steps run one graph per batch size and
cache length bucket (`static_cache.length_bucket`): rows that finish keep their place in the batch
(`RaggedCache(fixed_rows=True)`). The draft model's forwards and an EAGLE head's chain forwards compile the same
way, over a static draft cache of their own (`DraftCompiler`); a greedy draft model's whole chain, its catch-up
and its one-token forwards, compiles as one graph (`run_draft_model_chain`). Drafters that read the target's hidden
states (EAGLE, Medusa) get them from the compiled forward; Medusa's heads and EAGLE's token trees run eagerly.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cache import slots_per_row
from .static_cache import draft_static_cache, is_static

COMPILED_DEVICE_TYPES = ("cuda", "xpu", "neuron", "tpu")  # where transformers compiles without being told


@dataclass(frozen=True)
class CompiledSteps:
    """How a call runs its decoding steps' target forwards.

    Args:
        forward (`Callable`): the compiled `model.__call__` (`PreTrainedModel.get_compiled_call`).
        widths (`tuple[int, ...]`): the query widths a step is padded to, increasing (each a draft length of
            `Drafter.draft_lengths` plus the pending token; past the last, a multiple of it): each a compiled graph.
    """

    forward: Callable
    widths: tuple[int, ...]


def compiles(model, cache, generation_config) -> bool:
    """Whether transformers' plain decoding would compile `model`'s forward with `cache` and `generation_config`
    (the rule of `GenerationMixin._valid_auto_compile_criteria`, quantizers and offloading aside: see `compiled_steps`)."""
    if generation_config.disable_compile or not is_static(cache):
        return False
    compile_config = generation_config.compile_config
    return model.device.type in COMPILED_DEVICE_TYPES or bool(
        compile_config is not None and compile_config._compile_all_devices)


def compilable(model) -> bool:
    """Whether transformers would compile `model` (quantizers and offloading; the rest is `compiles`): not with a
    quantizer that cannot compile, nor spread over devices with CPU or disk offload."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        return False
    devices = set(getattr(model, "hf_device_map", {}).values())
    return not ("disk" in devices or ("cpu" in devices and len(devices) > 1))


def run_draft_model(model, **kwargs):
    """`model(**kwargs)`: the frame a draft model's catch-up forwards compile as (`DraftModelDrafter`), a code object
    of its own. Compiling `model.__call__` instead would share dynamo's cache of that code object, and its limit of
    `torch._dynamo.config.recompile_limit` (8) graphs, with the target's graphs and transformers' plain decoding's:
    past it dynamo runs the frame eagerly. The chain steps compile as `run_draft_model_step`, so that each shape
    (cache bucket, rows) costs each frame one graph, not two."""
    return model(**kwargs)


def run_draft_model_step(model, **kwargs):
    """`model(**kwargs)`: the frame a draft model's chain steps (one token per row) compile as (`run_draft_model`)."""
    return model(**kwargs)


def run_draft_model_chain(model, input_ids, attention_masks, position_ids, step_positions, vocab_size: int,
                          **kwargs) -> torch.LongTensor:
    """A greedy draft chain as one frame, so a compiled call is one graph for all its forwards (gpt-fast and vLLM
    run the draft model's k forwards without the host between them): a forward over `input_ids` `(batch_size,
    width)` (the rows' newest committed tokens, each row's last slot a token), then one forward per step of the
    previous forward's argmax, each row's token fed back.

    Args:
        model (`PreTrainedModel`): the draft model.
        input_ids (`torch.LongTensor` of shape `(batch_size, width)`): the first forward's query.
        attention_masks (`torch.LongTensor` of shape `(batch_size, 1 + num_steps, num_keys)`): each forward's 2D
            mask over the cache's slots (built by `query.greedy_chain`).
        position_ids (`torch.LongTensor` of shape `(batch_size, width)`): the first forward's positions.
        step_positions (`torch.LongTensor` of shape `(batch_size, num_steps)`): each later forward's position.
        vocab_size (`int`): the target's logits width; the argmax reads the draft's logits up to it.
        **kwargs: to every forward (the cache, `use_cache`, `logits_to_keep`).

    Returns:
        `torch.LongTensor` of shape `(batch_size, 1 + num_steps)`: the draft tokens, in order.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_masks[:, 0], position_ids=position_ids,
                   **kwargs).logits
    tokens = [logits[:, -1, :vocab_size].argmax(dim=-1)]
    for step in range(step_positions.shape[1]):
        logits = model(input_ids=tokens[-1][:, None], attention_mask=attention_masks[:, step + 1],
                       position_ids=step_positions[:, step : step + 1], **kwargs).logits
        tokens.append(logits[:, -1, :vocab_size].argmax(dim=-1))
    return torch.stack(tokens, dim=1)


def run_draft_head(head, *args):
    """`head(*args)`: the frame an EAGLE head's catch-up forwards compile as (`EagleDrafter`), a code object of its
    own for the reasons `run_draft_model` gives."""
    return head(*args)


def run_draft_head_step(head, *args):
    """`head(*args)`: the frame an EAGLE head's chain steps (one node per row) compile as (`run_draft_head`)."""
    return head(*args)


class DraftCompiler:
    """The compiled forward of one drafter's draft module and the static draft cache it runs over, when a call
    compiles (the target's switch, `compiles`).

    `functions` (`run_draft_model`, `run_draft_model_step` and `run_draft_model_chain`, or the head's pair) are
    compiled once per `compile_config` and kept: a drafter that serves many calls compiles its graphs in the first
    and reuses them.

    Args:
        *functions (`Callable`): each `function(module, ...)` runs the draft module; their code objects are
            dynamo's cache keys, one frame each.
    """

    def __init__(self, *functions: Callable):
        self.functions = functions
        self._kept = None  # (compile_config, compiled functions)

    def static_cache(self, state, draft_config, num_draft_tokens: int, module) -> tuple | None:
        """`(cache, *calls)` for a call whose target steps compile: an empty `StaticCache` for `module` (of
        `draft_config`, one length bucket of `static_cache.draft_static_cache`) and per function a `call(*args,
        **kwargs)`, the compiled `function(module, *args, **kwargs)`; `None` when the call runs eagerly (no static
        target cache, no compile switch, a module transformers would not compile, or a draft cache with sliding
        windows).

        Args:
            state (`DraftState`): the call (its target, target cache and generation config).
            draft_config: the draft module's transformers config (its layers and attention heads).
            num_draft_tokens (`int`): the most draft tokens a step proposes.
            module (`nn.Module`): the draft module (`compilable` checks its quantizer and device map).
        """
        config = state.generation_config
        if state.cache is None or not compiles(state.target, state.cache.cache, config) or not compilable(module):
            return None
        cache = draft_static_cache(draft_config, slots_per_row(config.max_length, num_draft_tokens, state.batch_size))
        if cache is None:
            return None
        if self._kept is None or self._kept[0] != config.compile_config:  # kept: a new one would recompile
            options = config.compile_config.to_dict()
            self._kept = (config.compile_config, [torch.compile(function, **options) for function in self.functions])
        return cache, *(functools.partial(compiled, module) for compiled in self._kept[1])


def compiled_steps(model, cache, generation_config, drafter) -> CompiledSteps | None:
    """The compiled step forward of a call whose drafts hold at most `drafter.num_draft_tokens` tokens, or `None`
    when the call runs eagerly (`compiles` or `compilable` says no). A drafter that reads the target's hidden states
    (EAGLE, Medusa) gets them from the compiled forward's `output_hidden_states` (`target.TargetForward`); every
    drafter sees the widths (`DraftState.query_widths`)."""
    if not compiles(model, cache, generation_config) or not compilable(model):
        return None
    return CompiledSteps(model.get_compiled_call(generation_config.compile_config),
                         tuple(n + 1 for n in drafter.draft_lengths))
