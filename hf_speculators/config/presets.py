"""Presets: Hub-style model cards whose YAML front matter holds a `speculative_decoding:` block.

This module finds the settings of a preset (a local card, a bundled card, a Hub repo, or a speculators-format
`config.json`), writes cards and pushes them to the Hub. `SpeculativeConfig` turns the settings into a config.
"""

import json
from dataclasses import fields
from pathlib import Path

import yaml
from huggingface_hub import HfApi, ModelCard, ModelCardData, hf_hub_download
from huggingface_hub.errors import HfHubHTTPError, RemoteEntryNotFoundError

from ..drafters import DRAFTERS
from ..loading import DEMO_IDS, looks_local
from .checkpoints import checkpoint_settings
from .vllm_export import llm_call, to_vllm_with_notes

CARD_KEY = "speculative_decoding"
# the front-matter block of what a preset was measured to give (not settings: SpeculativeConfig ignores it):
# speedup over `baseline` (default: plain greedy decoding), mean acceptance length, hardware and the command
RESULTS_KEY = "speculative_decoding_results"
CARD_TAGS = ["hf_speculators", "speculative-decoding"]
PACKAGE_DIR = Path(__file__).parent.parent  # the package folder: presets live in hf_speculators/config/


def bundled_presets_dir() -> Path:
    """The bundled cards: `hf_speculators/model_cards/` in an installed wheel (setup.py copies the repository's
    top-level `model_cards/` there), else that top-level folder itself (a checkout or an editable install)."""
    packaged = PACKAGE_DIR / "model_cards"
    return packaged if packaged.is_dir() else PACKAGE_DIR.parent / "model_cards"


def bundled_presets() -> dict[str, Path]:
    """Name -> folder of every bundled preset, in name order."""
    return {card.parent.name: card.parent for card in sorted(bundled_presets_dir().glob("*/README.md"))}


def _card_block(path: Path, key: str, contents: str) -> dict | None:
    """The `key:` block (a mapping of `contents`) of the model card at `path`, or `None` if it has none."""
    try:
        card = ModelCard.load(path)
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: malformed YAML front matter: {error}") from None
    block = card.data.to_dict().get(key)
    if block is not None and not isinstance(block, dict):
        raise ValueError(f"{path}: {key} must be a mapping of {contents}, got {block!r}.")
    return block


def _card_settings(path: Path) -> dict | None:
    """The `speculative_decoding:` block of the model card at `path`, or `None` if it has none."""
    return _card_block(path, CARD_KEY, "settings")


def card_results(path: Path) -> dict | None:
    """The `speculative_decoding_results:` block (`RESULTS_KEY`) of the model card at `path`, or `None`."""
    return _card_block(path, RESULTS_KEY, "figures")


def bundled_card(name: str) -> Path:
    """The model card (README.md) of the bundled preset `name`.

    Raises:
        `ValueError`: a name that is not a bundled preset, listing them.
    """
    bundled = bundled_presets()
    if name not in bundled:
        raise ValueError(f"No bundled preset {name!r}: choose one of {', '.join(bundled)}.")
    return bundled[name] / "README.md"


def _config_json_settings(path: Path, name_or_path: str) -> dict | None:
    """The settings of a draft checkpoint's `config.json` (see `checkpoint_settings`), or `None` for another config."""
    try:
        config_json = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: malformed JSON: {error}") from None
    return checkpoint_settings(config_json, name_or_path) if isinstance(config_json, dict) else None


def _read_local(path: Path) -> dict | None:
    """Settings from a card or `config.json` file, or from a folder holding them (the card first)."""
    folder = path if path.is_dir() else path.parent
    if path.is_dir():
        card, config_json = path / "README.md", path / "config.json"
    else:
        card, config_json = (None, path) if path.suffix == ".json" else (path, None)
    settings = _card_settings(card) if card is not None and card.is_file() else None
    if settings is None and config_json is not None and config_json.is_file():
        settings = _config_json_settings(config_json, str(folder))
    return settings


def _download(repo_id: str, filename: str, revision: str | None, token: str | None) -> Path | None:
    """A file of a Hub repo, or `None` when the repo has no such file.

    Raises:
        `ValueError`: the repo cannot be reached (offline, no such repo, no access, an invalid id); the message says
            that the name is no bundled preset either and lists those.
    """
    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision, token=token))
    except RemoteEntryNotFoundError:
        return None
    except (OSError, ValueError, HfHubHTTPError) as error:
        reason = " ".join(str(error).split())
        raise ValueError(
            f"No bundled preset {repo_id!r}; bundled are {', '.join(bundled_presets())}. As a Hub repo it cannot be "
            f"read ({type(error).__name__}: {reason}). Pass a bundled name, a local model card or folder, or a Hub "
            "repo id with a network."
        ) from error


def _read_hub(repo_id: str, revision: str | None, token: str | None) -> dict | None:
    """Settings from a Hub repo: its model card's block, else its draft checkpoint `config.json`."""
    card = _download(repo_id, "README.md", revision, token)
    settings = _card_settings(card) if card is not None else None
    if settings is None:
        config_json = _download(repo_id, "config.json", revision, token)
        settings = _config_json_settings(config_json, repo_id) if config_json is not None else None
    return settings


