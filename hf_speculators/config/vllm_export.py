"""Exporting a `SpeculativeConfig` as the `speculative_config` dict that vLLM's `LLM(...)` and `vllm serve` take."""

import json
import shlex
import tempfile
import warnings
from pathlib import Path

from ..heads.dflash_formats import save_vllm_dflash
from ..heads.files import head_folder
from ..heads.medusa_formats import read_medusa_heads, save_vllm_medusa
from ..loading import load_model, load_tokenizer, resolve_model_id
from ..translation import same_vocabulary
from ..verifiers import VERIFIERS
from .registry import METHOD_SPECS

# our draft_quantization -> vLLM's `quantization` (FP8 weights quantized on load); int8/nf4/int4 have no in-flight
# equivalent for a vLLM draft
VLLM_QUANTIZATIONS = {"fp8": "fp8"}


def _check_verification(config) -> None:
    name = config.verification
    if name is not None and not (name in VERIFIERS and VERIFIERS[name].lossless):
        raise ValueError(
            f"verification={name!r} is relaxed (not lossless) and vLLM has no equivalent: vLLM verifies drafts "
            "losslessly. Remove verification and its parameters to export this config."
        )


def _check_head(config) -> None:
    """Refuses what vLLM cannot take: a method whose spec explains why (Medusa heads in FasterDecoding's layout, a
    DFlash drafter's config without vLLM's keys), or a token tree."""
    spec = METHOD_SPECS[config.method]
    if spec.vllm_refusal is not None:
        raise ValueError(spec.vllm_refusal)
    if spec.vllm is not None and config.tree is not None:
        raise ValueError(
            f"tree={config.tree!r} has no vLLM equivalent in this export: vLLM drafts a chain of "
            "num_speculative_tokens. Remove tree (and set num_draft_tokens) to export."
        )


def _check_trees(config) -> None:
    """Refuses the settings of a drafter's own token trees and suffix decoding's offset (vLLM drafts one path)."""
    if (config.num_candidates or 1) > 1:
        raise ValueError(
            f"num_candidates={config.num_candidates} (a token tree of prompt-lookup continuations) has no vLLM "
            "equivalent: vLLM's ngram method drafts one continuation. Remove num_candidates to export."
        )
    if config.use_tree_spec:
        raise ValueError("use_tree_spec=True (a token tree of suffix continuations) has no vLLM equivalent: vLLM's "
                         "suffix method drafts one path. Remove use_tree_spec to export.")
    if config.max_spec_offset:
        raise ValueError(f"max_spec_offset={config.max_spec_offset} has no vLLM equivalent: vLLM's suffix method "
                         "drafts max_spec_factor tokens per matched token. Remove max_spec_offset to export.")


def _other_vocabulary(config) -> bool:
    """Whether a draft model (method draft-model) has another tokenizer than the target's, judged where both are
    local folders (demo ids included): a pair of Hub ids is not downloaded for this and counts as one vocabulary."""
    if config.target_model is None or METHOD_SPECS[config.method].loads != "draft-model":
        return False
    target, draft = resolve_model_id(config.target_model), resolve_model_id(config.draft_model)
    if not (Path(target).is_dir() and Path(draft).is_dir()):
        return False
    return not same_vocabulary(load_tokenizer(target), load_tokenizer(draft))


