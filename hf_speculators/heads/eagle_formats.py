"""EAGLE checkpoint formats: one reader per format mapping its files onto `Eagle3Head` or `EagleHead`, a detector,
and a writer of the speculators `eagle3` format (which vLLM loads).

Formats (`EAGLE_FORMATS`):

- `"speculators-eagle3"`: vllm-project/speculators, `config.json` with `speculators_model_type: "eagle3"`, a
  `transformer_layer_config` (Llama or Qwen3 layers) and the flags `norm_before_residual`, `norm_before_fc`,
  `fc_norm`, `norm_output`; tensors `layers.{i}.*`, `fc`, `norm`, `lm_head`, `d2t`/`t2d`, optional `embed_tokens`.
- `"safeailab-eagle3"`: SafeAILab/EAGLE's EAGLE-3 files: a Llama `config.json` (with `draft_vocab_size`); tensors
  `midlayer.*` (the first layer), `fc`, `norm`, `lm_head`, `d2t`/`t2d`. RoPE comes from this config (default base
  10000), never from the target's.
- `"safeailab-eagle"`: SafeAILab's EAGLE-1/2 files: a Llama `config.json`; `fc` over `[embedding, hidden]` (with or
  without bias), `layers.0.*` without input norm.
- `"speculators-eagle"`: speculators' former `eagle` type (EAGLE-1/2, HASS): `fusion_fc`, `transformer.*`.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from .eagle import Eagle3Head, EagleHead
from ..folders import write_folder
from .files import read_json, read_weights

EAGLE_FORMATS = ("speculators-eagle3", "safeailab-eagle3", "safeailab-eagle", "speculators-eagle")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "pytorch_model.pt")
EAGLE3_LAYER_TYPES = ("llama", "qwen3")  # the layer types of speculators' eagle3 (qwen3: per-head q/k norms)
EAGLE_LAYER_TYPES = ("llama", "qwen2")
EAGLE3_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def _read(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: an EAGLE head checkpoint needs one beside its weights.")
    return read_json(config_path), read_weights(folder, WEIGHT_FILES)


def _format(config: dict, state: dict, folder: Path) -> str:
    if "speculators_model_type" in config:
        model_type = config["speculators_model_type"]
        if model_type in ("eagle3", "eagle"):
            return f"speculators-{model_type}"
        raise ValueError(
            f"{folder}: speculators_model_type={model_type!r} is not an EAGLE head; EagleDrafter reads 'eagle3' and "
            "'eagle'."
        )
    if any(name.startswith("midlayer.") for name in state):
        return "safeailab-eagle3"
    if "fc.weight" in state and any(name.startswith("layers.0.") for name in state):
        return "safeailab-eagle"
    raise ValueError(
        f"{folder}: not an EAGLE checkpoint of a known format ({', '.join(EAGLE_FORMATS)}): its config.json has no "
        "speculators_model_type and its weights neither midlayer.* (EAGLE-3) nor fc and layers.0.* (EAGLE-1/2)."
    )


def detect_eagle_format(folder: str | Path) -> str:
    """The format of the EAGLE checkpoint in `folder`, one of `EAGLE_FORMATS`, from its `config.json` and tensor
    names.

    Raises:
        `FileNotFoundError`: no `config.json` or no weight file (`model.safetensors`, `pytorch_model.bin`).
        `ValueError`: files of no known EAGLE format, or a speculators type that is not an EAGLE head.
    """
    folder = Path(folder)
    return _format(*_read(folder), folder)


def _layer_config(fields, field: str, types: tuple[str, ...], default_type: str, folder: Path):
    """A transformers config of the draft layers from `fields` (the dict read at `field`)."""
    if not isinstance(fields, dict):
        raise ValueError(f"{folder}: config.json has no {field} mapping.")
    model_type = fields.get("model_type", default_type)
    if model_type not in types:
        raise ValueError(f"{folder}: {field}.model_type={model_type!r} is not supported; use one of {list(types)}.")
    if "sliding_attention" in (fields.get("layer_types") or []):
        raise ValueError(f"{folder}: {field}.layer_types has sliding-window layers, which EAGLE heads here do not run.")
    return AutoConfig.for_model(model_type, **{k: v for k, v in fields.items() if k != "model_type"})


def _load(head, state: dict[str, torch.Tensor], folder: Path, fmt: str):
    """Loads `state` into `head` strictly; a missing, unexpected or misshapen tensor raises `ValueError` naming it."""
    expected = head.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    misshapen = [f"{name} {tuple(state[name].shape)} (expected {tuple(tensor.shape)})"
                 for name, tensor in expected.items() if name in state and state[name].shape != tensor.shape]
    if missing or unexpected or misshapen:
        raise ValueError(
            f"{folder}: the {fmt} weights do not fit the head its config.json describes: missing {missing}, "
            f"unexpected {unexpected}, misshapen {misshapen}."
        )
    head.load_state_dict(state)
    return head.eval()


def _vocab_tensors(state: dict, draft_vocab_size: int, vocab_size: int) -> dict:
    """`state` without `t2d` (implied by `d2t`), and without `d2t` when the draft vocabulary is the target's."""
    drop = {"t2d"} | ({"d2t"} if draft_vocab_size == vocab_size else set())
    return {name: tensor for name, tensor in state.items() if name not in drop}


