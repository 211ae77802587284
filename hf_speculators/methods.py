"""The named speculative methods of the command line and the benchmark, and the drafter each one builds."""

from .drafters import DraftModelDrafter, Drafter, DynamicTree, LayerSkipDrafter, PromptLookupDrafter, TreeDrafter
from .quantization import QUANTIZATIONS

# method -> quantization of the target's copy that drafts for it (DraftModelDrafter.from_target)
SELF_DRAFT_METHODS = {f"self-draft-{quantization}": quantization for quantization in QUANTIZATIONS}
METHODS = ("prompt-lookup", "prompt-lookup-tree", "draft-model", "draft-model-tree", "layer-skip",
           *SELF_DRAFT_METHODS)
DRAFT_MODEL_METHODS = ("draft-model", "draft-model-tree")
TREE_NUM_CANDIDATES = 4  # continuations merged by "prompt-lookup-tree" unless num_candidates is given


def _given(**options) -> dict:
    """The options that are not `None`: the others keep the drafter's own defaults."""
    return {name: value for name, value in options.items() if value is not None}


def make_drafter(
    method: str,
    draft_model=None,
    *,
    num_draft_tokens: int | None = None,
    max_ngram_size: int | None = None,
    prefer: str | None = None,
    num_candidates: int | None = None,
    tree_top_k: int | None = None,
    tree_nodes: int | None = None,
    draft_tokenizer=None,
    exit_layer: int | None = None,
    confidence_threshold: float | None = None,
    draft_vocab=None,
    target=None,
) -> Drafter:
    """Builds the drafter of a named method; an option left at `None` keeps the drafter's default.

    - `"prompt-lookup"`: `PromptLookupDrafter(num_draft_tokens, max_ngram_size, prefer)`, a chain.
    - `"prompt-lookup-tree"`: the same with `num_candidates` continuations in one trie (default 4).
    - `"draft-model"`: `DraftModelDrafter(draft_model, num_draft_tokens)`, a chain.
    - `"draft-model-tree"`: `TreeDrafter(draft_model, DynamicTree(depth=num_draft_tokens, top_k=tree_top_k,
      num_nodes=tree_nodes))`, an EAGLE-2 dynamic tree.
    - `"layer-skip"`: `LayerSkipDrafter(exit_layer, num_draft_tokens, confidence_threshold, draft_vocab)`, the
      target's own first layers.
    - `"self-draft-int8"`, `"self-draft-nf4"`, `"self-draft-int4"`, `"self-draft-fp8"`:
      `DraftModelDrafter.from_target(target, quantization, num_draft_tokens)`, a quantized copy of `target`.

    Raises:
        `ValueError`: an unknown method, a draft-model method without `draft_model`, layer skip without
            `exit_layer`, a self-draft method without `target`, or an invalid option (and the quantization
            errors of `DraftModelDrafter.from_target`).
    """
    if method not in METHODS:
        raise ValueError(f"Unknown method {method!r}; choose one of {', '.join(METHODS)}.")
    if method in DRAFT_MODEL_METHODS and draft_model is None:
        raise ValueError(f"Method {method!r} needs a draft model.")
    if method == "layer-skip":
        if exit_layer is None:
            raise ValueError("Method 'layer-skip' needs an exit layer (--exit-layer E): the layers that draft.")
        return LayerSkipDrafter(exit_layer, **_given(num_draft_tokens=num_draft_tokens,
                                                     confidence_threshold=confidence_threshold,
                                                     draft_vocab=draft_vocab))
    if method in SELF_DRAFT_METHODS:
        if target is None:
            raise ValueError(f"Method {method!r} needs the target model, of which it drafts with a quantized copy.")
        return DraftModelDrafter.from_target(target, SELF_DRAFT_METHODS[method],
                                             **_given(num_draft_tokens=num_draft_tokens))
    if method == "prompt-lookup":
        return PromptLookupDrafter(**_given(num_draft_tokens=num_draft_tokens, max_ngram_size=max_ngram_size,
                                            prefer=prefer))
    if method == "prompt-lookup-tree":
        return PromptLookupDrafter(num_candidates=num_candidates or TREE_NUM_CANDIDATES,
                                   **_given(num_draft_tokens=num_draft_tokens, max_ngram_size=max_ngram_size,
                                            prefer=prefer))
    if method == "draft-model":
        return DraftModelDrafter(draft_model, draft_tokenizer=draft_tokenizer,
                                 **_given(num_draft_tokens=num_draft_tokens))
    tree = DynamicTree(**_given(depth=num_draft_tokens, top_k=tree_top_k, num_nodes=tree_nodes))
    return TreeDrafter(draft_model, tree, draft_tokenizer=draft_tokenizer)
