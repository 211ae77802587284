"""Tiny seeded fp32 targets with multi-token-prediction layers (DeepSeek-V3, GLM-4.5 MoE), built locally."""

import torch
from tiny_models import INIT_RANGE, VOCAB_SIZE
from safetensors.torch import load_file, save_file
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    MellumConfig,
    MellumForCausalLM,
)
from transformers.modeling_layers import MtpModel

MTP_ARCHS = ("deepseek_v3", "glm4_moe")  # built in memory (transformers loads their MTP weights only at full depth)
MODEL_CLASSES = {"deepseek_v3": DeepseekV3ForCausalLM, "glm4_moe": Glm4MoeForCausalLM, "mellum": MellumForCausalLM}
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
    if arch == "mellum":  # per-layer-type RoPE (the target's rotary serves only the types its layers have)
        moe = ("n_routed_experts", "n_shared_experts", "n_group", "topk_group", "first_k_dense_replace")
        return MellumConfig(head_dim=hidden_size // 4, num_experts=4, mtp_layer_types=["full_attention"],
                            **{k: v for k, v in common.items() if k not in moe})
    raise ValueError(f"unknown MTP architecture {arch!r}")


def build_mtp_target(arch: str, num_mtp_layers: int = 1, seed: int = 1):
    """`(target, mtp_model)`: a seeded fp32 target in eval mode (no EOS/BOS/PAD in its generation config) and
    transformers' `MtpModel` of `num_mtp_layers` layers tied to it, randomly initialized from `seed + 1`."""
    torch.manual_seed(seed)
    config = mtp_config(arch, num_mtp_layers)
    target = MODEL_CLASSES[arch](config).eval()
    generation_config = target.generation_config
    generation_config.bos_token_id = generation_config.eos_token_id = generation_config.pad_token_id = None
    torch.manual_seed(seed + 1)
    mtp_model = MtpModel(target, num_mtp_layers).eval()
    mtp_model.layers.apply(target._init_weights)  # the constructor leaves the experts' weights uninitialized
    return target, mtp_model


def save_mellum_with_mtp(target, mtp_model, folder: str):
    """Saves a Mellum `target` with its MTP layers beside its weights, in Mellum's checkpoint layout (`mtp.layers.K.`
    keys), which transformers' `MtpModel.from_pretrained` reads for any depth; returns the target loaded back from
    `folder` (its `name_or_path` then points at the MTP weights)."""
    target.save_pretrained(folder)
    weights = load_file(f"{folder}/model.safetensors")
    for name, tensor in mtp_model.state_dict().items():
        if not name.startswith(("embed_tokens", "shared_head")):  # the target's own, shared
            weights["mtp." + name.replace(".mtp_block.", ".")] = tensor.contiguous()
    save_file(weights, f"{folder}/model.safetensors", metadata={"format": "pt"})
    loaded = MellumForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    loaded.generation_config = target.generation_config
    return loaded


DFLASH_MASK_TOKEN = VOCAB_SIZE - 2  # PAD (VOCAB_SIZE - 1) is the batch tests' pad token


def build_dflash(target, block_size: int = 4, target_layer_ids=(0, 1), seed: int = 4):
    """A seeded fp32 DFlash drafter (transformers' `MuseGlimmerAssistantModel`, one layer) for `target` (a tiny
    Llama of `tiny_models`), reading the outputs of `target_layer_ids`."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    hidden_size = target.config.hidden_size
    config = MuseGlimmerAssistantConfig(
        hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=hidden_size // 4, max_position_embeddings=256, block_size=block_size,
        mask_token_id=DFLASH_MASK_TOKEN, target_layer_ids=list(target_layer_ids), initializer_range=INIT_RANGE,
        **NO_SPECIAL)
    torch.manual_seed(seed)
    return MuseGlimmerAssistantModel(config).eval()


def check_drafts_match_transformers(target, generator_class, make_drafter, monkeypatch, **generate_kwargs):
    """At batch size 1, chains, greedy, on the "random" and "repetitive" prompts: the draft tokens of our drafter
    (`make_drafter()`) equal those of transformers' candidate generator `generator_class` that
    `target.generate(**generate_kwargs)` sets up, at every step. transformers' generator drafts nothing at the
    first step (it waits for the target's first forward), so ours starts one token later, from the prompt and the
    target's first token: the steps then coincide. Near max_length we draft only what fits (transformers drafts in
    full, even with no room left)."""
    from speculative_helpers import plain_generate, prompt_ids, speculative_generate
    from test_batch_heads import recording

    get_candidates = generator_class.get_candidates
    for name in ("random", "repetitive"):
        theirs = {}

        def record(self, ids, *args, **kwargs):
            candidates, logits = get_candidates(self, ids, *args, **kwargs)
            if candidates.shape[1] > ids.shape[1]:
                theirs[ids.shape[1]] = candidates[0, ids.shape[1]:].tolist()
            return candidates, logits

        monkeypatch.setattr(generator_class, "get_candidates", record)
        target.generate(prompt_ids(name), do_sample=False, max_new_tokens=24, **generate_kwargs)
        drafter, ours = recording(make_drafter())
        first = plain_generate(target, prompt_ids(name), max_new_tokens=1)
        speculative_generate(target, first, drafter, max_new_tokens=23, plain_floor=False)  # a draft every step
        ours = {length: tokens for length, (tokens, _) in ours[0].items()}
        assert {length: theirs.get(length, [])[: len(tokens)] for length, tokens in ours.items()} == ours
        assert len(ours) >= len(theirs) - 1 >= 5


def build_gemma4(sliding_window: int = 128, seed: int = 5):
    """`(target, assistant)`: a seeded fp32 two-layer Gemma 4 text target (a sliding-window then a full-attention
    layer, untied LM head, no EOS/BOS/PAD in its generation config) and a random one-layer-per-type
    `Gemma4AssistantForCausalLM` made for it (transformers >= 5.24), drafting 4 tokens. The target's weights depend on
    `seed` only, not on `sliding_window`."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig

    def text_config(**overrides):
        settings = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16,
                        sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention"],
                        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, max_position_embeddings=256,
                        initializer_range=INIT_RANGE, tie_word_embeddings=False, **NO_SPECIAL)
        return Gemma4TextConfig(**{**settings, **overrides})

    torch.manual_seed(seed)
    target = Gemma4ForCausalLM(text_config()).eval()
    generation_config = target.generation_config
    generation_config.bos_token_id = generation_config.eos_token_id = generation_config.pad_token_id = None
    torch.manual_seed(seed + 1)
    assistant_config = Gemma4AssistantConfig(text_config=text_config(hidden_size=24, intermediate_size=48),
                                             backbone_hidden_size=32)
    assistant = Gemma4AssistantForCausalLM(assistant_config).eval()
    assistant.generation_config.num_assistant_tokens = 4  # transformers' generator has no default (int(None))
    return target, assistant
