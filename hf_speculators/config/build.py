"""Building the drafter and verifier a `SpeculativeConfig` describes, for a given target model."""

import inspect
import warnings
from dataclasses import fields
from pathlib import Path

from ..drafters import Drafter, HybridDrafter
from ..drafters.draft_model import vocabulary_bridge
from ..drafters.suffix import SUFFIX_SETTINGS
from ..loading import load_model, load_tokenizer, resolve_model_id
from ..onednn_linear import runs_onednn_linear, use_onednn_linear
from ..verifiers import VERIFIERS, Verifier
from ..vocab import ranked_draft_vocab
from .registry import METHOD_SPECS
from .speculators_format import SPECULATORS_TYPES

# arguments a drafter gets from what a config field names (a model, a token ranking), not from the field's value
LOADED_ARGUMENTS = ("draft_model", "draft_tokenizer", "draft_vocab")
# verification -> {config field: argument of the verifier's constructor}
VERIFIER_PARAMS: dict[str, dict[str, str]] = {
    "typical": {"typical_epsilon": "epsilon", "typical_delta": "delta"},
    "top_k": {"top_k": "top_k", "accept_tolerance": "accept_tolerance"},
}


def _same_model(a: str, b: str) -> bool:
    """Whether two names or paths plausibly name one model (a Hub id and a local copy share the last part)."""
    return a == b or Path(a).name.lower() == Path(b).name.lower()


def made_for_another_target(config, target_name: str) -> bool:
    """Whether `config.target_model` names another model than `target_name` (a name or path; `False` when either
    is unset)."""
    target_name = resolve_model_id(target_name or "")
    return bool(config.target_model and target_name
                and not _same_model(resolve_model_id(config.target_model), target_name))


def _warn_if_other_target(config, target) -> None:
    actual = getattr(target, "name_or_path", "") or ""
    if made_for_another_target(config, actual):
        warnings.warn(
            f"The speculative config was made for target_model={config.target_model!r}, but the target is "
            f"{actual!r}: its recommended settings may not suit this model."
        )


def _load_draft(config, target, target_tokenizer):
    """Loads `config.draft_model` with the target's dtype and device (quantized as `config.draft_quantization`
    says) and checks that its vocabulary is the target's or can be translated (both tokenizers known)."""
    dtype = str(target.dtype).removeprefix("torch.")
    draft = load_model(config.draft_model, dtype, str(target.device), revision=config.draft_revision,
                       quantization=config.draft_quantization)
    draft_tokenizer = load_tokenizer(config.draft_model, revision=config.draft_revision)
    try:
        vocabulary_bridge(target, draft, target_tokenizer, draft_tokenizer)
    except ValueError as error:
        raise ValueError(f"draft_model={config.draft_model!r} does not fit the target: {error}") from None
    return {"draft_model": draft, "draft_tokenizer": draft_tokenizer}


def _self_draft(drafter_class, config, target, kwargs: dict) -> Drafter:
    """A drafter whose draft model is a copy of `target` quantized as `config.draft_quantization` says."""
    if target is None:
        raise ValueError(
            f"method={config.method!r} with draft_quantization and no draft_model drafts with a quantized copy of "
            "the target: pass the target model."
        )
    return drafter_class.from_target(target, config.draft_quantization, **kwargs)


def _hybrid(config, target, target_tokenizer, loaded: dict) -> Drafter:
    """The `HybridDrafter` of a `"hybrid"` config: a `SuffixDrafter` of its suffix settings and the drafter of its
    `model_method` (default `"draft-model"`) with its `draft_model` and `num_draft_tokens`."""
    suffix = {s.name: getattr(config, s.name) for s in SUFFIX_SETTINGS if getattr(config, s.name) is not None}
    model = type(config)(method=config.model_method or "draft-model", draft_model=config.draft_model,
                         draft_revision=config.draft_revision, num_draft_tokens=config.num_draft_tokens)
    return HybridDrafter(build_drafter(type(config)(method="suffix", **suffix), target),
                         build_drafter(model, target, target_tokenizer, **loaded))


def _mtp(config, target) -> Drafter:
    """The `MTPDrafter` of the MTP layers stored beside `target`'s checkpoint."""
    if config.draft_model is not None:  # a vllm-project/speculators MTP checkpoint, which vLLM runs
        raise ValueError(
            "method='mtp' with a draft_model cannot be built by this version of hf_speculators: MTPDrafter drafts "
            "with the target's own MTP layers. A speculators MTP checkpoint runs in vLLM: "
            "speculative_config=config.to_vllm()."
        )
    if target is None:
        raise ValueError("method='mtp' drafts with the target's own MTP layers: pass the target model.")
    return METHOD_SPECS[config.method].drafter.from_target(target, num_draft_tokens=config.num_draft_tokens, tree=config.tree)


