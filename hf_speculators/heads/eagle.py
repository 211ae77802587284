"""EAGLE draft heads: one decoder layer (or a few) that drafts from the target's hidden states.

Two architectures, built from small transformers pieces (RMSNorm, MLP, rotary embedding from the DRAFT's config)
and an attention of their own whose keys and values live in a transformers `DynamicCache`:

- `Eagle3Head` (EAGLE-3, Li et al. 2025): `fc` fuses the inputs of three (or more) target decoder layers into one
  hidden state g; the first layer attends over `[input_layernorm(embed(x)) | hidden_norm(g)]` (width 2H); a final
  norm and a draft LM head over a (possibly reduced) draft vocabulary give the logits.
- `EagleHead` (EAGLE-1/2, Li et al. 2024): `fc` over `[embed(x) | f]` with f the target's last hidden state (after
  its final norm); one layer without input norm; the logits come from the TARGET's LM head.

A head maps a pair (feature f_t, token x_{t+1}) at position t to a hidden state that predicts x_{t+2}; drafting
further feeds that hidden state back with the drafted token (see `hf_speculators.drafters.eagle`).
"""

import functools
from types import SimpleNamespace

import torch
from torch import nn


@functools.cache
def _llama():
    """transformers' Llama modeling module, imported when a head is first built: importing it loads transformers'
    quantizer integrations, whose third-party import noise the command line keeps out only around model loading."""
    from transformers.models.llama import modeling_llama

    return modeling_llama


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default feature layers `[2, L // 2, L - 3]` of a target with `num_layers` decoder layers (the
    inputs of those layers, as vLLM and speculators read them)."""
    return [2, num_layers // 2, num_layers - 3]


def head_dim(config) -> int:
    """The attention head width of a transformers config (`head_dim`, else `hidden_size // num_attention_heads`)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class EagleAttention(nn.Module):
    """Multi-head attention with grouped keys/values, rotary positions and an additive float mask, caching its keys
    and values in a transformers `Cache` under `layer_idx`.

    Args:
        config: the draft's transformers config (`num_attention_heads`, `num_key_value_heads`, `head_dim`,
            `hidden_size`, `rms_norm_eps`).
        input_size (`int`): the width of the input (2H for EAGLE-3's first layer, else H).
        layer_idx (`int`): the layer's index in the head's cache.
        qkv_bias (`bool`): biases on the q/k/v projections. o_bias (`bool`): on the output projection.
        qk_norm (`bool`): per-head RMSNorm of queries and keys before the rotation (Qwen3 layers).
    """

    def __init__(self, config, input_size: int, layer_idx: int, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: bool = False):
        super().__init__()
        self.layer_idx, self.head_dim = layer_idx, head_dim(config)
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(input_size, num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(input_size, num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(input_size, num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, config.hidden_size, bias=o_bias)
        self.q_norm = _llama().LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps) if qk_norm else None
        self.k_norm = _llama().LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps) if qk_norm else None
        self.rotate = _llama().apply_rotary_pos_emb  # read here: dynamo warns of the cached `_llama()` in a graph

    def _heads(self, projection, norm, hidden_states):
        batch, length, _ = hidden_states.shape
        states = projection(hidden_states).view(batch, length, -1, self.head_dim)
        return (states if norm is None else norm(states)).transpose(1, 2)  # [batch, heads, length, head_dim]

    def forward(self, hidden_states, position_embeddings, cache, attention_mask):
        """`(batch, q_len, hidden_size)` attention output of `hidden_states` `(batch, q_len, input_size)`, after the
        cache's keys and values; `attention_mask` is `None` (one query after the cache) or `(batch, 1, q_len,
        kv_len)`, additive float or boolean (True: attend), as `scaled_dot_product_attention` takes it."""
        query = self._heads(self.q_proj, self.q_norm, hidden_states)
        key = self._heads(self.k_proj, self.k_norm, hidden_states)
        value = self._heads(self.v_proj, None, hidden_states)
        query, key = self.rotate(query, key, *position_embeddings)
        key, value = cache.update(key, value, self.layer_idx)
        output = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                            enable_gqa=True)
        return self.o_proj(output.transpose(1, 2).flatten(2))


