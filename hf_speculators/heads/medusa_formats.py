"""Medusa checkpoint formats: detecting, reading and writing the heads-only checkpoints of FasterDecoding/Medusa.

- **Medusa v0.1** (e.g. `FasterDecoding/medusa-vicuna-7b-v1.3`): `config.json` of Medusa's `MedusaConfig`
  (`medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path`) and `medusa_lm_head.pt` (or
  `.safetensors`) holding the `medusa_head` module list: `{h}.{l}.linear.weight` `(hidden, hidden)`,
  `{h}.{l}.linear.bias` `(hidden,)` and each head's own LM head `{h}.{num_layers}.weight` `(vocab, hidden)`.
- **version 2** (Medusa commit 2b8020f, "Creating medusa2"; TGI's `MedusaHeadV2`): `config.json` with
  `"version": "2"` and `medusa_lm_head.safetensors` holding the residual blocks only; logits come from the
  target's LM head.

Heads and layers are counted from the weights, never taken from `config.json`: published configs can be wrong
(medusa-vicuna-7b-v1.3's says 2 heads, its weights hold 5; Medusa's own loader forces 5).
"""

import json
import re
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..folders import write_folder
from .files import read_json, read_weights
from .medusa import MedusaHeads

MEDUSA_V1, MEDUSA_V2 = "medusa-v0.1", "medusa-v2"
WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")  # safetensors first
CONFIG_KEYS = ("medusa_num_heads", "medusa_num_layers")
_KEY = re.compile(r"(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)")


def detect_medusa_format(folder: str | Path) -> str | None:
    """The Medusa format of the checkpoint in `folder` from its files: `MEDUSA_V2` (`"medusa-v2"`) when its
    `config.json` says `"version": "2"`, `MEDUSA_V1` (`"medusa-v0.1"`) for another Medusa config, `None` when
    `folder` holds no `config.json` with `medusa_num_heads` or `medusa_num_layers` or no `medusa_lm_head` weights.

    Raises:
        `ValueError`: a malformed `config.json`.
    """
    folder = Path(folder)
    if not (folder / "config.json").is_file() or not any((folder / name).is_file() for name in WEIGHT_FILES):
        return None
    config = read_json(folder / "config.json")
    if not any(key in config for key in CONFIG_KEYS):
        return None
    return MEDUSA_V2 if str(config.get("version")) == "2" else MEDUSA_V1


def _layout(state: dict[str, torch.Tensor], source: Path) -> tuple[int, int, int, int | None]:
    """`(num_heads, num_layers, hidden_size, vocab_size)` of the weights of a Medusa head module list, from their
    names and shapes; `vocab_size` is `None` without per-head LM heads."""
    matches = [(_KEY.fullmatch(name), tensor) for name, tensor in state.items()]
    unknown = sorted(name for name, (match, _) in zip(state, matches) if match is None)
    blocks = [(int(m[2]), tensor) for m, tensor in matches if m is not None and m[3] == "linear.weight"]
    if unknown or not blocks:
        raise ValueError(
            f"{source}: not Medusa head weights: expected names '{{head}}.{{layer}}.linear.weight', "
            f"'{{head}}.{{layer}}.linear.bias' and '{{head}}.{{num_layers}}.weight', got {unknown[:5] or 'none'}."
        )
    lm_heads = [tensor for m, tensor in matches if m[3] == "weight"]
    return (1 + max(int(m[1]) for m, _ in matches), 1 + max(layer for layer, _ in blocks), blocks[0][1].shape[1],
            lm_heads[0].shape[0] if lm_heads else None)


