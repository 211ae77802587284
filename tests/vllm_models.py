"""Small seeded checkpoints that both transformers and vLLM's CPU build run (its attention takes head size 64, not
the 16 of `tiny_models`), for the MTP and DFlash serving tests (tests/test_vllm_serving.py)."""

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
from transformers.modeling_layers import MtpModel

from hf_speculators.loading import DEMO_TARGET, load_tokenizer
from hf_speculators.training.native import distill_dflash, distill_mtp

# transformers finds a GLM-4.5 MoE checkpoint's MTP layer only at layer 46 or 92 (Glm4MoeForCausalLM's
# _keys_to_ignore_on_load_unexpected), so the target has 46 decoder layers, each tiny
GLM_LAYERS = 46
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def save_glm4_moe_target(folder: Path, seed: int = 0) -> None:
    """A seeded GLM-4.5 MoE target (transformers' `Glm4MoeForCausalLM`; vLLM's `Glm4MoeMTP` serves its MTP layer)
    with the demo tokenizer and one MTP layer declared (`num_nextn_predict_layers`), saved without the layer's
    weights (`add_mtp_layer` writes them). Every layer is MoE (vLLM's model needs one MoE layer; transformers builds
    MTP layers as MoE), its LM head scaled up so that the target's greedy choices are not near-ties."""
    tokenizer = load_tokenizer(DEMO_TARGET)
    torch.manual_seed(seed)
    config = Glm4MoeConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                           num_hidden_layers=GLM_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                           moe_intermediate_size=64, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1,
                           first_k_dense_replace=0, max_position_embeddings=512, num_mtp_layers=1,
                           tie_word_embeddings=False, **NO_SPECIAL)
    target = Glm4MoeForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(30)
    target.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _glm_checkpoint_weights(name: str, tensor: torch.Tensor) -> dict:
    """One `MtpModel` weight under GLM-4.5's checkpoint names (`model.layers.46.`, the experts one by one)."""
    name = (name.replace(".mtp_block.", ".").replace(".post_norm.", ".shared_head.norm.")
            .replace("layers.0.", f"model.layers.{GLM_LAYERS}."))
    if name.endswith("experts.gate_up_proj"):  # (experts, 2 * moe_intermediate, hidden): gate, then up
        return {name.replace("gate_up_proj", f"{e}.{part}_proj.weight"): half.contiguous()
                for e, both in enumerate(tensor) for part, half in zip(("gate", "up"), both.chunk(2))}
    if name.endswith("experts.down_proj"):
        return {name.replace("down_proj", f"{e}.down_proj.weight"): down.contiguous() for e, down in enumerate(tensor)}
    return {name: tensor.contiguous()}


def add_mtp_layer(folder: Path, target, sequences: list[torch.LongTensor], steps: int = 20, seed: int = 1) -> None:
    """Distills one MTP layer for `target` (loaded from `folder`) on `sequences` (`(1, length)` each) and writes it
    into `folder`'s weights in GLM-4.5's layout, where transformers' `MtpModel.from_pretrained` and vLLM read it."""
    torch.manual_seed(seed)
    mtp_model = MtpModel(target, 1)
    mtp_model.layers.apply(target._init_weights)  # the constructor leaves the experts' weights uninitialized
    distill_mtp(mtp_model, target, sequences, steps=steps, lr=1e-2)
    weights = load_file(folder / "model.safetensors")
    for name, tensor in mtp_model.state_dict().items():
        if not name.startswith(("embed_tokens", "shared_head")):  # the target's own
            weights.update(_glm_checkpoint_weights(name, tensor))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def save_demo_dflash(folder: Path, target, sequences: list[torch.LongTensor], steps: int = 40, seed: int = 0) -> None:
    """A seeded one-layer DFlash drafter (transformers' `MuseGlimmerAssistantModel`, head size 64, block size 4) for
    the demo target `target`, reading the outputs of its layers 1, 3 and 5 (not the last: vLLM feeds that one before
    the final norm, transformers after it), distilled on `sequences` and saved in `folder`."""
    torch.manual_seed(seed)
    hidden_size = target.config.hidden_size
    config = MuseGlimmerAssistantConfig(
        hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=1, num_attention_heads=6,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, block_size=4,
        mask_token_id=target.config.vocab_size - 1, target_layer_ids=[1, 3, 5], **NO_SPECIAL)
    model = MuseGlimmerAssistantModel(config)
    distill_dflash(model, target, sequences, steps=steps)
    model.save_pretrained(folder)
