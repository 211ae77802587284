"""End-to-end trainers: data, training with checkpoint choice by measured acceptance, and the saved folder.

Each trainer takes a loaded frozen target, its tokenizer and training examples (`hf_speculators.training.data`),
trains on the fly (`hf_speculators.training.loop.fit`), and writes a folder that `SpeculativeConfig.from_pretrained`
loads and `generate()` runs: the head's own files (speculators `eagle3`, Medusa) or a transformers model with a
model card, plus `training.json` (settings, acceptance history, tokens per second, peak memory).
"""

import json
import resource
from dataclasses import asdict
from pathlib import Path

import torch

from ..config import SpeculativeConfig
from ..drafters import DraftModelDrafter, EagleDrafter, MedusaDrafter
from ..heads.eagle_formats import save_eagle3_head, save_safeailab_eagle3
from ..heads.medusa_formats import save_medusa_heads
from .data import token_counts
from .distill import DistillLoss
from .eagle3 import Eagle3Loss, build_eagle3_head, draft_vocabulary
from .evaluate import acceptance_evaluator, pad_id
from .loop import TrainingSettings, fit
from .medusa import MedusaLoss, build_medusa_heads
from .target_features import TargetFeatures


def check_output_folder(out: str | Path, overwrite: bool = False, resume: str | Path | None = None) -> Path:
    """The output folder, after refusing to write over an existing one.

    Raises:
        `FileExistsError`: `out` exists and is not empty, without `overwrite` and not resuming from a checkpoint
            inside it.
    """
    out = Path(out)
    resuming_here = resume is not None and Path(resume).resolve().parent == out.resolve()
    if out.exists() and any(out.iterdir()) and not (overwrite or resuming_here):
        raise FileExistsError(f"The output folder {out} exists: pass --overwrite (overwrite=True) to replace it, or "
                              "another --out.")
    return out


def held_out_prompts(examples) -> list[list[int]]:
    """The prompt part (the tokens before the first trained one) of each example."""
    prompts = []
    for row in examples:
        mask = row["loss_mask"]
        prompts.append(row["input_ids"][: mask.index(1) if 1 in mask else len(mask)])
    return prompts


def fingerprint(target, target_name: str, kind: str, **settings) -> dict:
    """What a resumed checkpoint must match: the target's name, vocabulary, width and depth, the drafter kind and
    its shape settings."""
    c = target.config.get_text_config()
    return {"target": target_name, "vocab_size": target.get_output_embeddings().weight.shape[0],
            "hidden_size": c.hidden_size, "num_layers": c.num_hidden_layers, "kind": kind, **settings}


def _indexed(examples):
    return examples.add_column("index", list(range(len(examples)))) if "index" not in examples.column_names else examples


CARD_TITLES = {"eagle3": "EAGLE-3 head", "medusa": "Medusa heads", "draft": "distilled draft model"}


