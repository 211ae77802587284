"""Draft-model distillation (DistillSpec, Zhou et al. 2024, "DistillSpec: Improving Speculative Decoding via
Knowledge Distillation"): a small causal LM trained toward the target's next-token distributions on the target's
own outputs, so that it agrees with the target where the target generates.

Divergences (`DIVERGENCES`), per position whose next token is a generated one:

- `"fkl"`: forward KL, KL(p_target || q_draft) (the demo draft's recipe);
- `"tv"`: total variation, 0.5 * sum |p - q|: greedy-free acceptance is 1 - TV(p, q) (Leviathan et al. 2023), so
  minimising it maximises the expected acceptance of rejection sampling directly (DistillSpec's choice for it).

The result is a plain transformers model (`save_pretrained`), used with `DraftModelDrafter` or `--draft`.
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from ..loading import load_model
from .target_features import TargetFeatures, next_token_weights

DIVERGENCES = ("fkl", "tv")


def _vocab(tokenizer) -> dict:
    return tokenizer.get_vocab() if tokenizer is not None else {}


def load_draft(draft: str, target, target_tokenizer, draft_tokenizer=None):
    """The draft model to train: the weights of a model folder or Hub id, or a new model from a `config.json` (or a
    folder holding a config but no weights), in float32 and training mode.

    Args:
        draft (`str`): a model folder / Hub id, or a config file or folder.
        target (`PreTrainedModel`): the target (for the vocabulary check).
        target_tokenizer: the target's tokenizer.
        draft_tokenizer (*optional*): the draft's own tokenizer, when it has one.

    Raises:
        `ValueError`: a draft whose vocabulary is not the target's (another size, or a tokenizer that does not
            match: distillation compares distributions token by token).
    """
    path = Path(draft).expanduser()
    has_weights = path.is_dir() and any(next(path.glob(pattern), None) for pattern in ("*.safetensors", "*.bin"))
    if path.is_file() or (path.is_dir() and not has_weights):  # a config: a new model
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)), dtype=torch.float32)
    else:
        model = load_model(draft).train()  # float32 on the CPU
    target_vocab = target.get_output_embeddings().weight.shape[0]
    draft_vocab = model.get_output_embeddings().weight.shape[0]
    if draft_vocab != target_vocab:
        raise ValueError(f"The draft scores {draft_vocab} tokens and the target {target_vocab}: distillation needs the "
                         "same vocabulary. Give the draft the target's tokenizer and vocabulary size.")
    if draft_tokenizer is not None and _vocab(draft_tokenizer) != _vocab(target_tokenizer):
        raise ValueError("The draft's tokenizer does not match the target's (their vocabularies differ): a draft "
                         "model must share the target's tokenizer.")
    return model.train()


class DistillLoss:
    """The DistillSpec loss of a draft model toward a frozen target (see the module docstring).

    Called as `loss(draft, batch)`, it returns `(loss, metrics)`: the mean divergence over the trained positions and
    `acc`, how often the draft's argmax equals the target's there.

    Args:
        target (`PreTrainedModel`): the frozen target.
        divergence (`str`, defaults to `"fkl"`): one of `DIVERGENCES`.
        features (`TargetFeatures`, *optional*): default: on the fly.

    Raises:
        `ValueError`: an unknown divergence.
    """

    def __init__(self, target, divergence: str = "fkl", features: TargetFeatures | None = None):
        if divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}.")
        self.divergence, self.lm_head = divergence, target.get_output_embeddings()
        self.features = features or TargetFeatures(target, [])

    def __call__(self, draft, batch: dict):
        _, last = self.features(batch)
        with torch.no_grad():
            teacher = F.log_softmax(self.lm_head(last).float(), -1)
        logits = draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        log_probs = F.log_softmax(logits.float(), -1)
        if self.divergence == "fkl":
            per_position = F.kl_div(log_probs, teacher, log_target=True, reduction="none").sum(-1)
        else:
            per_position = 0.5 * (teacher.exp() - log_probs.exp()).abs().sum(-1)
        weights = next_token_weights(batch["loss_mask"])
        total = weights.sum().clamp(min=1.0)
        hits = (log_probs.argmax(-1) == teacher.argmax(-1)).float()
        return (per_position * weights).sum() / total, {"acc": float((hits * weights).sum() / total)}