class EagleDecoderLayer(nn.Module):
    """A pre-norm decoder layer of an EAGLE head, in one of three forms (`input_form`):

    - `"eagle3"`: EAGLE-3's first layer. Its input is `[embeds | hidden]` (width 2H); attention reads
      `[input_layernorm(embeds) | hidden_norm(hidden)]`; the residual is `hidden` (`hidden_norm(hidden)` with
      `norm_before_residual`).
    - `"norm"`: a plain layer, attention over `input_layernorm(hidden)`.
    - `"none"`: EAGLE-1/2's first layer: no input norm.
    """

    def __init__(self, config, layer_idx: int, input_form: str = "norm", norm_before_residual: bool = False,
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm: bool = False):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        width = 2 * size if input_form == "eagle3" else size
        self.norm_before_residual = norm_before_residual
        self.hidden_norm = _llama().LlamaRMSNorm(size, eps=eps) if input_form == "eagle3" else None
        self.input_layernorm = _llama().LlamaRMSNorm(size, eps=eps) if input_form != "none" else None
        self.self_attn = EagleAttention(config, width, layer_idx, qkv_bias, o_bias, qk_norm)
        self.post_attention_layernorm = _llama().LlamaRMSNorm(size, eps=eps)
        mlp_config = SimpleNamespace(hidden_size=size, intermediate_size=config.intermediate_size,
                                     mlp_bias=bool(getattr(config, "mlp_bias", False)), hidden_act=config.hidden_act)
        self.mlp = _llama().LlamaMLP(mlp_config)

    def forward(self, hidden_states, position_embeddings, cache, attention_mask):
        if self.hidden_norm is not None:
            embeds, hidden = hidden_states.chunk(2, dim=-1)
            normed = self.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            attention_input = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        else:
            residual = hidden_states
            attention_input = hidden_states if self.input_layernorm is None else self.input_layernorm(hidden_states)
        hidden_states = residual + self.self_attn(attention_input, position_embeddings, cache, attention_mask)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def _run_layers(head, hidden_states, position_ids, cache, attention_mask):
    position_embeddings = head.rotary_emb(hidden_states, position_ids)
    for layer in head.layers:
        hidden_states = layer(hidden_states, position_embeddings, cache, attention_mask)
    return hidden_states


