"""The named speculative methods of the command line and the benchmark: each is a `SpeculativeConfig`, built by the
one drafter factory, `hf_speculators.config.build.build_drafter`."""

from ..drafters import Drafter
from ..quantization import QUANTIZATIONS
from .build import build_drafter
from .speculative_config import SpeculativeConfig

# method -> quantization of the target's copy that drafts for it (DraftModelDrafter.from_target)
SELF_DRAFT_METHODS = {f"self-draft-{quantization}": quantization for quantization in QUANTIZATIONS}
# method -> the option naming its draft head checkpoint (EagleDrafter, MedusaDrafter)
HEAD_METHODS = {"eagle3": "eagle_head", "eagle3-tree": "eagle_head", "medusa": "medusa_head",
                "medusa-tree": "medusa_head", "hybrid-eagle3": "eagle_head"}
# the drafters transformers ships: the target's own MTP layers (beside its checkpoint, no option), DFlash block
# drafters and Gemma 4 assistants (method -> the option naming the checkpoint)
NATIVE_METHODS = {"mtp": None, "mtp-tree": None, "dflash": "dflash_model", "dflash-tree": "dflash_model",
                  "gemma4-assistant": "gemma4_assistant"}
# method -> the option naming the checkpoint it drafts with
CHECKPOINT_OPTIONS = {**HEAD_METHODS, **{name: option for name, option in NATIVE_METHODS.items() if option}}
METHODS = ("prompt-lookup", "prompt-lookup-tree", "suffix", "lookahead", "draft-model", "draft-model-tree",
           "hybrid", "layer-skip", *SELF_DRAFT_METHODS, *HEAD_METHODS, *NATIVE_METHODS)
DRAFT_MODEL_METHODS = ("draft-model", "draft-model-tree", "hybrid")
LOADED_DRAFT = "<loaded draft model>"  # a config's draft_model when the caller passes the loaded model itself
TREE_NUM_CANDIDATES = 4  # continuations merged by "prompt-lookup-tree" unless num_candidates is given


def _given(**options) -> dict:
    """The options that are not `None`: the others keep the drafter's own defaults."""
    return {name: value for name, value in options.items() if value is not None}