def build_drafter(config, target, target_tokenizer=None, **loaded) -> Drafter:
    """The drafter of `config.method` for `target`, given every config field its constructor takes; the one factory
    of drafters, behind presets, `generate(speculative_config=...)`, the command line and the benchmark.

    Fields that name something to load are loaded here unless `loaded` passes it already: `draft_model` (loaded
    with the target's dtype and device, quantized as `draft_quantization` says, its tokenizer checked; with
    `draft_quantization` and no `draft_model`, a quantized copy of the target drafts), `draft_vocab` (a token
    ranking read as ids). A drafter class with a `from_pretrained` (learned heads) loads its checkpoint,
    `config.draft_model`, itself.

    Args:
        config (`SpeculativeConfig`): the settings.
        target (`PreTrainedModel`): the target model (may be `None` for drafters that load nothing).
        target_tokenizer (`PreTrainedTokenizerBase`, *optional*): for the draft model's vocabulary check.
        **loaded: objects that replace loading: `draft_model` and `draft_tokenizer` (a loaded draft model and its
            tokenizer), `draft_vocab` (`torch.LongTensor` of token ids).

    Raises:
        `ValueError`: a method with no drafter in this version (naming it and listing `DRAFTERS`), a draft model
            whose vocabulary does not match the target's (naming `draft_model`), a `draft_quantization` that
            cannot run on the target's device or does not fit the draft model, a self-draft without a target, or a
            malformed `draft_vocab` ranking.
        `FileNotFoundError`: a local `draft_model` or `draft_vocab` file that does not exist.
        `ImportError`: the library of `draft_quantization` is not installed.
    """
    drafter = _drafter(config, target, target_tokenizer, loaded)
    if target is not None and runs_onednn_linear(target):
        for module in drafter.draft_modules(target):
            use_onednn_linear(module)
    return drafter


def _drafter(config, target, target_tokenizer, loaded: dict) -> Drafter:
    """`build_drafter`'s drafter, before its modules follow the target's linear kernel."""
    drafters = {name: spec.drafter for name, spec in METHOD_SPECS.items() if spec.drafter is not None}
    if config.method not in drafters:
        hint = (
            " It is a vllm-project/speculators drafter type: vLLM runs it with speculative_config=config.to_vllm()."
            if config.method in SPECULATORS_TYPES else ""
        )
        raise ValueError(
            f"method={config.method!r} cannot be built by this version of hf_speculators: the drafters available are "
            f"{sorted(drafters)}.{hint}"
        )
    loads = METHOD_SPECS[config.method].loads
    if loads == "pair":
        return _hybrid(config, target, target_tokenizer, loaded)
    if loads == "target":
        return _mtp(config, target)
    drafter_class = drafters[config.method]
    from_checkpoint = hasattr(drafter_class, "from_pretrained")
    parameters = inspect.signature(drafter_class.from_pretrained if from_checkpoint else drafter_class).parameters
    settings = {f.name: getattr(config, f.name) for f in fields(config)}
    kwargs = {
        name: settings[name] for name in parameters
        if name in settings and name not in LOADED_ARGUMENTS and settings[name] is not None
    }
    if config.draft_vocab is not None:
        kwargs["draft_vocab"] = ranked_draft_vocab(config.draft_vocab, config.draft_vocab_size)
    kwargs.update({name: value for name, value in loaded.items() if name in parameters})
    if from_checkpoint:
        return drafter_class.from_pretrained(config.draft_model, revision=config.draft_revision, **kwargs)
    if "draft_model" in parameters and "draft_model" not in loaded:
        if config.draft_model is None:
            return _self_draft(drafter_class, config, target, kwargs)
        loaded_draft = _load_draft(config, target, target_tokenizer)
        kwargs.update({name: value for name, value in loaded_draft.items() if name in parameters})
    return drafter_class(**kwargs)


def build_verifier(config) -> Verifier | None:
    """The verifier `config.verification` names, with its parameters; `None` leaves the choice to `generate`.

    Raises:
        `ValueError`: a verification with no verifier in this version, listing `VERIFIERS`.
    """
    name = config.verification
    if name is None:
        return None
    if name not in VERIFIERS:
        raise ValueError(
            f"verification={name!r} is not available in this version of hf_speculators: choose one of "
            f"{sorted(VERIFIERS)}, or leave it unset (exact for greedy decoding, rejection when sampling)."
        )
    params = {
        argument: getattr(config, field) for field, argument in VERIFIER_PARAMS.get(name, {}).items()
        if getattr(config, field) is not None
    }
    return VERIFIERS[name](**params)


def build(config, target, target_tokenizer=None) -> tuple[Drafter, Verifier | None]:
    """Returns `(drafter, verifier)` for a `SpeculativeConfig` and a loaded target model.

    A draft model is loaded (through `hf_speculators.loading`) with the target's dtype and onto its device,
    quantized if `config.draft_quantization` is set. The verifier is `None` when the config leaves it unset. Warns
    when `config.target_model` names another model.

    Args:
        config (`SpeculativeConfig`): the settings.
        target (`PreTrainedModel`): the target model.
        target_tokenizer (`PreTrainedTokenizerBase`, *optional*): the target's tokenizer, for the vocabulary check
            (needed when the logits widths differ only by padding, as for Qwen2.5 0.5B and 7B).

    Raises:
        `ValueError`: see `build_drafter` and `build_verifier`.
    """
    verifier = build_verifier(config)  # before the drafter: it may load a draft model
    drafter = build_drafter(config, target, target_tokenizer)
    _warn_if_other_target(config, target)
    return drafter, verifier