def _draft_settings(config, resolve_ids: bool) -> dict:
    if config.draft_model is None and METHOD_SPECS[config.method].loads == "target":
        return {}  # MTP: vLLM reads the MTP layers from the target's own checkpoint, as we do
    if config.is_self_draft:
        raise ValueError(
            "A quantized copy of the target as its draft (draft_quantization without draft_model) has no vLLM "
            "equivalent: point draft_model at a pre-quantized draft checkpoint to export."
        )
    settings = {"model": resolve_model_id(config.draft_model) if resolve_ids else config.draft_model}
    if config.draft_revision is not None:
        settings["revision"] = config.draft_revision
    if _other_vocabulary(config):  # vLLM's token-level intersection of the two vocabularies (greedy drafts only)
        settings["use_heterogeneous_vocab"] = True
    quantization = config.draft_quantization
    if quantization is not None:
        if quantization not in VLLM_QUANTIZATIONS:
            raise ValueError(
                f"draft_quantization={quantization!r} has no vLLM equivalent for a draft model: quantize the draft "
                "checkpoint (vLLM loads pre-quantized weights), point draft_model at it and remove draft_quantization."
            )
        settings["quantization"] = VLLM_QUANTIZATIONS[quantization]
    return settings


def to_vllm(config, resolve_ids: bool = True) -> dict:
    """Returns vLLM's `speculative_config` for the same method and settings as `config`.

    Mapping: method -> `method` (its `MethodSpec.vllm`), `num_draft_tokens` -> `num_speculative_tokens`,
    `max_ngram_size` / `min_ngram_size` -> `prompt_lookup_max` / `prompt_lookup_min`, suffix decoding's settings ->
    `suffix_decoding_*` (vLLM's cross-request cache is per server, ours per drafter), `draft_model` -> `model`
    (demo ids resolved to their folder), `draft_revision` -> `revision`, `draft_quantization="fp8"` ->
    `quantization="fp8"`; a draft model of another tokenizer (both local folders) -> `use_heterogeneous_vocab=True`
    (vLLM drafts from the tokens the two vocabularies share; we translate text between them); MTP layers read from
    the target (no `draft_model`) -> no `model` (vLLM's `mtp` reads the target's checkpoint) and, unless
    `num_draft_tokens` is set, `num_speculative_tokens` = the target's `num_mtp_layers`. Unset fields are
    filled with this library's drafter defaults, so vLLM runs what `build` would. `target_model` is not part of it: pass it as `LLM(model=...)`. vLLM has no per-step draft-length
    schedule: a `"heuristic"` or `"goodput"` `num_draft_tokens_schedule` is left out with a `UserWarning`, and vLLM
    drafts `num_draft_tokens` (the schedule's starting length or bound) every step.

    Raises:
        `ValueError`: naming the field that vLLM has no equivalent for: a method without one (layer-skip, tree),
            relaxed verification (typical, top_k), prompt lookup with `num_candidates > 1`, suffix decoding with
            `use_tree_spec`, an int8/nf4/int4
            draft quantization, a learned head's `tree`, Medusa heads or a DFlash drafter (vLLM reads a converted
            copy: `export`), or MTP layers read from the target with neither `num_draft_tokens` nor `target_model`.
    """
    _check_head(config)
    mapping = METHOD_SPECS[config.method].vllm
    if mapping is None:
        exportable = sorted(name for name, spec in METHOD_SPECS.items() if spec.vllm is not None)
        raise ValueError(
            f"method={config.method!r} has no vLLM equivalent; the methods that export are {exportable}. "
            "Keep this one in transformers with hf_speculators."
        )
    _check_verification(config)
    _check_trees(config)
    settings = {"method": mapping.method, **mapping.fixed}
    settings.update({key: config.resolved(name) for name, key in mapping.fields.items()})
    if mapping.draft:
        settings.update(_draft_settings(config, resolve_ids))
    num_draft_tokens = config.resolved("num_draft_tokens")
    if num_draft_tokens is None and mapping.draft and "model" not in settings:
        num_draft_tokens = _target_mtp_layers(config)
    if num_draft_tokens is not None:  # unset for a speculators type: vLLM reads it from the checkpoint
        settings["num_speculative_tokens"] = num_draft_tokens
    _warn_schedule(config.num_draft_tokens_schedule, num_draft_tokens)
    return settings


