"""What a speculative generate call must satisfy, checked before any forward runs."""

import torch
from transformers import GenerationConfig

from .attention import attention_implementation, takes_custom_masks
from .drafters import Drafter


def left_padding(attention_mask: torch.LongTensor | None, input_ids: torch.LongTensor) -> list[int]:
    """Each row's number of left padding tokens; raises `ValueError` for right padding or holes in a prompt.

    Args:
        attention_mask (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*): the prompts'
            mask (`None`: no padding).
        input_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`): the prompts.
    """
    if attention_mask is None:
        return [0] * input_ids.shape[0]
    num_pads = (attention_mask == 0).sum(dim=1)
    expected = torch.arange(input_ids.shape[1], device=attention_mask.device) >= num_pads[:, None]
    if not torch.equal(attention_mask.bool(), expected) or bool((num_pads == input_ids.shape[1]).any()):
        raise ValueError(
            "Batched speculative generate needs left-padded prompts, each with at least one token: set "
            "tokenizer.padding_side = 'left' before tokenizing (the attention mask must be zeros, then ones)."
        )
    return num_pads.tolist()


# model_kwargs that transformers prepares for a decoding method (the cache as `cache` from 5.24 on, `past_key_values`
# before); the loop sets its own forward arguments
HANDLED_MODEL_KWARGS = {
    "attention_mask", "position_ids", "use_cache", "cache", "past_key_values", "logits_to_keep",
}


def check_input_ids(input_ids: torch.Tensor) -> None:
    """Raises `ValueError` unless `input_ids` holds integer token ids, before a drafter is built or any forward
    runs (a float tensor would otherwise end in an embedding's index error deep inside the model)."""
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(
            f"input_ids must hold integer token ids (torch.long); got dtype {input_ids.dtype}. Pass the tokenizer's "
            "output unchanged, or convert with input_ids.long()."
        )


def check_inputs(model, input_ids: torch.LongTensor, generation_config: GenerationConfig, drafter, model_kwargs) -> None:
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


def check_batch(generation_config: GenerationConfig, streamer) -> int:
    """Raises `ValueError` for what a batch (batch size > 1) does not serve; returns the pad token id."""
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


def check_attention(model, drafter: Drafter, batch_size: int) -> None:
    """Raises `ValueError` when the target's attention implementation cannot take the masks this call needs.

    One row with chains runs with the model's own causal mask, which every implementation serves; token trees and
    batches (ragged rows) need custom masks, which only `attention.CUSTOM_MASK_ATTENTION` honour.
    """
    if takes_custom_masks(model):
        return
    needs = "batch size > 1" if batch_size > 1 else ("token trees" if drafter.drafts_trees else None)
    if needs is not None:
        raise ValueError(
            f"The target runs attn_implementation={attention_implementation(model)!r}, which cannot take the custom attention masks "
            f"that {needs} need: load it with attn_implementation=\"sdpa\" (or \"eager\"), or generate one "
            "sequence with a chain drafter."
        )


def check_synced_gpus(synced_gpus: bool) -> None:
    """Raises `ValueError` for `synced_gpus=True`: rows on several GPUs would have to step in lockstep."""
    if synced_gpus:
        raise ValueError(
            "synced_gpus=True (generation across several GPUs in lockstep, e.g. under DeepSpeed ZeRO-3) is not "
            "supported by speculative generate: call it without synced_gpus, on one process per model copy."
        )
