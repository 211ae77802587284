"""The named speculative methods of the command line and the benchmark (the `variants` of the `MethodSpec`s): each is
a `SpeculativeConfig`, built by the one drafter factory, `hf_speculators.config.build.build_drafter`."""

from ..drafters import Drafter
from .build import build_drafter
from .registry import METHOD_SPECS, checkpoint_of, head_methods, method_options, named_methods
from .speculative_config import SpeculativeConfig

LOADED_DRAFT = "<loaded draft model>"  # a config's draft_model when the caller passes the loaded model itself


def draft_model_methods() -> tuple[str, ...]:
    """The named methods that draft with the loaded `--draft` model."""
    return tuple(name for name, (spec, variant) in named_methods().items()
                 if getattr(checkpoint_of(spec, variant), "name", None) == "draft_model")


def self_draft_methods() -> dict[str, str]:
    """The named methods that draft with a quantized copy of the target -> its quantization."""
    return {name: variant.settings["draft_quantization"] for name, (spec, variant) in named_methods().items()
            if "draft_quantization" in variant.settings}


def named_head_methods() -> dict[str, str]:
    """The named methods that draft with a learned head -> the `method_config` keyword naming its checkpoint."""
    heads = {METHOD_SPECS[name].checkpoint for name in head_methods()}
    return {name: checkpoint_of(spec, variant).name for name, (spec, variant) in named_methods().items()
            if checkpoint_of(spec, variant) in heads}


def _given(**options) -> dict:
    """The options that are not `None`: the others keep the drafter's own defaults."""
    return {name: value for name, value in options.items() if value is not None}


def method_config(method: str, *, draft_model: str | None = None, num_draft_tokens: int | None = None,
                  **options) -> SpeculativeConfig:
    """The `SpeculativeConfig` of a named method (a `Variant` of a `MethodSpec`, e.g. `"draft-model-tree"`); an
    option left at `None` keeps the drafter's default, an option the method does not take is ignored.

    Args:
        method (`str`): a named method (`named_methods()`), e.g. `"prompt-lookup"`, `"prompt-lookup-tree"`,
            `"self-draft-int8"`, `"eagle3-tree"`, `"hybrid-eagle3"`.
        draft_model (`str`, *optional*): the draft model of the methods that take one (`--draft`).
        num_draft_tokens (`int`, *optional*): draft tokens per step, or a tree's depth (`Variant.length`).
        **options: the methods' settings (`method_options()`: `max_ngram_size`, `exit_layer`, `max_tree_depth`...),
            a dynamic tree's `tree_top_k` and `tree_nodes`, and the checkpoints `eagle_head`, `medusa_head`,
            `dflash_model`, `gemma4_assistant`.

    Raises:
        `ValueError`: an unknown method, or settings the config refuses (e.g. a draft-model method without
            `draft_model`, layer skip without `exit_layer`), naming the field.
        `TypeError`: an option no method takes.
    """
    named = named_methods()
    if method not in named:
        raise ValueError(f"Unknown method {method!r}; choose one of {', '.join(named)}.")
    unknown = sorted(set(options) - set(method_options()))
    if unknown:
        raise TypeError(f"method_config() got unexpected keyword arguments {unknown}.")
    spec, variant = named[method]
    settings = {"method": spec.name, **variant.settings,
                **_given(**{s.name: options.get(s.name) for s in spec.settings if s.name not in variant.ignores})}
    tree = _given(top_k=options.get("tree_top_k"), num_nodes=options.get("tree_nodes"))
    length = {"tokens": {"num_draft_tokens": num_draft_tokens}, "depth": {"tree": _given(depth=num_draft_tokens, **tree)},
              "tree": {"tree": tree}, "own": {}}[variant.length]
    checkpoint = checkpoint_of(spec, variant)
    if checkpoint is not None:
        settings["draft_model"] = draft_model if checkpoint.name == "draft_model" else options.get(checkpoint.name)
    return SpeculativeConfig(**_given(**settings, **length))


def make_drafter(method: str, draft_model=None, *, target=None, draft_tokenizer=None, draft_vocab=None,
                 **options) -> Drafter:
    """Builds the drafter of a named method (`method_config`) for `target` through `build_drafter`.

    Args:
        method (`str`): a named method (`named_methods()`).
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
