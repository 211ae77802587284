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