def _aux_layer_ids(config: dict):
    nested = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    return config.get("eagle_aux_hidden_state_layer_ids", nested.get("eagle_aux_hidden_state_layer_ids"))


def _eagle3_head(layer_config, config: dict, state: dict, **flags) -> Eagle3Head:
    aux_layer_ids = _aux_layer_ids(config)
    fused = state.get("fc.weight")
    target_hidden_size = config.get("target_hidden_size")
    num_aux = (len(aux_layer_ids) if aux_layer_ids else
               fused.shape[1] // (target_hidden_size or layer_config.hidden_size) if fused is not None else 3)
    draft_vocab_size = config.get("draft_vocab_size", layer_config.vocab_size)
    return Eagle3Head(layer_config, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids, num_aux=num_aux,
                      target_hidden_size=target_hidden_size, own_embeddings="embed_tokens.weight" in state, **flags)


def read_speculators_eagle3(config: dict, state: dict, folder: Path) -> Eagle3Head:
    """An `Eagle3Head` from speculators `eagle3` files (the layer type from `transformer_layer_config.model_type`,
    Qwen3 when unset, as speculators defaults)."""
    layer_config = _layer_config(config.get("transformer_layer_config"), "transformer_layer_config",
                                 EAGLE3_LAYER_TYPES, "qwen3", folder)
    bad = [flag for flag in EAGLE3_FLAGS if not isinstance(config.get(flag, False), bool)]
    if bad:
        raise ValueError(f"{folder}: {bad[0]}={config[bad[0]]!r} must be true or false.")
    if config.get("norm_before_fc") and config.get("fc_norm"):
        raise ValueError(f"{folder}: norm_before_fc and fc_norm are both set; a head uses at most one of them.")
    head = _eagle3_head(layer_config, config, state, **{flag: config.get(flag, False) for flag in EAGLE3_FLAGS},
                        qk_norm=layer_config.model_type == "qwen3",
                        attention_bias=bool(getattr(layer_config, "attention_bias", False)))
    return _load(head, _vocab_tensors(state, head.draft_vocab_size, head.vocab_size), folder, "speculators-eagle3")


def read_safeailab_eagle3(config: dict, state: dict, folder: Path) -> Eagle3Head:
    """An `Eagle3Head` from SafeAILab EAGLE-3 files (`midlayer.*` is the first layer)."""
    layer_config = _layer_config(config, "config", ("llama",), "llama", folder)
    head = _eagle3_head(layer_config, config, state)
    state = {name.replace("midlayer.", "layers.0.", 1) if name.startswith("midlayer.") else name: tensor
             for name, tensor in state.items()}
    return _load(head, _vocab_tensors(state, head.draft_vocab_size, head.vocab_size), folder, "safeailab-eagle3")


def read_safeailab_eagle(config: dict, state: dict, folder: Path) -> EagleHead:
    """An `EagleHead` from SafeAILab EAGLE-1/2 files (`fc` bias as the weights have it; `qkv_bias` from the config)."""
    layer_config = _layer_config(config, "config", ("llama",), "llama", folder)
    qkv_bias = bool(config.get("qkv_bias", False))
    head = EagleHead(layer_config, fc_bias="fc.bias" in state, qkv_bias=qkv_bias,
                     own_embeddings="embed_tokens.weight" in state)
    return _load(head, state, folder, "safeailab-eagle")


def read_speculators_eagle(config: dict, state: dict, folder: Path) -> EagleHead:
    """An `EagleHead` from speculators `eagle` files (`fusion_fc` -> `fc`, `transformer.` -> `layers.0.`); only
    `layernorms: false` (EAGLE-1/2, HASS) is supported."""
    if config.get("layernorms", False):
        raise ValueError(f"{folder}: layernorms=true (extra embedding and pre-LM-head norms) is not supported.")
    layer_config = _layer_config(config.get("transformer_layer_config"), "transformer_layer_config",
                                 EAGLE_LAYER_TYPES, "llama", folder)
    qwen2 = layer_config.model_type == "qwen2"
    attention_bias = bool(getattr(layer_config, "attention_bias", False))
    head = EagleHead(layer_config, fc_bias=bool(config.get("fusion_bias", False)),
                     qkv_bias=qwen2 or attention_bias, o_bias=attention_bias and not qwen2,
                     own_embeddings="embed_tokens.weight" in state)
    renames = (("fusion_fc.", "fc."), ("transformer.", "layers.0."))
    state = {next((new + name[len(old):] for old, new in renames if name.startswith(old)), name): tensor
             for name, tensor in state.items()}
    return _load(head, state, folder, "speculators-eagle")


READERS = {
    "speculators-eagle3": read_speculators_eagle3,
    "safeailab-eagle3": read_safeailab_eagle3,
    "safeailab-eagle": read_safeailab_eagle,
    "speculators-eagle": read_speculators_eagle,
}


def load_eagle_head(folder: str | Path) -> "Eagle3Head | EagleHead":
    """The EAGLE head saved in `folder`, in whichever of `EAGLE_FORMATS` its files are (`detect_eagle_format`).

    Weights are read as data only (safetensors, or a pickle through `torch.load(weights_only=True)`).

    Raises:
        `FileNotFoundError`: no `config.json` or weight file.
        `ValueError`: an unknown format, an unsupported layer type or flag, or tensors that do not fit the config,
            each naming the field or tensor.
    """
    folder = Path(folder)
    config, state = _read(folder)
    return READERS[_format(config, state, folder)](config, state, folder)


LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_hidden_layers", "rms_norm_eps", "vocab_size", "max_position_embeddings", "hidden_act")


def _layer_dict(config) -> dict:
    """The draft layers' config as speculators writes it (a diff against the defaults), with the fields vLLM reads
    written out and the RoPE base also as `rope_theta` for readers of older transformers."""
    fields = config.to_diff_dict()
    fields.update({name: getattr(config, name) for name in LAYER_FIELDS if getattr(config, name, None) is not None})
    rope = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" in rope:
        fields["rope_theta"] = rope["rope_theta"]
    fields.pop("transformers_version", None)
    return fields


SPECULATORS_VERSION = "0.9.0"  # the speculators release whose files `save_eagle3_head` writes


def _head_state(head: Eagle3Head, embed_tokens: torch.Tensor | None, dtype: torch.dtype | None) -> dict:
    """The head's tensors as files hold them: `embed_tokens.weight` (the head's, else `embed_tokens`), and `t2d`
    (bool, the target ids in the draft vocabulary) beside `d2t` for a reduced vocabulary; cast to `dtype`."""
    state = {name: tensor.detach().cpu().contiguous() for name, tensor in head.state_dict().items()}
    if embed_tokens is not None and "embed_tokens.weight" not in state:
        state["embed_tokens.weight"] = embed_tokens.detach().cpu().contiguous()
    if dtype is not None:
        state = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor for name, tensor in state.items()}
    if head.d2t is not None:
        t2d = torch.zeros(head.vocab_size, dtype=torch.bool)
        t2d[torch.arange(len(head.d2t)) + state["d2t"]] = True
        state["t2d"] = t2d
    return state