class Eagle3Head(nn.Module):
    """An EAGLE-3 draft head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
    via Training-Time Test"), with the options of vllm-project/speculators' `eagle3` format.

    Module names follow that format: `embed_tokens` (optional: the target's embeddings otherwise), `input_norm`
    (`norm_before_fc`) or `fc_norm.{i}` (`fc_norm`), `fc`, `layers.{i}`, `norm`, `lm_head`, and the buffer `d2t`
    (draft id -> target id offsets) when the draft vocabulary is smaller than the target's.

    Args:
        config: a transformers `LlamaConfig` or `Qwen3Config` of the draft layers (`hidden_size` H,
            `num_hidden_layers`, heads, `intermediate_size`, `rms_norm_eps`, rope settings, `vocab_size` = the
            TARGET's vocabulary). The rotary embedding is built from it.
        draft_vocab_size (`int`, *optional*): rows of `lm_head`; defaults to `config.vocab_size` (no `d2t`).
        aux_layer_ids (`list[int]`, *optional*): the target layers whose inputs are fused; `None`: `[2, L // 2,
            L - 3]` of the target, resolved when drafting starts.
        num_aux (`int`, defaults to 3): the number of fused layers when `aux_layer_ids` is `None`.
        target_hidden_size (`int`, *optional*): the target's hidden size, when it differs from H.
        norm_before_residual, norm_before_fc, fc_norm, norm_output (`bool`): the speculators flags (see their
            docs): residual after `hidden_norm`; one RMSNorm over the fused features before `fc`; one RMSNorm per
            aux feature before `fc`; feed the post-norm hidden state back while drafting (EAGLE 3.1).
        own_embeddings (`bool`): whether the head holds its own `embed_tokens` (else the target's are used).
        qk_norm (`bool`): Qwen3-style per-head q/k norms. attention_bias (`bool`): biases on q/k/v/o.

    Raises:
        `ValueError`: `norm_before_fc` and `fc_norm` together, or `aux_layer_ids` of another length than `num_aux`.
    """

    def __init__(self, config, draft_vocab_size: int | None = None, aux_layer_ids: list[int] | None = None,
                 num_aux: int = 3, target_hidden_size: int | None = None, norm_before_residual: bool = False,
                 norm_before_fc: bool = False, fc_norm: bool = False, norm_output: bool = False,
                 own_embeddings: bool = False, qk_norm: bool = False, attention_bias: bool = False):
        super().__init__()
        if norm_before_fc and fc_norm:
            raise ValueError("norm_before_fc and fc_norm are exclusive: an EAGLE-3 head sets at most one of them.")
        if aux_layer_ids is not None and len(aux_layer_ids) != num_aux:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids {aux_layer_ids} must list {num_aux} layers.")
        size, eps = config.hidden_size, config.rms_norm_eps
        self.config, self.aux_layer_ids, self.norm_output = config, aux_layer_ids, norm_output
        self.vocab_size, self.draft_vocab_size = config.vocab_size, draft_vocab_size or config.vocab_size
        self.target_hidden_size = target_hidden_size or size
        self.flags = dict(norm_before_residual=norm_before_residual, norm_before_fc=norm_before_fc, fc_norm=fc_norm,
                          norm_output=norm_output)
        self.embed_tokens = nn.Embedding(config.vocab_size, size) if own_embeddings else None
        fused = num_aux * self.target_hidden_size
        self.input_norm = _llama().LlamaRMSNorm(fused, eps=eps) if norm_before_fc else None
        self.fc_norm = (nn.ModuleList(_llama().LlamaRMSNorm(self.target_hidden_size, eps=eps) for _ in range(num_aux))
                        if fc_norm else None)
        self.fc = nn.Linear(fused, size, bias=False)
        options = dict(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=qk_norm)
        self.layers = nn.ModuleList(
            [EagleDecoderLayer(config, 0, "eagle3", norm_before_residual, **options)]
            + [EagleDecoderLayer(config, i, "norm", **options) for i in range(1, config.num_hidden_layers)]
        )
        self.norm = _llama().LlamaRMSNorm(size, eps=eps)
        self.lm_head = nn.Linear(size, self.draft_vocab_size, bias=False)
        reduced = self.draft_vocab_size != config.vocab_size
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long) if reduced else None)
        self.rotary_emb = _llama().LlamaRotaryEmbedding(config)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def feature_points(self, num_target_layers: int) -> tuple[list[int], bool]:
        """`(layer_ids, final_norm)` read from a target of `num_target_layers` layers: the aux layers' inputs."""
        layer_ids = self.aux_layer_ids or default_aux_layer_ids(num_target_layers)
        return list(layer_ids), False

    def combine(self, features: torch.FloatTensor) -> torch.FloatTensor:
        """The fused hidden state g `(..., H)` of target features `(..., num_aux * target_hidden_size)`."""
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(features)

    def forward(self, inputs_embeds, hidden_states, position_ids, cache, attention_mask, target_head=None):
        """One pass over pairs (hidden state, token embedding).

        Args:
            inputs_embeds (`torch.FloatTensor` of shape `(1, q_len, H)`): embeddings of the tokens x_{t+1}.
            hidden_states (`torch.FloatTensor` of shape `(1, q_len, H)`): g_t (`combine`) or a fed-back state.
            position_ids (`torch.LongTensor` of shape `(1, q_len)`): t for the pair (g_t, x_{t+1}).
            cache (`DynamicCache`): the head's keys and values of earlier pairs.
            attention_mask (`torch.FloatTensor`, *optional*): additive `(1, 1, q_len, kv_len)`, `None` for one
                query after the cache.
            target_head: unused (EAGLE-3 has its own LM head).

        Returns:
            `(feedback, logits)`: the hidden state to feed back `(1, q_len, H)` (pre-norm, post-norm with
            `norm_output`) and draft-vocabulary logits `(1, q_len, draft_vocab_size)`.
        """
        hidden_states = torch.cat([inputs_embeds, hidden_states], dim=-1)
        hidden_states = _run_layers(self, hidden_states, position_ids, cache, attention_mask)
        normed = self.norm(hidden_states)
        return (normed if self.norm_output else hidden_states), self.lm_head(normed)


