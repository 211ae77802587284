"""Tiny seeded fp32 targets with multi-token-prediction layers (DeepSeek-V3, GLM-4.5 MoE), built locally."""

import torch
from tiny_models import INIT_RANGE, VOCAB_SIZE
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM
from transformers.modeling_layers import MtpModel

MTP_ARCHS = ("deepseek_v3", "glm4_moe")
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def mtp_config(arch: str, num_mtp_layers: int, num_layers: int = 2, hidden_size: int = 32):
    """A tiny MoE config of family `arch` with `num_mtp_layers` MTP layers (routing over 4 experts, 2 per token)."""
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  moe_intermediate_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=4,
                  num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
                  topk_group=1, first_k_dense_replace=1, max_position_embeddings=256, initializer_range=INIT_RANGE,
                  tie_word_embeddings=False, num_mtp_layers=num_mtp_layers, **NO_SPECIAL)
    if arch == "deepseek_v3":  # multi-head latent attention
        return DeepseekV3Config(q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                v_head_dim=8, **{**common, "num_key_value_heads": 4})
    if arch == "glm4_moe":
        return Glm4MoeConfig(head_dim=hidden_size // 4, partial_rotary_factor=0.5, **common)
    raise ValueError(f"unknown MTP architecture {arch!r}")


def build_mtp_target(arch: str, num_mtp_layers: int = 1, seed: int = 1):
    """`(target, mtp_model)`: a seeded fp32 target in eval mode (no EOS/BOS/PAD in its generation config) and
    transformers' `MtpModel` of `num_mtp_layers` layers tied to it, randomly initialized from `seed + 1`."""
    torch.manual_seed(seed)
    config = mtp_config(arch, num_mtp_layers)
    model_class = {"deepseek_v3": DeepseekV3ForCausalLM, "glm4_moe": Glm4MoeForCausalLM}[arch]
    target = model_class(config).eval()
    generation_config = target.generation_config
    generation_config.bos_token_id = generation_config.eos_token_id = generation_config.pad_token_id = None
    torch.manual_seed(seed + 1)
    mtp_model = MtpModel(target, num_mtp_layers).eval()
    mtp_model.layers.apply(target._init_weights)  # the constructor leaves the experts' weights uninitialized
    return target, mtp_model


def distill_mtp(mtp_model, target, sequences: list[torch.LongTensor], steps: int = 60, lr: float = 3e-3):
    """Trains the MTP layers (the target frozen) so that layer k at position t predicts the target's own greedy
    token x_{t+2+k} of `sequences` (each `(1, length)`), from the target's last hidden states: drafts then get
    accepted often. Returns `mtp_model`, in eval mode; the target's parameters are left frozen."""
    target.requires_grad_(False)
    with torch.no_grad():
        features = [target(ids, output_hidden_states=True).hidden_states[-1] for ids in sequences]
    parameters = [p for name, p in mtp_model.named_parameters()
                  if not name.startswith(("embed_tokens", "shared_head"))]
    optimizer = torch.optim.Adam(parameters, lr=lr)
    mtp_model.train()
    for _ in range(steps):
        loss = 0.0
        for ids, hidden in zip(sequences, features):
            layer_hidden = hidden[:, :-1]
            for k in range(len(mtp_model.layers)):
                length = ids.shape[1] - 2 - k
                if length < 1:
                    break
                layer_hidden = layer_hidden[:, :length]
                positions = torch.arange(k + 1, k + 1 + length)[None]
                layer_hidden = mtp_model.forward_layer(k, layer_hidden, positions, None,
                                                       input_ids=ids[:, k + 1 : k + 1 + length])
                logits = mtp_model._project_to_logits(layer_hidden)
                loss = loss + torch.nn.functional.cross_entropy(logits[0], ids[0, k + 2 : k + 2 + length])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return mtp_model.eval()