def _dtype_name(state: dict) -> str:
    floating = next(tensor for tensor in state.values() if tensor.is_floating_point())
    return str(floating.dtype).removeprefix("torch.")


def save_eagle3_head(head: Eagle3Head, folder: str | Path, *, verifier_name_or_path: str,
                     verifier_architectures: list[str] | None = None, num_draft_tokens: int = 3,
                     dtype: torch.dtype | None = None, embed_tokens: torch.Tensor | None = None) -> Path:
    """Saves `head` in the speculators `eagle3` format as speculators 0.9's own `save_pretrained` writes it:
    `config.json` (with `speculators_version`, the four norm flags always written, `embed_requires_grad`) and
    `model.safetensors` (with `embed_tokens.weight`, and `d2t`/`t2d` for a reduced draft vocabulary), as vLLM
    (`vllm serve TARGET --speculative-config '{"model": FOLDER, ...}'`) and speculators'
    `Eagle3DraftModel.from_pretrained` load them.

    speculators 0.9 needs `embed_tokens.weight` in the file: without it, its loader leaves the embedding as
    uninitialised memory (it copies the verifier's only when that memory happens to hold NaN).

    Args:
        head (`Eagle3Head`): the head to save.
        folder (`str` or `Path`): created if needed; written all at once (`hf_speculators.folders.write_folder`).
        verifier_name_or_path (`str`): the target model (`speculators_config.verifier.name_or_path`); a Hub id keeps
            the files portable (speculators' loader reads the verifier's config from it).
        verifier_architectures (`list[str]`, *optional*): e.g. `["LlamaForCausalLM"]`.
        num_draft_tokens (`int`, defaults to 3): `speculative_tokens` of the greedy proposal method.
        dtype (`torch.dtype`, *optional*): cast floating-point tensors (e.g. `torch.float16`); default as they are.
        embed_tokens (`torch.Tensor` of shape `(vocab_size, hidden_size)`, *optional*): the target's input
            embeddings, written when the head has none of its own.

    Returns:
        `Path`: the folder.
    """
    state = _head_state(head, embed_tokens, dtype)
    config = {
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "architectures": ["Eagle3DraftModel"],
        "transformer_layer_config": _layer_dict(head.config),
        "draft_vocab_size": head.draft_vocab_size,
        **head.flags,
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": head.aux_layer_ids,
        "target_hidden_size": head.target_hidden_size if head.target_hidden_size != head.hidden_size else None,
        "tie_word_embeddings": False,
        "dtype": _dtype_name(state),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_draft_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(verifier_architectures or [])},
        },
    }
    return _write_head(folder, config, state)


