"""How a generate call reaches the loop, and so which argument carries the target's tokenizer on that path."""

# set on the wrapper that `hf_speculators.enable(model)` installs as `model.generate`
ENABLED_ATTRIBUTE = "_hf_speculators_enabled"


def is_enabled(model) -> bool:
    """Whether `model.generate` is the wrapper of `hf_speculators.enable(model)`."""
    return getattr(getattr(model, "generate", None), ENABLED_ATTRIBUTE, False)


def tokenizer_argument(model) -> str:
    """How a caller of `model.generate` hands the target's tokenizer to speculative decoding, for error messages:
    `tokenizer=` after `enable(model)` (its wrapper maps it), else `target_tokenizer=`, since transformers drops
    `tokenizer=` before it calls a `custom_generate` callable."""
    if is_enabled(model):
        return "tokenizer= to generate"
    return ("target_tokenizer= to generate (with custom_generate=hf_speculators.generate, transformers drops "
            "tokenizer=; or call hf_speculators.enable(model) once, then tokenizer= works)")