def read_medusa_heads(folder: str | Path) -> MedusaHeads:
    """The `MedusaHeads` of a Medusa v0.1 or version 2 checkpoint folder (see the module docstring), in float32.

    Args:
        folder (`str` or `Path`): the local checkpoint folder (`hf_speculators.heads.files.head_folder` fetches a
            Hub repo).

    Raises:
        `ValueError`: not a Medusa checkpoint (see `detect_medusa_format`); weight names or shapes that are not a
            Medusa head list; weights whose LM heads contradict the config's `version`; a pickle holding more than
            tensors.
    """
    folder = Path(folder)
    kind = detect_medusa_format(folder)
    if kind is None:
        raise ValueError(
            f"{folder} is not a Medusa heads checkpoint: it needs a config.json with medusa_num_heads and "
            f"{' or '.join(WEIGHT_FILES)}."
        )
    state = read_weights(folder, WEIGHT_FILES)
    num_heads, num_layers, hidden_size, vocab_size = _layout(state, folder)
    config = read_json(folder / "config.json")
    if (vocab_size is not None) != (kind == MEDUSA_V1):
        raise ValueError(
            f"{folder}: config.json's version is {config.get('version')!r} but the weights "
            f"{'hold' if vocab_size else 'lack'} per-head LM heads: version 2 heads have none (they use the target's "
            "LM head), Medusa v0.1 heads have one each. Fix the config's version."
        )
    for key, counted in zip(CONFIG_KEYS, (num_heads, num_layers)):
        if key in config and config[key] != counted:
            warnings.warn(f"{folder}: config.json says {key}={config[key]!r}, the weights hold {counted}; "
                          f"using {counted}.", stacklevel=2)
    heads = MedusaHeads(hidden_size, num_heads, num_layers, vocab_size)
    try:
        heads.load_state_dict({f"heads.{name}": tensor.float() for name, tensor in state.items()})
    except RuntimeError as error:  # missing, unexpected or misshapen weights
        raise ValueError(f"{folder}: the weights are not a complete Medusa head list: {error}") from None
    return heads