def _target_mtp_layers(config) -> int:
    """The MTP layers the target's config declares: our MTP drafter's default draft length, which vLLM needs as
    `num_speculative_tokens` when it reads the layers from the target (it refuses a `model`-less config without
    one)."""
    if config.target_model is None:
        raise ValueError("method='mtp' without num_draft_tokens or target_model: vLLM needs num_speculative_tokens. "
                         "Set num_draft_tokens (at most the target's MTP layers) or target_model.")
    from transformers import AutoConfig

    text_config = AutoConfig.from_pretrained(resolve_model_id(config.target_model)).get_text_config()
    return text_config.num_mtp_layers


def _warn_schedule(schedule: str | None, num_draft_tokens: int | None) -> None:
    if schedule not in (None, "constant"):
        warnings.warn(
            f"num_draft_tokens_schedule={schedule!r} has no vLLM equivalent and is left out: vLLM drafts "
            f"num_speculative_tokens={num_draft_tokens} tokens every step (a fixed length). Lower num_draft_tokens "
            "for vLLM if that length is too long for a fixed schedule.", UserWarning, stacklevel=3,
        )


def to_vllm_with_notes(config, resolve_ids: bool = True) -> tuple[dict, list[str]]:
    """`to_vllm(config, resolve_ids)` and notes for printing: what vLLM needs to run the method (`VllmMapping.needs`)
    and the messages of the warnings it gave (what was left out)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported = to_vllm(config, resolve_ids)
    needs = METHOD_SPECS[config.method].vllm.needs
    return exported, [*([needs] if needs else []), *(str(warning.message) for warning in caught)]


def llm_call(target: str | None, speculative_config: dict) -> str:
    """The Python line that builds vLLM's engine for `target` with `speculative_config` (`TARGET_MODEL` if unset)."""
    return f"llm = LLM(model={target or 'TARGET_MODEL'!r}, speculative_config={speculative_config!r})"


def convert_medusa_heads(config, out: str | Path) -> tuple[dict, list[str]]:
    """Writes the Medusa heads of `config` (method `"medusa"`) in vLLM's layout under `out` (see
    `hf_speculators.heads.medusa_formats.save_vllm_medusa`; heads that use the target's LM head get a copy of it,
    read from `config.target_model`) and returns vLLM's `speculative_config` for them (a chain of
    `num_draft_tokens`, by default one token per head) and notes on what was left out: a relaxed verification
    (Medusa's typical acceptance), since vLLM verifies losslessly.

    Raises:
        `ValueError`: a config of another method, a token tree (vLLM drafts Medusa chains), or heads that need the
            target's LM head without `target_model`.
    """
    if config.method != "medusa" or config.tree is not None:
        raise ValueError(f"convert_medusa_heads takes a Medusa chain config, got method={config.method!r}, "
                         f"tree={config.tree!r}.")
    notes = []
    if config.verification is not None and not (config.verification in VERIFIERS and VERIFIERS[config.verification].lossless):
        notes.append(f"verification={config.verification!r} is left out: vLLM verifies Medusa drafts losslessly, so "
                     "it generates the target's own output at a lower acceptance.")
    heads = read_medusa_heads(head_folder(config.draft_model, config.draft_revision))
    lm_head = None
    if not heads.has_lm_heads:
        if config.target_model is None:
            raise ValueError("These Medusa heads use the target's LM head: set target_model so that its LM head can "
                             "be written beside them.")
        lm_head = load_model(config.target_model).get_output_embeddings().weight
    folder = save_vllm_medusa(heads, out, lm_head)
    return {"method": "medusa", "model": str(folder),
            "num_speculative_tokens": config.num_draft_tokens or heads.num_heads}, notes


def convert_dflash_drafter(config, out: str | Path) -> tuple[dict, list[str]]:
    """Writes the DFlash drafter of `config` (method `"dflash"`, transformers' `MuseGlimmerAssistantModel`) as vLLM
    serves it under `out` (see `hf_speculators.heads.dflash_formats.save_vllm_dflash`: its weights, and its config
    with `dflash_config` and the target's `vocab_size`, read from `config.target_model`) and returns vLLM's
    `speculative_config` for it (a chain of `num_draft_tokens`, by default `block_size - 1`) and notes: a drafter
    that reads the target's last layer (`GPUModelRunner` collects it before the final norm; transformers' DFlash
    after it).

    Raises:
        `ValueError`: a config of another method, a token tree (vLLM drafts DFlash chains), or no `target_model`.
    """
    if config.method != "dflash" or config.tree is not None:
        raise ValueError(f"convert_dflash_drafter takes a DFlash chain config, got method={config.method!r}, "
                         f"tree={config.tree!r}.")
    if config.target_model is None:
        raise ValueError("vLLM needs the DFlash drafter's vocabulary size, the target's: set target_model.")
    from transformers import AutoConfig

    checkpoint = head_folder(config.draft_model, config.draft_revision)
    target = AutoConfig.from_pretrained(resolve_model_id(config.target_model)).get_text_config()
    folder = save_vllm_dflash(checkpoint, out, target.vocab_size)
    drafter = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    notes = []
    if target.num_hidden_layers - 1 in drafter["target_layer_ids"]:
        notes.append(f"target_layer_ids reads the target's last layer ({target.num_hidden_layers - 1}): vLLM feeds "
                     "the drafter its output before the final norm, transformers and hf_speculators after it, so "
                     "vLLM's acceptance can be lower (its greedy output is still the target's)")
    return {"method": "dflash", "model": str(folder),
            "num_speculative_tokens": config.num_draft_tokens or drafter["block_size"] - 1}, notes


# methods whose checkpoint vLLM reads in another form: the converter and what the written folder holds
CONVERTERS = {"medusa": (convert_medusa_heads, "the Medusa heads in vLLM's layout are"),
              "dflash": (convert_dflash_drafter, "the DFlash drafter with the config vLLM reads is")}


def export(config, out: str | Path | None = None) -> tuple[dict, list[str]]:
    """vLLM's `speculative_config` for `config` and notes on what was left out: `to_vllm_with_notes`, or for Medusa
    heads and DFlash drafters (`CONVERTERS`) a copy in the form vLLM reads, written into `out` (default: a new
    temporary folder, named in a note, that stays after the call: the exported config points at it).

    Raises:
        `ValueError`: what `to_vllm` raises for a config vLLM has no equivalent for.
    """
    if config.method not in CONVERTERS:
        return to_vllm_with_notes(config)
    convert, what = CONVERTERS[config.method]
    folder = out or tempfile.mkdtemp(prefix=f"hf-speculators-{config.method}-vllm-")
    exported, notes = convert(config, folder)
    if out is None:
        notes.append(f"{what} in the temporary folder {folder}; --out DIR writes them where you want to keep them")
    return exported, notes


def vllm_commands(config, out: str | Path | None = None) -> str:
    """The `vllm serve TARGET --speculative-config '<json>'` command line and the Python `LLM(...)` call that run the
    same method as `config` in vLLM (demo ids resolved to their folders; `TARGET_MODEL` where `target_model` is
    unset), after notes on what was left out. Medusa heads are first converted to vLLM's layout in `out` (default:
    a temporary folder; see `export`).

    Raises:
        `ValueError`: what `to_vllm` raises for a config vLLM has no equivalent for.
    """
    return commands_text(config, *export(config, out))


def commands_text(config, exported: dict, notes: list[str]) -> str:
    """`vllm_commands`' text for an export already made (`export(config, out)` gives `exported` and `notes`)."""
    target = resolve_model_id(config.target_model) if config.target_model else None
    serve = f"vllm serve {shlex.quote(target or 'TARGET_MODEL')} --speculative-config {shlex.quote(json.dumps(exported))}"
    return "\n".join([*(f"# note: {note}" for note in notes), "# command line (an OpenAI-compatible server)", serve,
                      "", "# Python", "from vllm import LLM", "", llm_call(target, exported)])