def _write_head(folder: str | Path, config: dict, state: dict) -> Path:
    """Writes `config.json` and `model.safetensors` into `folder` all at once (an interrupted save leaves nothing
    half-written, `hf_speculators.folders.write_folder`); returns the folder."""

    def write(temporary: Path) -> None:
        (temporary / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        save_file(state, str(temporary / "model.safetensors"), metadata={"format": "pt"})

    return write_folder(folder, write)


def save_safeailab_eagle3(head: Eagle3Head, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Saves `head` in SafeAILab/EAGLE's EAGLE-3 layout, which SGLang (`--speculative-algorithm EAGLE3`), vLLM
    (`method: "eagle3"`) and SpecForge read: a Llama `config.json` with `architectures: ["LlamaForCausalLMEagle3"]`,
    `draft_vocab_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`; `model.safetensors` with `midlayer.*`
    (the head's one layer), `fc`, `norm`, `lm_head`, `d2t`/`t2d`, and no `embed_tokens` (the readers use the
    target's, as SafeAILab's training saves it). `load_eagle_head` reads it back.

    Raises:
        `ValueError`: a head this layout cannot hold: more than one layer, or one of the speculators flags
            (`norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output`) set.
    """
    if head.config.num_hidden_layers != 1 or any(head.flags.values()):
        raise ValueError("The SafeAILab EAGLE-3 layout holds one decoder layer (midlayer) without the speculators "
                         f"flags; this head has {head.config.num_hidden_layers} layers and flags {head.flags}. "
                         "Save it in the speculators format instead.")
    state = {("midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name): tensor
             for name, tensor in _head_state(head, None, dtype).items() if name != "embed_tokens.weight"}
    config = {**_layer_dict(head.config), "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "draft_vocab_size": head.draft_vocab_size, "norm_before_residual": False, "tie_word_embeddings": False,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": head.aux_layer_ids, "use_aux_hidden_state": True},
              "torch_dtype": _dtype_name(state)}
    if head.target_hidden_size != head.hidden_size:
        config["target_hidden_size"] = head.target_hidden_size
    return _write_head(folder, config, state)