class EagleHead(nn.Module):
    """An EAGLE-1/2 draft head (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
    Uncertainty"; EAGLE-2 drafts a dynamic tree with the same head): `fc` over `[embed(x_{t+1}) | f_t]`, with f_t
    the target's last hidden state after its final norm; decoder layers, the first without input norm; no final
    norm; logits through the target's LM head.

    Module names follow SafeAILab's files: `fc` (with or without bias), `layers.{i}`, optional `embed_tokens`.

    Args:
        config: a transformers `LlamaConfig` of the draft layers (`vocab_size` = the target's vocabulary).
        fc_bias (`bool`, defaults to `True`): whether `fc` has a bias (SafeAILab's `"bias"` setting).
        qkv_bias (`bool`): biases on q/k/v (SafeAILab's `qkv_bias`, Qwen2 targets). o_bias (`bool`): on o_proj.
        own_embeddings (`bool`): whether the head holds its own `embed_tokens`.
    """

    def __init__(self, config, fc_bias: bool = True, qkv_bias: bool = False, o_bias: bool = False,
                 own_embeddings: bool = False):
        super().__init__()
        size = config.hidden_size
        self.config, self.vocab_size, self.target_hidden_size = config, config.vocab_size, size
        self.draft_vocab_size, self.d2t = config.vocab_size, None
        self.embed_tokens = nn.Embedding(config.vocab_size, size) if own_embeddings else None
        self.fc = nn.Linear(2 * size, size, bias=fc_bias)
        self.layers = nn.ModuleList(EagleDecoderLayer(config, i, "none" if i == 0 else "norm", qkv_bias=qkv_bias,
                                                      o_bias=o_bias) for i in range(config.num_hidden_layers))
        self.rotary_emb = _llama().LlamaRotaryEmbedding(config)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def feature_points(self, num_target_layers: int) -> tuple[list[int], bool]:
        """`(layer_ids, final_norm)`: the target's final norm output only."""
        return [], True

    def combine(self, features: torch.FloatTensor) -> torch.FloatTensor:
        """The target's final hidden states, as they are."""
        return features

    def forward(self, inputs_embeds, hidden_states, position_ids, cache, attention_mask, target_head=None):
        """As `Eagle3Head.forward`; the logits `(1, q_len, vocab_size)` come from `target_head` (the target's LM
        head), applied to the layers' output, which is also the state fed back."""
        hidden_states = self.fc(torch.cat([inputs_embeds, hidden_states], dim=-1))
        hidden_states = _run_layers(self, hidden_states, position_ids, cache, attention_mask)
        return hidden_states, target_head(hidden_states)


def check_head_fits(head, target) -> None:
    """Raises `ValueError`, naming the field, when `head` cannot draft for `target`: another vocabulary
    (`vocab_size`), another hidden size (`target_hidden_size` / `hidden_size`), feature layers the target does not
    have (`eagle_aux_hidden_state_layer_ids`), target embeddings of the wrong width (`embed_tokens`), or `d2t`
    offsets pointing outside the vocabulary."""
    vocab_size = target.get_output_embeddings().weight.shape[0]
    if head.vocab_size != vocab_size:
        raise ValueError(
            f"The EAGLE head's vocab_size is {head.vocab_size} and the target scores {vocab_size} tokens: the head was "
            "trained for another target. Use a head made for this model."
        )
    hidden_size = target.config.get_text_config().hidden_size
    if head.target_hidden_size != hidden_size:
        raise ValueError(
            f"The EAGLE head reads target features of target_hidden_size={head.target_hidden_size} (its hidden_size "
            f"when unset), but this target's hidden_size is {hidden_size}: the head was made for another model."
        )
    if head.embed_tokens is None and target.get_input_embeddings().weight.shape[1] != head.hidden_size:
        raise ValueError(
            f"The EAGLE head has no embed_tokens and the target's embeddings are {hidden_size} wide, not the head's "
            f"hidden_size {head.hidden_size}: a checkpoint with its own embed_tokens is needed for this target."
        )
    num_layers = target.config.get_text_config().num_hidden_layers
    layer_ids, _ = head.feature_points(num_layers)
    if any(not 0 <= i < num_layers for i in layer_ids):
        raise ValueError(
            f"The EAGLE head's eagle_aux_hidden_state_layer_ids {layer_ids} are outside this target's decoder layers "
            f"0..{num_layers - 1}: the head was made for a deeper model."
        )
    if head.d2t is not None and int((torch.arange(len(head.d2t)) + head.d2t.cpu()).max()) >= vocab_size:
        raise ValueError(f"The EAGLE head's d2t maps draft ids past the target's {vocab_size} tokens.")
