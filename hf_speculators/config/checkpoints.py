"""Speculative settings read from a draft checkpoint's `config.json`: the speculators format, SafeAILab EAGLE-3 and
Medusa heads (so that `SpeculativeConfig.from_pretrained` takes the checkpoints users hold on the Hub)."""

from .speculators_format import is_speculators_config, speculators_settings


def _is_safeailab_eagle3(config_json: dict) -> bool:
    """SafeAILab EAGLE-3 heads are saved with a transformers decoder config plus `draft_vocab_size`."""
    architectures = config_json.get("architectures") or []
    return "draft_vocab_size" in config_json or any("Eagle3" in str(name) for name in architectures)


def _is_medusa(config_json: dict) -> bool:
    """Medusa heads (v0.1 and "version 2") are saved with `medusa_num_heads` in their config."""
    return "medusa_num_heads" in config_json


def checkpoint_settings(config_json: dict, name_or_path: str) -> dict | None:
    """The `SpeculativeConfig` fields a draft checkpoint's parsed `config.json` implies, or `None` for another config.

    - speculators format (`speculators_model_type`): see `speculators_settings`.
    - SafeAILab EAGLE-3 (`draft_vocab_size`, or an `Eagle3` architecture): method `"eagle3"`.
    - Medusa (`medusa_num_heads`): method `"medusa"`, the target from `base_model_name_or_path`.
    The checkpoint itself becomes the draft model. EAGLE-1/2 heads of SafeAILab carry a plain decoder config that
    does not tell them apart from a model: give them as `SpeculativeConfig(method="eagle", draft_model=...)`.

    Raises:
        `ValueError`: a malformed speculators config (see `speculators_settings`).
    """
    if is_speculators_config(config_json):
        return speculators_settings(config_json, name_or_path)
    if _is_medusa(config_json):
        target = config_json.get("base_model_name_or_path")
        settings = {"method": "medusa", "draft_model": name_or_path, "target_model": target or None,
                    "source": f"Medusa heads config.json of {name_or_path}"}
    elif _is_safeailab_eagle3(config_json):
        settings = {"method": "eagle3", "draft_model": name_or_path,
                    "source": f"SafeAILab EAGLE-3 config.json of {name_or_path}"}
    else:
        return None
    return {key: value for key, value in settings.items() if value is not None}
