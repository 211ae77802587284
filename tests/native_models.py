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


def distill_dflash(model, target, sequences: list[torch.LongTensor], steps: int = 60, lr: float = 3e-3):
    """Trains the DFlash drafter (the target frozen) so that the block anchored at each position a of `sequences`
    (each `(1, length)`), with the context of the target's features before a, predicts the tokens after a.
    Returns `model`, in eval mode."""
    target.requires_grad_(False)
    block = model.config.block_size
    with torch.no_grad():
        features = []
        for ids in sequences:
            hidden_states = target(ids, output_hidden_states=True).hidden_states
            features.append(torch.cat([hidden_states[i + 1] for i in model.config.target_layer_ids], dim=-1))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    embeddings, head = target.get_input_embeddings(), target.get_output_embeddings()
    model.train()
    for _ in range(steps):
        loss = 0.0
        for ids, context in zip(sequences, features):
            for anchor in range(1, ids.shape[1] - block + 1, 2):
                noise = torch.full((1, block), model.config.mask_token_id)
                noise[0, 0] = ids[0, anchor]
                out = model(noise_embeds=embeddings(noise), context_hidden_states=context[:, :anchor],
                            position_ids=torch.arange(anchor + block)[None])
                logits = head(out.last_hidden_state[:, 1:])
                loss = loss + torch.nn.functional.cross_entropy(logits[0], ids[0, anchor + 1 : anchor + block])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


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
        speculative_generate(target, first, drafter, max_new_tokens=23)
        ours = {length: tokens for length, (tokens, _) in ours[0].items()}
        assert {length: theirs.get(length, [])[: len(tokens)] for length, tokens in ours.items()} == ours
        assert len(ours) >= len(theirs) - 1 >= 5