def _report(out: Path, result: dict, settings: TrainingSettings, extra: dict, card: bool = True) -> dict:
    """Writes `training.json` (and, with `card`, a short model card `README.md` without settings, so that the
    head's own `config.json` is what `SpeculativeConfig.from_pretrained` reads); returns the report."""
    report = {**extra, "settings": asdict(settings), **result,
              "peak_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "threads": torch.get_num_threads()}
    (out / "training.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    if card:
        best = report["best"]
        positions = " ".join(f"{rate:.2f}" for rate in best["per_position"])
        (out / "README.md").write_text(
            f"---\nlibrary_name: hf_speculators\ntags: [hf_speculators, speculative-decoding, {extra['kind']}]\n"
            f"base_model: {extra['target']}\n---\n# {CARD_TITLES[extra['kind']]} for {extra['target']}\n\n"
            f"Trained by `hf-speculators train {extra['kind']}` on {extra['num_examples']} examples (the target's own "
            f"responses), {report['steps']} optimizer steps, {report['tokens']} tokens, "
            f"{report['seconds'] / 60:.1f} minutes ({report['tokens_per_second']:.0f} tokens/s, "
            f"{report['threads']} threads). Kept: step {report['best_step']}, held-out mean acceptance length "
            f"{best['mean_acceptance_length']:.2f} (acceptance per position {positions}; greedy, "
            f"{best['num_prompts']} prompts). Settings and history: `training.json`.\n", encoding="utf-8")
    return report


def train_eagle3(target, tokenizer, examples, held_out, out: str | Path, *, target_name: str,
                 settings: TrainingSettings | None = None, draft_vocab_size: int | None = None,
                 aux_layer_ids: list[int] | None = None, ttt_steps: int = 3, step_decay: float = 0.8,
                 num_layers: int = 1, eval_tokens: int = 64, feature_cache: str | Path | None = None,
                 resume: str | Path | None = None, safeailab: bool = False, dtype: torch.dtype | None = None,
                 init: str | Path | None = None) -> dict:
    """Trains an EAGLE-3 head for `target` (`hf_speculators.training.eagle3`) and saves it in the speculators
    `eagle3` format under `out` (and SafeAILab's layout under `out/safeailab` with `safeailab`).

    Args:
        target (`PreTrainedModel`): the frozen target (float32 on a CPU).
        tokenizer: its tokenizer (the padding id).
        examples (`datasets.Dataset`): training rows of `input_ids` and `loss_mask`.
        held_out (`datasets.Dataset`): rows whose prompts measure acceptance (chain of `ttt_steps`, greedy,
            `eval_tokens` new tokens each) to choose the checkpoint.
        out (`str` or `Path`): the output folder (see `check_output_folder`).
        target_name (`str`): the target's id written into the files (`verifier.name_or_path`): prefer a Hub id.
        settings (`TrainingSettings`, *optional*): optimisation settings.
        draft_vocab_size (`int`, *optional*): K most frequent generated tokens (default: the full vocabulary).
        aux_layer_ids (`list[int]`, *optional*): default `[2, L // 2, L - 3]`.
        ttt_steps (`int`, defaults to 3), step_decay (`float`, defaults to 0.8): see `Eagle3Loss`.
        num_layers (`int`, defaults to 1): decoder layers of the head.
        eval_tokens (`int`, defaults to 64): new tokens per held-out prompt when measuring acceptance.
        feature_cache (`str` or `Path`, *optional*): on-disk cache of the target's features (`TargetFeatures`).
        resume (`str` or `Path`, *optional*): a checkpoint folder (`out/checkpoint` of an earlier run).
        safeailab (`bool`): also write SafeAILab's EAGLE-3 layout.
        dtype (`torch.dtype`, *optional*): the stored dtype (e.g. `torch.float16`).
        init (`str` or `Path`, *optional*): continue from this EAGLE-3 checkpoint (`build_eagle3_head`).

    Returns:
        `dict`: the training report (also written to `out/training.json`).

    Raises:
        `ValueError`: aux layers the target lacks, a draft vocabulary size out of range, a resume checkpoint of
            another target or settings (all before any training step).
    """
    settings = settings or TrainingSettings()
    out = Path(out)
    draft_ids, _, _ = draft_vocabulary(token_counts(examples, target.get_output_embeddings().weight.shape[0]),
                                       draft_vocab_size)
    head = build_eagle3_head(target, draft_ids, aux_layer_ids, num_layers, init)
    features = TargetFeatures(target, head.aux_layer_ids, feature_cache)
    loss = Eagle3Loss(target, draft_ids, head.aux_layer_ids, ttt_steps, step_decay, features)
    evaluate = acceptance_evaluator(target, lambda h: EagleDrafter(h, num_draft_tokens=ttt_steps),
                                    held_out_prompts(held_out), eval_tokens, pad_token_id=pad_id(tokenizer))
    identity = fingerprint(target, target_name, "eagle3", aux_layer_ids=head.aux_layer_ids,
                             draft_vocab_size=len(draft_ids), ttt_steps=ttt_steps, num_layers=num_layers)
    result = fit(head, loss, _indexed(examples), pad_id(tokenizer), settings, evaluate, out, identity,
                 resume, "eagle3")
    architectures = list(target.config.architectures or [])
    save_eagle3_head(head, out, verifier_name_or_path=target_name, verifier_architectures=architectures,
                     num_draft_tokens=ttt_steps, dtype=dtype, embed_tokens=target.get_input_embeddings().weight)
    if safeailab:
        save_safeailab_eagle3(head, out / "safeailab", dtype=dtype)
    return _report(out, result, settings, {"kind": "eagle3", "target": target_name, "draft_vocab_size": len(draft_ids),
                                           "aux_layer_ids": head.aux_layer_ids, "ttt_steps": ttt_steps,
                                           "step_decay": step_decay, "num_examples": len(examples)})


def train_medusa(target, tokenizer, examples, held_out, out: str | Path, *, target_name: str,
                 settings: TrainingSettings | None = None, num_heads: int = 3, num_layers: int = 1,
                 own_lm_heads: bool = False, head_decay: float = 0.8, eval_tokens: int = 64,
                 feature_cache: str | Path | None = None, resume: str | Path | None = None,
                 dtype: torch.dtype | None = None, init: str | Path | None = None) -> dict:
    """Trains Medusa-1 heads for `target` (`hf_speculators.training.medusa`), choosing the checkpoint by the
    measured acceptance of their chain (exact verification), and saves them as a Medusa checkpoint (version 2, or
    v0.1 with `own_lm_heads`; with `init`, continuing from the heads of that Medusa checkpoint). Arguments as
    `train_eagle3`; returns the training report."""
    settings = settings or TrainingSettings()
    out = Path(out)
    heads = build_medusa_heads(target, num_heads, num_layers, own_lm_heads, init)
    num_heads, num_layers, own_lm_heads = heads.num_heads, heads.num_layers, heads.has_lm_heads
    loss = MedusaLoss(target, head_decay, TargetFeatures(target, [], feature_cache))
    evaluate = acceptance_evaluator(target, MedusaDrafter, held_out_prompts(held_out), eval_tokens,
                                    pad_token_id=pad_id(tokenizer))
    identity = fingerprint(target, target_name, "medusa", num_heads=num_heads, num_layers=num_layers,
                             own_lm_heads=own_lm_heads)
    result = fit(heads, loss, _indexed(examples), pad_id(tokenizer), settings, evaluate, out, identity,
                 resume, "medusa")
    save_medusa_heads(heads, out, base_model_name_or_path=target_name, dtype=dtype)
    return _report(out, result, settings, {"kind": "medusa", "target": target_name, "num_heads": num_heads,
                                           "num_layers": num_layers, "head_decay": head_decay,
                                           "num_examples": len(examples)})


def train_draft(target, tokenizer, examples, held_out, out: str | Path, *, target_name: str, draft, draft_name: str,
                settings: TrainingSettings | None = None, divergence: str = "fkl",
                num_draft_tokens: int = 3, eval_tokens: int = 64, feature_cache: str | Path | None = None,
                resume: str | Path | None = None, dtype: torch.dtype | None = None) -> dict:
    """Distils the draft model `draft` (from `hf_speculators.training.distill.load_draft`, which checks its
    vocabulary and tokenizer; `draft_name` says where it came from) toward `target` on its outputs, choosing the
    checkpoint by the measured acceptance of a chain of `num_draft_tokens`, and saves it as a plain transformers
    model with the target's tokenizer and a model card whose `speculative_decoding:` block points at it. Other
    arguments as `train_eagle3`; returns the training report.

    Raises:
        `ValueError`: an unknown divergence.
    """
    settings = settings or TrainingSettings()
    out, model = Path(out), draft
    loss = DistillLoss(target, divergence, TargetFeatures(target, [], feature_cache))
    evaluate = acceptance_evaluator(target, lambda m: DraftModelDrafter(m.eval(), num_draft_tokens=num_draft_tokens),
                                    held_out_prompts(held_out), eval_tokens, pad_token_id=pad_id(tokenizer))
    identity = fingerprint(target, target_name, "draft", draft=draft_name, divergence=divergence)
    result = fit(model, loss, _indexed(examples), pad_id(tokenizer), settings, evaluate, out, identity,
                 resume, "draft")
    model.eval().to(dtype or model.dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    SpeculativeConfig(method="draft-model", draft_model=str(out.resolve()), target_model=target_name,
                      num_draft_tokens=num_draft_tokens,
                      source=f"distilled from {target_name} by hf-speculators train draft ({divergence}); held-out "
                             f"mean acceptance length {result['best']['mean_acceptance_length']:.2f} at step "
                             f"{result['best_step']}").save_pretrained(out)
    return _report(out, result, settings, {"kind": "draft", "target": target_name, "draft": draft_name,
                                           "divergence": divergence, "num_examples": len(examples)}, card=False)
