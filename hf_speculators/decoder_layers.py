"""Running a decoder-only causal LM a slice of decoder layers at a time, through its public modules."""

import torch
from transformers import Cache

from .cache import cache_argument

# families whose forward is exactly: embeddings (+ learned positions), decoder layers, final norm, LM head; the
# layer-by-layer run below reproduces their logits (tested token for token); others may scale embeddings
# (Gemma), cap logits (Gemma 2) or mix layers (Falcon) in ways a layer-by-layer run would silently miss
LAYERWISE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt_neox", "gpt2")
LAYER_LIST_NAMES = ("layers", "h")
FINAL_NORM_NAMES = ("norm", "final_layer_norm", "ln_f")


def _first(names: tuple[str, ...], present, missing: str, looked_for: str, model_type: str) -> str:
    """The first of `names` for which `present(name)` is true; otherwise `ValueError` saying what is `missing`."""
    for name in names:
        if present(name):
            return name
    raise ValueError(
        f"Layer skip cannot run this {model_type} model: {missing} (looked for {looked_for} {' / '.join(names)})."
    )


def _attribute(module, names: tuple[str, ...], what: str, model_type: str):
    """The first attribute of `module` among `names` that is set (see `_first`)."""
    missing = f"its base model {type(module).__name__} has no {what}"
    return getattr(module, _first(names, lambda n: getattr(module, n, None) is not None, missing, "the attribute",
                                  model_type))


def feature_modules(model) -> tuple:
    """The decoder layer list and the final norm of a causal LM of any family, for forward hooks (feature capture
    reads what enters a layer and what the final norm gives; it runs nothing itself, so no family check).

    Raises:
        `ValueError`: a model whose base model has no decoder layer list or no final norm.
    """
    model_type, base = model.config.model_type, model.base_model
    return (_attribute(base, LAYER_LIST_NAMES, "list of decoder layers", model_type),
            _attribute(base, FINAL_NORM_NAMES, "final norm", model_type))


class DecoderLayers:
    """The embeddings, decoder layers, final norm and LM head of a causal LM, run a slice of layers at a time.

    Calling `embed`, then `run` over layers `[0, E)` and `[E, L)`, then `logits` equals the model's own forward;
    each layer writes its keys and values into the given cache under its own layer index, as in that forward. Only
    public modules are used (`get_input_embeddings`, the base model's decoder layer list, rotary or learned
    position embeddings, final norm, `get_output_embeddings`); no modeling code is forked or patched.

    Args:
        model (`PreTrainedModel`): a decoder-only causal LM of a type in `LAYERWISE_MODEL_TYPES` (Llama, Mistral,
            Qwen2, Qwen3, GPT-NeoX, GPT-2).

    Raises:
        `ValueError`: for another model type, or a model lacking a part, named in the message (a decoder layer
            list, a final norm, position embeddings, an LM head, a cache argument of its decoder layers).
    """

    def __init__(self, model):
        model_type = model.config.model_type
        if model_type not in LAYERWISE_MODEL_TYPES:
            raise ValueError(
                f"Layer skip runs the decoder layers one by one and is verified on the model types "
                f"{', '.join(LAYERWISE_MODEL_TYPES)}; this model is {model_type!r}, whose forward may do more between "
                "them (e.g. scaled embeddings or capped logits). Use DraftModelDrafter or PromptLookupDrafter."
            )
        base = model.base_model
        self.layers, self.final_norm = feature_modules(model)
        self.rotary = getattr(base, "rotary_emb", None)
        self.learned_positions = getattr(base, "wpe", None)
        if (self.rotary is None) == (self.learned_positions is None):
            raise ValueError(
                f"Layer skip cannot run this {model_type} model: it needs exactly one kind of position embeddings, "
                "rotary (rotary_emb) or learned (wpe), on its base model."
            )
        self.embeddings, self.head = model.get_input_embeddings(), model.get_output_embeddings()
        if self.head is None:
            raise ValueError(f"Layer skip cannot run this {model_type} model: it has no LM head.")
        self.cache_argument = cache_argument(self.layers[0])
        self.num_layers = model.config.num_hidden_layers
        self.dtype = model.dtype

    def embed(self, input_ids: torch.LongTensor, position_ids: torch.LongTensor) -> torch.FloatTensor:
        """Hidden states `(batch_size, num_tokens, hidden_size)` entering the first layer, for `input_ids` and
        `position_ids` `(batch_size, num_tokens)`."""
        hidden_states = self.embeddings(input_ids)
        if self.learned_positions is not None:
            hidden_states = hidden_states + self.learned_positions(position_ids)
        return hidden_states

    def run(self, hidden_states: torch.FloatTensor, position_ids: torch.LongTensor, layers: range, cache: Cache,
            mask: torch.FloatTensor | None) -> torch.FloatTensor:
        """Runs decoder layers `layers` over `hidden_states` after the tokens each of them holds in `cache`.

        Args:
            hidden_states (`torch.FloatTensor` of shape `(batch_size, num_tokens, hidden_size)`): the input of
                `layers[0]`.
            position_ids (`torch.LongTensor` of shape `(batch_size, num_tokens)`): the tokens' positions.
            layers (`range`): the layer indices to run, in order.
            cache (`Cache`): the model's cache; each of `layers` holds the same slots before the call.
            mask (`torch.FloatTensor` of shape `(batch_size, 1, num_tokens, num_cached + num_tokens)`, *optional*):
                the additive attention mask (`RaggedCache.additive_mask`); `None` for one token per row that
                attends to every cached slot (a cache without holes).

        Returns:
            `torch.FloatTensor` of shape `(batch_size, num_tokens, hidden_size)`: the output of `layers[-1]`.
        """
        extra = {self.cache_argument: cache, "attention_mask": mask, "position_ids": position_ids, "use_cache": True}
        if self.rotary is not None:
            extra["position_embeddings"] = self.rotary(hidden_states, position_ids=position_ids)
        for index in layers:
            hidden_states = self.layers[index](hidden_states, **extra)
        return hidden_states

    def logits(self, hidden_states: torch.FloatTensor, head=None) -> torch.FloatTensor:
        """LM-head logits `(..., vocab_size)` of hidden states `(..., hidden_size)` after the final norm, through
        `head` if given (e.g. a `hf_speculators.vocab.DraftVocabHead`), else the model's own LM head."""
        return (self.head if head is None else head)(self.final_norm(hidden_states))

