"""Medusa-1 training (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads"): residual heads on the frozen target's last hidden state.

Head i (0-based) reads the target's last hidden state (after its final norm) at position t and learns the token at
t + i + 2 (the target's own LM head predicts t + 1): here the forward KL from the target's next-token distribution
at t + i + 1 to head i's, on the positions whose token t + i + 2 is a generated one, weighted `head_decay ** i`
(the paper's decaying head weights). On the target's own greedy outputs the target's argmax at t + i + 1 is that
token, so this is Medusa-1's self-distillation with soft labels. The target stays frozen (Medusa-2 would tune it
and lose exactness with respect to the original target).
"""

from pathlib import Path

import torch
import torch.nn.functional as F

from ..heads.medusa import MedusaHeads
from ..heads.files import head_folder
from ..heads.medusa_formats import read_medusa_heads
from .target_features import TargetFeatures


def build_medusa_heads(target, num_heads: int = 3, num_layers: int = 1, own_lm_heads: bool = False,
                       init: str | Path | None = None) -> MedusaHeads:
    """New Medusa heads for `target`: zero-initialised residual blocks (each head starts as the identity), and with
    `own_lm_heads` an LM head per head initialised from the target's (Medusa's initialisation); without, the heads
    end with the target's LM head (Medusa's "version 2" files). With `init`, the heads of the Medusa checkpoint
    there (their own counts and layout), to continue training.

    Raises:
        `ValueError`: an `init` checkpoint of another hidden size or vocabulary than the target's.
    """
    hidden_size = target.config.get_text_config().hidden_size
    if init is not None:
        heads = read_medusa_heads(head_folder(str(init)))
        vocab_size = target.get_output_embeddings().weight.shape[0]
        if heads.hidden_size != hidden_size or heads.vocab_size not in (None, vocab_size):
            raise ValueError(f"{init}: Medusa heads of hidden size {heads.hidden_size} (vocabulary "
                             f"{heads.vocab_size}) do not fit this target ({hidden_size}, {vocab_size}).")
        return heads
    lm_weight = target.get_output_embeddings().weight
    heads = MedusaHeads(hidden_size, num_heads, num_layers, lm_weight.shape[0] if own_lm_heads else None)
    if own_lm_heads:
        with torch.no_grad():
            for head in heads.heads:
                head[-1].weight.copy_(lm_weight)
    return heads


class MedusaLoss:
    """The Medusa-1 loss of `MedusaHeads` on a frozen target (see the module docstring).

    Called as `loss(heads, batch)`, it returns `(loss, metrics)`: the weighted sum over heads of each head's mean
    forward KL (nats), and per head `acc{i}`, how often its argmax equals the target's at t + i + 1.

    Args:
        target (`PreTrainedModel`): the frozen target.
        head_decay (`float`, defaults to 0.8): weight `head_decay ** i` of head i.
        features (`TargetFeatures`, *optional*): default: on the fly.
    """

    def __init__(self, target, head_decay: float = 0.8, features: TargetFeatures | None = None):
        self.target, self.head_decay = target, head_decay
        self.features = features or TargetFeatures(target, [])
        self.lm_head = target.get_output_embeddings()

    def __call__(self, heads: MedusaHeads, batch: dict):
        _, last = self.features(batch)
        with torch.no_grad():
            teacher = F.log_softmax(self.lm_head(last).float(), -1)  # [B, T, V]: the target's token t + 1
        logits = heads(last, self.lm_head)  # [num_heads, B, T, V]: head i's token t + i + 2
        length, loss, metrics = last.shape[1], 0.0, {}
        for i in range(heads.num_heads):
            span = length - i - 2
            if span < 1:
                break
            log_probs = F.log_softmax(logits[i, :, :span].float(), -1)
            head_teacher = teacher[:, i + 1 : i + 1 + span]
            weights = batch["loss_mask"][:, i + 2 : i + 2 + span].float()
            total = weights.sum().clamp(min=1.0)
            kl = F.kl_div(log_probs, head_teacher, log_target=True, reduction="none").sum(-1)
            loss = loss + self.head_decay ** i * (kl * weights).sum() / total
            hits = (log_probs.argmax(-1) == head_teacher.argmax(-1)).float()
            metrics[f"acc{i}"] = float((hits * weights).sum() / total)
        return loss, metrics