def method_config(
    method: str,
    *,
    draft_model: str | None = None,
    num_draft_tokens: int | None = None,
    max_ngram_size: int | None = None,
    prefer: str | None = None,
    num_candidates: int | None = None,
    tree_top_k: int | None = None,
    tree_nodes: int | None = None,
    exit_layer: int | None = None,
    confidence_threshold: float | None = None,
    draft_vocab: str | None = None,
    draft_vocab_size: int | None = None,
    eagle_head: str | None = None,
    medusa_head: str | None = None,
    dflash_model: str | None = None,
    gemma4_assistant: str | None = None,
    max_tree_depth: int | None = None,
    max_cached_requests: int | None = None,
    max_spec_factor: float | None = None,
    min_token_prob: float | None = None,
    use_tree_spec: bool | None = None,
    window_size: int | None = None,
    ngram_size: int | None = None,
    verification_set_size: int | None = None,
) -> SpeculativeConfig:
    """The `SpeculativeConfig` of a named method; an option left at `None` keeps the drafter's default.

    - `"prompt-lookup"`: `PromptLookupDrafter(num_draft_tokens, max_ngram_size, prefer)`, a chain.
    - `"prompt-lookup-tree"`: the same with `num_candidates` continuations in one trie (default 4).
    - `"suffix"`: `SuffixDrafter(num_draft_tokens, max_tree_depth, max_cached_requests, max_spec_factor,
      min_token_prob, use_tree_spec)`: suffix decoding, with a memory of earlier calls (`max_cached_requests` rows).
    - `"lookahead"`: `LookaheadDrafter(window_size, ngram_size, verification_set_size)` (`num_draft_tokens` does not
      apply: its drafts are `ngram_size - 1` deep).
    - `"draft-model"`: `DraftModelDrafter(draft_model, num_draft_tokens)`, a chain.
    - `"hybrid"`, `"hybrid-eagle3"`: `HybridDrafter` of suffix decoding (the suffix options) and the draft model
      `draft_model` or the EAGLE head `eagle_head` drafting chains of `num_draft_tokens`.
    - `"draft-model-tree"`: `TreeDrafter(draft_model, DynamicTree(depth=num_draft_tokens, top_k=tree_top_k,
      num_nodes=tree_nodes))`, an EAGLE-2 dynamic tree.
    - `"layer-skip"`: `LayerSkipDrafter(exit_layer, num_draft_tokens, confidence_threshold, draft_vocab)`, the
      target's own first layers (`draft_vocab`: a token ranking, of which the first `draft_vocab_size` ids draft).
    - `"self-draft-int8"`, `"self-draft-nf4"`, `"self-draft-int4"`, `"self-draft-fp8"`: a quantized copy of the
      target drafts (`DraftModelDrafter.from_target`): method `"draft-model"` with `draft_quantization` and no
      `draft_model`.
    - `"eagle3"`, `"eagle3-tree"`: `EagleDrafter` from the checkpoint `eagle_head` (any EAGLE format), a chain of
      `num_draft_tokens` or a `DynamicTree(depth=num_draft_tokens, top_k=tree_top_k, num_nodes=tree_nodes)`.
    - `"medusa"`, `"medusa-tree"`: `MedusaDrafter` from the checkpoint `medusa_head`, the same way.
    - `"mtp"`, `"mtp-tree"`: `MTPDrafter` of the target's own MTP layers (stored beside its checkpoint), a chain of
      one token per MTP layer or a `DynamicTree` of `tree_top_k`, `tree_nodes` and that depth (`num_draft_tokens`
      does not apply: the layers set the draft length, as in transformers' `use_mtp=True`).
    - `"dflash"`, `"dflash-tree"`: `DFlashDrafter` from the checkpoint `dflash_model`, a chain of `block_size - 1`
      tokens (transformers' draft length) or a `DynamicTree` of `tree_top_k`, `tree_nodes` and that depth.
    - `"gemma4-assistant"`: `Gemma4AssistantDrafter` from the checkpoint `gemma4_assistant` (transformers >= 5.24), a
      chain of `num_draft_tokens` (default: the assistant's `num_assistant_tokens`, else 4).

    Raises:
        `ValueError`: an unknown method, or settings the config refuses (e.g. a draft-model method without
            `draft_model`, layer skip without `exit_layer`), naming the field.
    """
    if method not in METHODS:
        raise ValueError(f"Unknown method {method!r}; choose one of {', '.join(METHODS)}.")
    lookup = _given(num_draft_tokens=num_draft_tokens, max_ngram_size=max_ngram_size, prefer=prefer)
    tree = _given(depth=num_draft_tokens, top_k=tree_top_k, num_nodes=tree_nodes)  # {}: a DynamicTree's defaults
    native_tree = _given(top_k=tree_top_k, num_nodes=tree_nodes)  # as deep as the MTP layers or the block allow
    suffix = _given(max_tree_depth=max_tree_depth, max_cached_requests=max_cached_requests,
                    max_spec_factor=max_spec_factor, min_token_prob=min_token_prob, use_tree_spec=use_tree_spec)
    settings = {
        "prompt-lookup": {"method": "prompt-lookup", **lookup},
        "prompt-lookup-tree": {"method": "prompt-lookup", "num_candidates": num_candidates or TREE_NUM_CANDIDATES,
                               **lookup},
        "suffix": {"method": "suffix", "num_draft_tokens": num_draft_tokens, **suffix},
        "lookahead": {"method": "lookahead", "window_size": window_size, "ngram_size": ngram_size,
                      "verification_set_size": verification_set_size},
        "draft-model": {"method": "draft-model", "draft_model": draft_model, "num_draft_tokens": num_draft_tokens},
        "hybrid": {"method": "hybrid", "draft_model": draft_model, "num_draft_tokens": num_draft_tokens, **suffix},
        "hybrid-eagle3": {"method": "hybrid", "model_method": "eagle3", "draft_model": eagle_head,
                          "num_draft_tokens": num_draft_tokens, **suffix},
        "draft-model-tree": {"method": "tree", "draft_model": draft_model, "tree": tree},
        "layer-skip": {"method": "layer-skip", "exit_layer": exit_layer, "num_draft_tokens": num_draft_tokens,
                       "confidence_threshold": confidence_threshold, "draft_vocab": draft_vocab,
                       "draft_vocab_size": draft_vocab_size},
        **{name: {"method": "draft-model", "draft_quantization": quantization, "num_draft_tokens": num_draft_tokens}
           for name, quantization in SELF_DRAFT_METHODS.items()},
        "eagle3": {"method": "eagle3", "draft_model": eagle_head, "num_draft_tokens": num_draft_tokens},
        "eagle3-tree": {"method": "eagle3", "draft_model": eagle_head, "tree": tree},
        "medusa": {"method": "medusa", "draft_model": medusa_head, "num_draft_tokens": num_draft_tokens},
        "medusa-tree": {"method": "medusa", "draft_model": medusa_head, "tree": tree},
        "mtp": {"method": "mtp"},
        "mtp-tree": {"method": "mtp", "tree": native_tree},
        "dflash": {"method": "dflash", "draft_model": dflash_model},
        "dflash-tree": {"method": "dflash", "draft_model": dflash_model, "tree": native_tree},
        "gemma4-assistant": {"method": "gemma4-assistant", "draft_model": gemma4_assistant,
                             "num_draft_tokens": num_draft_tokens},
    }[method]
    return SpeculativeConfig(**_given(**settings))


def make_drafter(method: str, draft_model=None, *, target=None, draft_tokenizer=None, draft_vocab=None,
                 **options) -> Drafter:
    """Builds the drafter of a named method (`method_config`) for `target` through `build_drafter`.

    Args:
        method (`str`): one of `METHODS`.
        draft_model (`PreTrainedModel`, *optional*): the loaded draft model of the draft-model methods.
        target (`PreTrainedModel`, *optional*): the target; needed by the self-draft methods.
        draft_tokenizer (`PreTrainedTokenizerBase`, *optional*): the draft model's tokenizer.
        draft_vocab (`torch.LongTensor`, *optional*): layer skip's draft vocabulary as token ids (`options` may
            name a ranking instead: `draft_vocab` as a path there is not taken here).
        **options: the other arguments of `method_config`.

    Raises:
        `ValueError`: see `method_config` and `build_drafter`.
    """
    name = getattr(draft_model, "name_or_path", None) or (LOADED_DRAFT if draft_model is not None else None)
    config = method_config(method, draft_model=name, **options)
    loaded = _given(draft_model=draft_model, draft_tokenizer=draft_tokenizer, draft_vocab=draft_vocab)
    return build_drafter(config, target, **loaded)