def read_settings(repo_id_or_path: str, revision: str | None = None, token: str | None = None) -> dict:
    """The raw settings of a preset: a local path first, then a bundled preset name, then a Hub repo id.

    Raises:
        `FileNotFoundError`: a local-looking path that does not exist.
        `ValueError`: malformed YAML or JSON, or neither a `speculative_decoding:` block nor a draft checkpoint's
            config (speculators, SafeAILab EAGLE-3, Medusa).
            A name that is neither local nor bundled and whose Hub repo cannot be read (offline, no such repo, an
            invalid id) is a `ValueError` that lists the bundled presets.
    """
    path = Path(repo_id_or_path).expanduser()
    bundled = bundled_presets()
    if not path.exists() and repo_id_or_path in bundled:
        path = bundled[repo_id_or_path]
    if path.exists():
        settings = _read_local(path)
    elif looks_local(repo_id_or_path):
        raise FileNotFoundError(
            f"{repo_id_or_path!r} does not exist. Pass a model card, a speculators config.json or a folder holding "
            f"one, a bundled preset ({', '.join(bundled)}) or a Hub repo id."
        )
    else:
        settings = _read_hub(repo_id_or_path, revision, token)
    if settings is None:
        raise ValueError(
            f"{repo_id_or_path}: found neither a model card with a `{CARD_KEY}:` block nor a draft checkpoint "
            "config.json (speculators format, SafeAILab EAGLE-3 or Medusa heads)."
        )
    return settings


def _settings_table(config) -> list[str]:
    """A markdown table of every set field and every drafter default the config falls back on."""
    rows = ["| setting | value |", "| --- | --- |"]
    for field in fields(config):
        value = getattr(config, field.name)
        shown = value if value is not None else config.resolved(field.name)
        if field.name in ("source", "notes") or shown is None:
            continue
        note = "" if value is not None else " (drafter default)"
        rows.append(f"| `{field.name}` | `{json.dumps(shown) if isinstance(shown, dict) else shown}`{note} |")
    return rows


def _vllm_section(config) -> list[str]:
    """vLLM code running the same method, or why there is none (demo ids kept: a card holds no local paths)."""
    try:
        exported, notes = to_vllm_with_notes(config, resolve_ids=False)
    except ValueError as error:
        return [f"Not exportable: {error}"]
    notes = [f"Note: {note}" for note in notes]
    demo_note = ["", "vLLM needs the folders of `hf_speculators/demo-*` ids: `config.to_vllm()` and "
                 "`hf_speculators.loading.resolve_model_id` give them."]
    uses_demo = {config.target_model, config.draft_model} & set(DEMO_IDS)
    return [
        "```python", "from vllm import LLM", "",
        llm_call(config.target_model, exported), "```",
        *(demo_note if uses_demo else []), *(["", *notes] if notes else []),
    ]


def _build_note(config) -> list[str]:
    if config.method in DRAFTERS:
        return []
    return [f"This version of hf_speculators loads this config but cannot build `{config.method}` yet (its drafters: "
            f"{', '.join(sorted(DRAFTERS))}); building raises a ValueError that says so.", ""]


def _results_section(results: dict | None) -> list[str]:
    if not results:
        return []
    figures = f"{results['speedup']}x the tokens/s of {results.get('baseline', 'plain greedy decoding')}"
    if results.get("mean_acceptance_length") is not None:
        figures += f", mean acceptance length {results['mean_acceptance_length']} tokens per draft"
    return ["## Measured speed", "", f"{figures}, on {results['hardware']}.", "",
            f"Measured with `{results['command']}`.", ""]


def card_text(config, name: str, results: dict | None = None) -> str:
    """A Hub-style model card: YAML front matter holding the config, and a body documenting it.

    Args:
        config (`SpeculativeConfig`): the settings.
        name (`str`): how users load the card: a bundled preset name, a folder or a Hub repo id.
        results (`dict`, *optional*): what the preset was measured to give, kept in its own front-matter block
            (`RESULTS_KEY`): `speedup`, `baseline` (default: plain greedy decoding), `mean_acceptance_length`,
            `hardware` and `command`.
    """
    blocks = {CARD_KEY: config.to_dict(), **({RESULTS_KEY: results} if results else {})}
    metadata = ModelCardData(tags=CARD_TAGS, **blocks)
    target = f" for `{config.target_model}`" if config.target_model else ""
    body = [
        f"# Speculative decoding preset: {name}", "",
        f"Settings for speculative decoding with `{config.method}`{target}, for the hf_speculators library "
        "(speculative decoding inside transformers' `model.generate()`).", "",
        *_settings_table(config), "",
        "## Source of the recommended settings", "", config.source or "Not stated.", "",
        *_results_section(results),
        *(["## Notes", "", config.notes, ""] if config.notes else []),
        "## Use", "", *_build_note(config), "```python", "import hf_speculators as hs", "",
        "hs.enable(model)  # generate() then takes speculative_config=, and tokenizer= as usual",
        f"config = hs.SpeculativeConfig.from_pretrained({name!r})",
        "out = model.generate(**inputs, speculative_config=config, tokenizer=tokenizer)", "```", "",
        f"Command line: `hf-speculators generate --preset {name} \"PROMPT\"`", "",
        "## vLLM", "", "The same method in vLLM (`config.to_vllm()`):", "", *_vllm_section(config),
    ]
    return f"---\n{metadata.to_yaml()}\n---\n\n" + "\n".join(body) + "\n"


def push_card(config, repo_id: str, token: str | None = None, private: bool | None = None,
              commit_message: str = "Upload speculative decoding preset"):
    """Creates the Hub model repo `repo_id` if needed and uploads the config's card as its README.md."""
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    return api.upload_file(
        path_or_fileobj=card_text(config, name=repo_id).encode("utf-8"), path_in_repo="README.md",
        repo_id=repo_id, commit_message=commit_message,
    )
