"""A DFlash drafter checkpoint (transformers' `MuseGlimmerAssistantModel`) in the form vLLM serves it."""

import json
import shutil
from pathlib import Path

from .files import read_json

# the keys of a DFlash drafter's config that vLLM's `qwen3_dflash` reads from its `dflash_config`
DFLASH_CONFIG_KEYS = ("target_layer_ids", "mask_token_id")


def save_vllm_dflash(checkpoint: str | Path, folder: str | Path, vocab_size: int) -> Path:
    """Writes the DFlash drafter in `checkpoint` (transformers' `MuseGlimmerAssistantModel` layout) as vLLM 0.32
    serves it with `speculative_config={"method": "dflash", "model": FOLDER}`: the same weights (vLLM renames
    `encoder.fc` / `encoder.output_norm_enc` itself) and a config with what vLLM reads elsewhere than transformers:

    - `dflash_config`: `target_layer_ids` and `mask_token_id` (vLLM's V1 model runner, the one its CPU build
      uses, reads the target layers only from there: `GPUModelRunner._get_eagle3_aux_layers_from_config`; without
      them it feeds the drafter the target's default EAGLE-3 layers), and `causal: false` (every DFlash layer
      attends both ways in transformers; vLLM runs a `sliding_attention` layer causally unless told so).
    - `vocab_size`, the target's: transformers' config has none, and vLLM's `MuseGlimmerAssistantConfig` then
      assumes Muse Glimmer's 202048 tokens (an embedding table that does not match the target's).

    Args:
        checkpoint (`str` or `Path`): the drafter's local folder (`config.json`, safetensors weights).
        folder (`str` or `Path`): created if missing.
        vocab_size (`int`): the target's vocabulary size (its embedding rows).

    Returns:
        `Path`: `folder`.

    Raises:
        `ValueError`: a config without `target_layer_ids` or `mask_token_id` (not a DFlash drafter).
    """
    checkpoint, folder = Path(checkpoint), Path(folder)
    config = read_json(checkpoint / "config.json")
    missing = [key for key in DFLASH_CONFIG_KEYS if key not in config]
    if missing:
        raise ValueError(f"{checkpoint} has no {missing} in its config.json: it is not a DFlash drafter "
                         "(transformers' MuseGlimmerAssistantModel).")
    folder.mkdir(parents=True, exist_ok=True)
    for path in checkpoint.glob("*.safetensors*"):
        shutil.copyfile(path, folder / path.name)
    dflash = {key: config[key] for key in DFLASH_CONFIG_KEYS}
    config.update(vocab_size=vocab_size, dflash_config={**config.get("dflash_config", {}), **dflash, "causal": False})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder
