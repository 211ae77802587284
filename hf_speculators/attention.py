"""Which attention implementations take the loop's custom masks (below both the call checks and the drafters)."""

# attention implementations verified with the loop's custom masks (4D additive for token trees and unverified tokens,
# 2D with holes for ragged batches); others (flash_attention_2/3, paged kernels; flex_attention, whose CPU kernel
# torch 2.13 cannot compile, so it is unverified) serve one row of chains only, with the model's own causal mask
CUSTOM_MASK_ATTENTION = ("eager", "sdpa")


def attention_implementation(model) -> str:
    """The attention implementation `model` runs (`config._attn_implementation`; `"eager"` when unset)."""
    return getattr(model.config, "_attn_implementation", None) or "eager"


def takes_custom_masks(model) -> bool:
    """Whether `model`'s attention implementation honours custom 2D and 4D masks (`CUSTOM_MASK_ATTENTION`)."""
    return attention_implementation(model) in CUSTOM_MASK_ATTENTION