def save_medusa_heads(heads: MedusaHeads, folder: str | Path, *, weights: str = "safetensors",
                      base_model_name_or_path: str | None = None, dtype: torch.dtype | None = None) -> Path:
    """Saves `heads` as a Medusa checkpoint that `read_medusa_heads` and Medusa's own loaders read: Medusa v0.1 when
    the heads have their own LM heads, else version 2 (`"version": "2"`, safetensors only).

    Args:
        heads (`MedusaHeads`): the heads.
        folder (`str` or `Path`): created if missing; `config.json` and the weight file are overwritten, all at once
            (`hf_speculators.folders.write_folder`).
        weights (`str`, defaults to `"safetensors"`): `"safetensors"` (`medusa_lm_head.safetensors`) or `"pt"`
            (`medusa_lm_head.pt`, a `torch.save` state dict as Medusa v0.1 shipped; v0.1 only).
        base_model_name_or_path (`str`, *optional*): the target the heads were trained for, recorded in the config.
        dtype (`torch.dtype`, *optional*): the stored dtype (e.g. `torch.float16`); the heads' own by default.

    Returns:
        `Path`: the folder.

    Raises:
        `ValueError`: an unknown `weights`, or `"pt"` for version 2 heads.
    """
    if weights not in ("safetensors", "pt") or (weights == "pt" and not heads.has_lm_heads):
        raise ValueError(f"weights must be 'safetensors', or 'pt' for heads with their own LM heads (Medusa v0.1), "
                         f"got {weights!r}.")
    config = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
              "base_model_name_or_path": base_model_name_or_path}
    if not heads.has_lm_heads:
        config["version"] = "2"
    state = {name.removeprefix("heads."): tensor.detach().to(dtype or tensor.dtype).cpu().contiguous()
             for name, tensor in heads.state_dict().items()}

    def write(temporary: Path) -> None:
        (temporary / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if weights == "safetensors":
            save_file(state, str(temporary / WEIGHT_FILES[0]))
        else:
            torch.save(state, temporary / WEIGHT_FILES[1])

    return write_folder(folder, write)  # all at once: an interrupted save leaves nothing half-written


VLLM_WEIGHTS = "model.safetensors"


def save_vllm_medusa(heads: MedusaHeads, folder: str | Path, lm_head_weight: torch.Tensor | None = None,
                     dtype: torch.dtype | None = None) -> Path:
    """Saves `heads` in vLLM's own Medusa layout (`vllm/model_executor/models/medusa.py`, config
    `vllm/transformers_utils/configs/medusa.py`), which vLLM serves with `speculative_config={"method": "medusa",
    "model": FOLDER, "num_speculative_tokens": num_heads}`: `config.json` (`model_type: "medusa"`, `hidden_size`,
    `vocab_size`, `num_heads`, `num_hidden_layers`, `truncated_vocab_size`, `medusa_fc_bias: true`) and
    `model.safetensors` with `blocks.{h}.layers.{l}.{weight,bias}` and `lm_heads.{h}.weight`. Heads without LM
    heads of their own (version 2) are written with `original_lm_head: true` and the target's LM head as
    `lm_heads.0.weight`, which vLLM then shares between the heads. `read_vllm_medusa` reads it back.

    Args:
        heads (`MedusaHeads`): the heads.
        folder (`str` or `Path`): created if missing, written all at once.
        lm_head_weight (`torch.Tensor` of shape `(vocab_size, hidden_size)`, *optional*): the target's LM head;
            required for heads without their own.
        dtype (`torch.dtype`, *optional*): the stored dtype; the heads' own by default.

    Raises:
        `ValueError`: version 2 heads without `lm_head_weight`, or an LM head of the wrong width.
    """
    if not heads.has_lm_heads and (lm_head_weight is None or lm_head_weight.shape[1] != heads.hidden_size):
        raise ValueError("These Medusa heads use the target's LM head: pass lm_head_weight, the target's "
                         f"get_output_embeddings().weight of width {heads.hidden_size}.")
    state = {}
    for h, head in enumerate(heads.heads):
        for layer in range(heads.num_layers):
            state[f"blocks.{h}.layers.{layer}.weight"] = head[layer].linear.weight
            state[f"blocks.{h}.layers.{layer}.bias"] = head[layer].linear.bias
        if heads.has_lm_heads:
            state[f"lm_heads.{h}.weight"] = head[heads.num_layers].weight
    if not heads.has_lm_heads:
        state["lm_heads.0.weight"] = lm_head_weight
    state = {name: tensor.detach().to(dtype or tensor.dtype).cpu().contiguous() for name, tensor in state.items()}
    vocab_size = next(tensor for name, tensor in state.items() if name.startswith("lm_heads.")).shape[0]
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": heads.hidden_size,
              "vocab_size": vocab_size, "num_heads": heads.num_heads, "num_hidden_layers": heads.num_layers,
              "truncated_vocab_size": vocab_size, "medusa_fc_bias": True,
              "original_lm_head": not heads.has_lm_heads}

    def write(temporary: Path) -> None:
        (temporary / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(state, str(temporary / VLLM_WEIGHTS))

    return write_folder(folder, write)  # all at once: an interrupted save leaves nothing half-written


def read_vllm_medusa(folder: str | Path) -> MedusaHeads:
    """The `MedusaHeads` of a folder in vLLM's Medusa layout (`save_vllm_medusa`): with `original_lm_head`, heads
    without LM heads of their own (the shared `lm_heads.0.weight` is the target's); otherwise one LM head each.

    Raises:
        `ValueError`: a config that is not vLLM's Medusa config, or weights that do not fit it.
    """
    folder = Path(folder)
    config = read_json(folder / "config.json")
    if config.get("model_type") != "medusa" or "num_heads" not in config:
        raise ValueError(f"{folder}: not vLLM's Medusa layout (config.json needs model_type 'medusa' and num_heads).")
    state = read_weights(folder, (VLLM_WEIGHTS,))
    shared = bool(config.get("original_lm_head", False))
    heads = MedusaHeads(config["hidden_size"], config["num_heads"], config["num_hidden_layers"],
                        None if shared else config["vocab_size"])
    renamed = {}
    for name, tensor in state.items():
        match = re.fullmatch(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)", name)
        if match:
            renamed[f"heads.{match[1]}.{match[2]}.linear.{match[3]}"] = tensor.float()
        elif not shared and re.fullmatch(r"lm_heads\.\d+\.weight", name):
            renamed[f"heads.{name.split('.')[1]}.{heads.num_layers}.weight"] = tensor.float()
    try:
        heads.load_state_dict(renamed)
    except RuntimeError as error:
        raise ValueError(f"{folder}: the weights do not fit the vLLM Medusa config: {error}") from None
    return heads
