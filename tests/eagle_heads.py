"""Random EAGLE heads for the tests, saved in each checkpoint format, and a reference forward written from the
formats' definitions (plain tensor code on the saved tensors, independent of hf_speculators.heads)."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, Qwen3Config

from hf_speculators.heads.eagle import Eagle3Head, EagleHead
from hf_speculators.heads.eagle_formats import save_eagle3_head
from tiny_models import VOCAB_SIZE

HIDDEN = 48
AUX_LAYER_IDS = [0, 2, 3]  # of 4-layer test targets: the embeddings' output and two later layers' inputs


def layer_config(model_type: str = "llama", num_layers: int = 1, rope_theta: float | None = 500.0, **extra):
    """The draft layers' config: H = 48 as the test targets, 4 heads of 12, 2 KV heads."""
    fields = dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB_SIZE, max_position_embeddings=256,
                  **extra)
    if rope_theta is not None:
        fields["rope_theta"] = rope_theta
    return (Qwen3Config(head_dim=HIDDEN // 4, **fields) if model_type == "qwen3" else LlamaConfig(**fields))


def randomize(head, seed: int):
    """Random weights of a useful scale (norm weights around 1), and a random sorted draft vocabulary for `d2t`."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in head.state_dict().items():
            if name == "d2t":
                draft_ids = torch.randperm(VOCAB_SIZE, generator=generator)[: len(tensor)].sort().values
                tensor.copy_(draft_ids - torch.arange(len(tensor)))
            elif "norm" in name:
                tensor.copy_(1 + 0.1 * torch.randn(tensor.shape, generator=generator))
            else:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) / tensor.shape[-1] ** 0.5 * 2)
    return head.eval()


def random_eagle3(seed: int = 0, draft_vocab_size: int | None = None, model_type: str = "llama", num_layers: int = 1,
                  aux_layer_ids=AUX_LAYER_IDS, rope_theta: float | None = 500.0, **flags) -> Eagle3Head:
    config = layer_config(model_type, num_layers, rope_theta)
    head = Eagle3Head(config, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids,
                      qk_norm=model_type == "qwen3", **flags)
    return randomize(head, seed)


def random_eagle(seed: int = 0, fc_bias: bool = True, qkv_bias: bool = False) -> EagleHead:
    return randomize(EagleHead(layer_config(), fc_bias=fc_bias, qkv_bias=qkv_bias), seed)


def _state(head) -> dict:
    return {name: tensor.detach().clone().contiguous() for name, tensor in head.state_dict().items()}


def save_in_format(head, folder: Path, fmt: str) -> Path:
    """Writes `head` as a checkpoint of format `fmt` would hold it (config.json and weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = _state(head)
    if fmt == "speculators-eagle3":
        return save_eagle3_head(head, folder, verifier_name_or_path="tests/target", num_draft_tokens=3)
    config = head.config.to_dict()  # SafeAILab writes rope_theta flat, or nothing for the default base 10000
    rope_theta = config.pop("rope_parameters")["rope_theta"]
    if rope_theta != 10000.0:
        config["rope_theta"] = rope_theta
    if fmt == "safeailab-eagle3":
        config.update(draft_vocab_size=head.draft_vocab_size, eagle_aux_hidden_state_layer_ids=head.aux_layer_ids)
        state = {name.replace("layers.0.", "midlayer.", 1): tensor for name, tensor in state.items()}
        if head.d2t is not None:  # SafeAILab saves both buffers
            state["t2d"] = torch.zeros(head.vocab_size, dtype=torch.bool).index_fill_(
                0, torch.arange(len(head.d2t)) + head.d2t, True)
        torch.save(state, folder / "pytorch_model.bin")
    elif fmt == "safeailab-eagle":
        config.update(bias="fc.bias" in state, qkv_bias=head.layers[0].self_attn.q_proj.bias is not None)
        torch.save(state, folder / "pytorch_model.bin")
    elif fmt == "speculators-eagle":
        layers = config
        config = {"speculators_model_type": "eagle", "transformer_layer_config": layers, "layernorms": False,
                  "fusion_bias": "fc.bias" in state, "speculators_config": {}}
        state = {name.replace("fc.", "fusion_fc.", 1).replace("layers.0.", "transformer.", 1): tensor
                 for name, tensor in state.items()}
        save_file(state, str(folder / "model.safetensors"))
    else:
        raise ValueError(fmt)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# ---------------------------------------------------------------- reference forward, from the formats' definitions


def read_checkpoint(folder: Path) -> tuple[dict, dict]:
    """config.json and tensors, names mapped onto speculators' eagle3 / SafeAILab's eagle names."""
    config = json.loads((folder / "config.json").read_text())
    if (folder / "model.safetensors").exists():
        state = load_file(str(folder / "model.safetensors"))
    else:
        state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    renamed = {}
    for name, tensor in state.items():
        for old, new in (("midlayer.", "layers.0."), ("fusion_fc.", "fc."), ("transformer.", "layers.0.")):
            if name.startswith(old):
                name = new + name[len(old):]
        renamed[name] = tensor
    return config, renamed


def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x, positions, theta):
    """RoPE (rotate-half form) of `x` `(heads, T, d)` at `positions` `(T,)` with base `theta`."""
    d = x.shape[-1]
    angles = positions[:, None].double() / theta ** (torch.arange(0, d, 2).double() / d)
    cos, sin = torch.cat([angles.cos()] * 2, -1).float(), torch.cat([angles.sin()] * 2, -1).float()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _linear(state, name, x):
    bias = state.get(name + ".bias")
    return x @ state[name + ".weight"].T + (0 if bias is None else bias)


def _attention(state, prefix, x, layers: dict, theta):
    """Causal multi-head attention over the whole sequence `x` `(T, width)`, grouped keys/values."""
    heads, kv_heads, eps = layers["num_attention_heads"], layers["num_key_value_heads"], layers["rms_norm_eps"]
    positions = torch.arange(x.shape[0])

    def split(name, count):
        states = _linear(state, f"{prefix}.{name}_proj", x).view(x.shape[0], count, -1)
        if f"{prefix}.{name}_norm.weight" in state:  # Qwen3 layers: per-head q/k norms
            states = _rms(states, state[f"{prefix}.{name}_norm.weight"], eps)
        return states.transpose(0, 1)

    q, k, v = split("q", heads), split("k", kv_heads), split("v", kv_heads)
    q, k = _rotate(q, positions, theta), _rotate(k, positions, theta)
    k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
    scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones_like(scores[0], dtype=torch.bool).triu(1), float("-inf"))
    return _linear(state, f"{prefix}.o_proj", (scores.softmax(-1) @ v).transpose(0, 1).flatten(1))


def _mlp(state, prefix, x):
    gate, up = _linear(state, f"{prefix}.gate_proj", x), _linear(state, f"{prefix}.up_proj", x)
    return _linear(state, f"{prefix}.down_proj", torch.nn.functional.silu(gate) * up)


def _layer_tail(state, prefix, residual, attention_output, eps):
    hidden = residual + attention_output
    return hidden + _mlp(state, f"{prefix}.mlp", _rms(hidden, state[f"{prefix}.post_attention_layernorm.weight"], eps))


@torch.no_grad()
def reference_draft_ids(folder: Path, fmt: str, target, sequence: torch.LongTensor) -> list[int]:
    """The draft head's top token (a target id) after every pair (f_t, x_{t+1}) of `sequence` `(1, T)`: entry t is
    the head's guess for x_{t+2}, from one causal pass over all pairs, as the format defines the head."""
    config, state = read_checkpoint(folder)
    layers = config.get("transformer_layer_config", config)
    eps = layers.get("rms_norm_eps", 1e-6)
    theta = layers.get("rope_theta") or (layers.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    hidden_states = target(sequence, output_hidden_states=True).hidden_states
    embed = state.get("embed_tokens.weight", target.get_input_embeddings().weight)
    embeds = embed[sequence[0, 1:]]  # x_{t+1}
    if fmt.endswith("eagle3"):  # fc over the aux layers' inputs; first layer over [norm(embed) | norm(g)]
        ids = config.get("eagle_aux_hidden_state_layer_ids") or [2, target.config.num_hidden_layers // 2,
                                                                   target.config.num_hidden_layers - 3]
        features = torch.cat([hidden_states[i][0, :-1] for i in ids], -1)
        if config.get("norm_before_fc"):
            features = _rms(features, state["input_norm.weight"], eps)
        if config.get("fc_norm"):
            features = torch.cat([_rms(c, state[f"fc_norm.{i}.weight"], eps)
                                  for i, c in enumerate(features.chunk(len(ids), -1))], -1)
        g = _linear(state, "fc", features)
        normed = _rms(g, state["layers.0.hidden_norm.weight"], eps)
        attention_input = torch.cat([_rms(embeds, state["layers.0.input_layernorm.weight"], eps), normed], -1)
        residual = normed if config.get("norm_before_residual") else g
        hidden = _layer_tail(state, "layers.0", residual, _attention(state, "layers.0.self_attn", attention_input,
                                                                     layers, theta), eps)
        for i in range(1, layers["num_hidden_layers"]):
            x = _rms(hidden, state[f"layers.{i}.input_layernorm.weight"], eps)
            hidden = _layer_tail(state, f"layers.{i}", hidden, _attention(state, f"layers.{i}.self_attn", x, layers,
                                                                          theta), eps)
        draft_ids = _linear(state, "lm_head", _rms(hidden, state["norm.weight"], eps)).argmax(-1)
        return (draft_ids + state["d2t"][draft_ids] if "d2t" in state else draft_ids).tolist()
    # EAGLE-1/2: fc over [embed | last hidden state], one layer without input norm, the target's LM head
    x = _linear(state, "fc", torch.cat([embeds, hidden_states[-1][0, :-1]], -1))
    hidden = _layer_tail(state, "layers.0", x, _attention(state, "layers.0.self_attn", x, layers, theta), eps)
    return target.get_output_embeddings()(hidden).argmax(-1).tolist()


@torch.no_grad()
def fit_lm_head(head: Eagle3Head, target, sequences) -> Eagle3Head:
    """Refits `head.lm_head` by least squares so that its first draft token often (not always) is the target's
    greedy next token on `sequences` (a random head is almost never accepted; this one is, in part)."""
    from transformers import DynamicCache

    from hf_speculators.tree import TokenTree

    rows, labels = [], []
    for sequence in sequences:
        hidden_states = target(sequence, output_hidden_states=True).hidden_states
        features = torch.cat([hidden_states[i][0, :-1] for i in head.feature_points(len(hidden_states) - 1)[0]], -1)
        num_pairs = features.shape[0]
        mask = TokenTree.chain(0).attention_mask(num_pairs, num_pairs, torch.float32)
        feedback, _ = head(target.get_input_embeddings()(sequence[:, 1:]), head.combine(features)[None],
                           torch.arange(num_pairs)[None], DynamicCache(), mask)
        rows.append(head.norm(feedback[0])[:-1])  # the pair at t predicts x_{t+2}
        labels.append(sequence[0, 2:])
    draft_ids = torch.arange(head.draft_vocab_size)
    target_ids = draft_ids if head.d2t is None else draft_ids + head.d2t
    one_hot = (torch.cat(labels)[:, None] == target_ids[None]).float()
    head.lm_head.weight.copy_(torch.linalg.lstsq(torch.cat(rows), one_hot).solution.T)
    return head
