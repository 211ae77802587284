"""The loop's target forward: one forward per step over every row's query, with the hidden states drafters read.

Learned draft heads read the target's hidden states: EAGLE-3 the inputs of three decoder layers, EAGLE-1/2 and
Medusa the output of the final norm. They are captured with forward hooks inside the prefill and verification
forwards the loop runs anyway (no second forward, and no `output_hidden_states=True`, which would keep every layer's
hidden states of a long prompt); a compiled step forward instead returns them through `output_hidden_states=True`
(hooks added and removed around a compiled graph would not run in it; a step's few query slots cost little).
Layer skip asks the forward to start at its exit layer from the hidden states it drafted with (`Resume`), so nothing
below that layer runs twice.
"""

import torch

from .cache import RaggedCache, truncate_layers
from .decoder_layers import DecoderLayers, feature_modules
from .drafters.base import TargetNeeds
from .query import Query, forward, model_outputs
from .static_cache import allocated
from .step import Resume, TargetOutput


def _layer_input(captured: dict, slot: int):
    """A forward pre-hook that keeps the hidden states entering a decoder layer as `captured[slot]`."""

    def hook(module, args, kwargs):
        captured[slot] = args[0] if args else kwargs["hidden_states"]

    return hook


def _module_output(captured: dict, slot: int):
    """A forward hook that keeps a module's output as `captured[slot]`."""

    def hook(module, args, output):
        captured[slot] = output

    return hook


class FeatureCapture:
    """Hooks on the target's feature points for the duration of one forward (`run`).

    A row of features is the concatenation, in this order, of the hidden states entering each decoder layer of
    `needs.layer_ids` (the residual stream before layer i, transformers' `hidden_states[i]` and vLLM's auxiliary
    hidden state i; EAGLE-3, Li et al. 2025) and, with `needs.final_norm`, the final norm's output (transformers'
    `last_hidden_state`; EAGLE-1/2, Li et al. 2024; Medusa, Cai et al. 2024). Hooks live only inside `run`, on
    this model's modules: nothing global, so concurrent calls on other models are unaffected.

    Args:
        model (`PreTrainedModel`): the target, a model type that `DecoderLayers` can run.
        needs (`TargetNeeds`): what to capture.

    Raises:
        `ValueError`: a layer id outside the target's decoder layers, or a model without a decoder layer list or
            final norm (`feature_modules`).
    """

    def __init__(self, model, needs: TargetNeeds):
        layers, final_norm = feature_modules(model)
        bad = [i for i in needs.layer_ids
               if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(layers)]
        if bad:
            raise ValueError(
                f"Feature layer ids {bad} are outside this target's decoder layers 0..{len(layers) - 1}: the "
                "draft head was made for a deeper model, or its layer ids are wrong."
            )
        self._inputs = [layers[i] for i in needs.layer_ids]
        self._outputs = [final_norm] if needs.final_norm else []
        self.needs = needs

    def run(self, forward_fn) -> tuple[torch.Tensor, torch.FloatTensor]:
        """Runs `forward_fn()` with the hooks on; returns its result and the features `(batch_size, num_query,
        width)` of every slot it fed."""
        captured: dict[int, torch.Tensor] = {}
        handles = [module.register_forward_pre_hook(_layer_input(captured, slot), with_kwargs=True)
                   for slot, module in enumerate(self._inputs)]
        handles += [module.register_forward_hook(_module_output(captured, len(self._inputs) + slot))
                    for slot, module in enumerate(self._outputs)]
        try:
            result = forward_fn()
        finally:
            for handle in handles:
                handle.remove()
        return result, torch.cat([captured[slot] for slot in range(len(captured))], dim=-1)

    def select(self, hidden_states: tuple[torch.FloatTensor, ...]) -> torch.FloatTensor:
        """The features `(batch_size, num_query, width)` in a forward's `hidden_states` (`output_hidden_states=True`:
        entry i is the input of decoder layer i, the last one the final norm's output), in `run`'s order."""
        chosen = [hidden_states[i] for i in self.needs.layer_ids]
        return torch.cat(chosen + ([hidden_states[-1]] if self.needs.final_norm else []), dim=-1)


class TargetForward:
    """Runs the target over a step's `Query` after its `RaggedCache`, capturing what the drafter needs.

    Args:
        model (`PreTrainedModel`): the target.
        needs (`TargetNeeds`): the hidden states the drafter reads (`TargetOutput.features`).
        step_call (`Callable`, *optional*): what runs the model in decoding steps (a compiled `model.__call__`,
            `compiled.CompiledSteps.forward`); forwards given `num_logits` (the prefill), and a first forward that
            allocates the cache (after a one-token prompt), run the model eagerly.
    """

    def __init__(self, model, needs: TargetNeeds, step_call=None):
        self.model, self.step_call = model, step_call
        self.capture = FeatureCapture(model, needs) if needs.features else None
        self._layers: DecoderLayers | None = None

    def __call__(self, cache: RaggedCache, query: Query, resume: Resume | None = None,
                 num_logits: int | None = None) -> TargetOutput:
        """The target's logits over `query`, of its last `num_logits` slots (default: all), and the features of every
        slot the drafter reads.

        With `resume` (layer skip), only the decoder layers from `resume.exit_layer` on run, from its hidden
        states: the drafter ran the layers below over these very slots.

        Raises:
            `RuntimeError`: if `resume` was drafted for other query slots than `query`'s.
        """
        if resume is None:
            call = self.step_call if num_logits is None and allocated(cache.cache) else None
            if call is not None and self.capture is not None:
                outputs = model_outputs(self.model, cache, query, call=call, output_hidden_states=True)
                return TargetOutput(cache.from_batch(outputs.logits),
                                    cache.from_batch(self.capture.select(outputs.hidden_states)))
            run = lambda: forward(self.model, cache, query, num_logits, call)  # noqa: E731
        else:
            run = lambda: self._resume(cache, query, resume, num_logits)  # noqa: E731
        if self.capture is None:
            return TargetOutput(run())
        return TargetOutput(*self.capture.run(run))

    def _resume(self, cache: RaggedCache, query: Query, resume: Resume, num_logits: int | None) -> torch.FloatTensor:
        """Runs layers `[exit_layer, L)`, the final norm and the LM head over `query` from `resume.hidden_states`."""
        if not torch.equal(resume.valid.cpu(), query.valid):
            raise RuntimeError("A drafter's Resume must cover exactly the query slots the loop built from its drafts.")
        if self._layers is None:
            self._layers = DecoderLayers(self.model)
        device = query.input_ids.device
        _, position_ids = cache.query_inputs(query, self._layers.dtype)
        mask = cache.additive_mask(query.valid, self._layers.dtype, query.visible).to(device)
        late = range(resume.exit_layer, self._layers.num_layers)
        try:
            hidden_states = self._layers.run(resume.hidden_states, position_ids.to(device), late, cache.cache, mask)
        except BaseException:  # an interrupted step leaves no slot in any layer, the drafted early ones included
            truncate_layers(cache.cache, cache.num_slots)
            raise
        return self._layers.logits(hidden_states[:, -(num_logits or query.input_ids.shape[1]):])
