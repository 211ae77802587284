"""EAGLE-3 training (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test"), as vllm-project/speculators, SpecForge and SafeAILab/EAGLE train it, on a frozen HF target.

- Features: the hidden states entering the target's aux layers (default `[2, L // 2, L - 3]`), fused by `fc`.
- Embeddings: the target's, frozen (the head holds none while training; exports write a copy).
- Draft vocabulary: the K most frequent generated tokens (`draft_vocabulary`): `d2t` offsets, `t2d` mask.
- Training-time test over `ttt_steps` steps: step 0 reads the fused features g_t with the true token x_{t+1};
  step k reads the head's own output state of step k - 1 at the same position with the true token x_{t+1+k}
  (teacher-forced), attending to step 0's keys up to t and to its own position's keys of steps 1..k (the attention
  a draft token at depth k has while drafting). Positions advance by one per step.
- Loss at step k: the forward KL from the target's next-token distribution at t + 1 + k, restricted to the draft
  vocabulary and renormalised, to the head's, over positions whose predicted token is a generated one, weighted
  `step_decay ** k` (EAGLE uses 0.8; speculators 1.0).
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaConfig

from ..heads.eagle import Eagle3Head, check_head_fits, default_aux_layer_ids
from ..heads.eagle_formats import load_eagle_head
from ..heads.files import head_folder
from .target_features import TargetFeatures, check_aux_layer_ids, next_token_weights


def draft_vocabulary(counts: torch.LongTensor, draft_vocab_size: int | None):
    """EAGLE-3's reduced draft vocabulary: the `draft_vocab_size` most frequent token ids (ties: the lower id),
    sorted ascending, as speculators and SafeAILab map it.

    Args:
        counts (`torch.LongTensor` of shape `(vocab_size,)`): token frequencies over the trained tokens.
        draft_vocab_size (`int`, *optional*): K; `None` or the full vocabulary size: no reduction.

    Returns:
        `(draft_ids, d2t, t2d)`: `draft_ids` `(K,)` the target ids ascending; `d2t` `(K,)` int64 offsets with
        `target_id = draft_id + d2t[draft_id]`; `t2d` `(vocab_size,)` bool, True for the target ids in the draft
        vocabulary. `d2t` and `t2d` are `None` without reduction.

    Raises:
        `ValueError`: K not in `1 .. vocab_size`.
    """
    vocab_size = counts.numel()
    if draft_vocab_size is None or draft_vocab_size == vocab_size:
        return torch.arange(vocab_size), None, None
    if isinstance(draft_vocab_size, bool) or not isinstance(draft_vocab_size, int) or not 0 < draft_vocab_size < vocab_size:
        raise ValueError(f"draft_vocab_size must be an integer in 1..{vocab_size} (the target's vocabulary), got "
                         f"{draft_vocab_size!r}.")
    order = sorted(range(vocab_size), key=lambda token: (-int(counts[token]), token))
    draft_ids = torch.tensor(sorted(order[:draft_vocab_size]), dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return draft_ids, draft_ids - torch.arange(draft_vocab_size), t2d


def build_eagle3_head(target, draft_ids: torch.LongTensor, aux_layer_ids: list[int] | None = None,
                      num_layers: int = 1, init: str | Path | None = None) -> Eagle3Head:
    """A new EAGLE-3 head as wide as `target` (Llama layers, RoPE base 10000 as SafeAILab's configs), its LM head
    initialised from the target's rows `draft_ids` and `d2t` set from them; or, with `init`, a head that continues
    from the EAGLE-3 checkpoint there (see `continue_from`).

    Args:
        target (`PreTrainedModel`): the target.
        draft_ids (`torch.LongTensor` of shape `(K,)`): the draft vocabulary, ascending (`draft_vocabulary`).
        aux_layer_ids (`list[int]`, *optional*): default `[2, L // 2, L - 3]` (with `init`: the checkpoint's).
        num_layers (`int`, defaults to 1): decoder layers of the head (with `init`: the checkpoint's).
        init (`str` or `Path`, *optional*): an EAGLE-3 checkpoint folder of any format `load_eagle_head` reads.

    Raises:
        `ValueError`: aux layer ids that are not distinct layers of the target (`check_aux_layer_ids`); with `init`,
            a checkpoint that is not an EAGLE-3 head for this target.
    """
    if init is not None:
        return continue_from(load_eagle_head(head_folder(str(init))), target, draft_ids)
    c = target.config.get_text_config()
    aux_layer_ids = check_aux_layer_ids(aux_layer_ids or default_aux_layer_ids(c.num_hidden_layers),
                                        c.num_hidden_layers)
    heads = c.num_attention_heads
    config = LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=heads,
                         num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
                         head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                         rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6), vocab_size=c.vocab_size,
                         max_position_embeddings=getattr(c, "max_position_embeddings", 2048), rope_theta=10000.0)
    head = Eagle3Head(config, draft_vocab_size=len(draft_ids), aux_layer_ids=aux_layer_ids,
                      num_aux=len(aux_layer_ids))
    with torch.no_grad():
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_ids])
        if head.d2t is not None:
            head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
    return head


def continue_from(source: Eagle3Head, target, draft_ids: torch.LongTensor) -> Eagle3Head:
    """A head for `draft_ids` holding the weights of `source` (to continue training a published or earlier head):
    its layers, `fc` and norms as they are, its LM head rows for the ids both vocabularies hold (the target's rows
    for the others), the target's embeddings rather than its own.

    Raises:
        `ValueError`: `source` is not an EAGLE-3 head, or does not fit `target` (`check_head_fits`).
    """
    if not isinstance(source, Eagle3Head):
        raise ValueError(f"--init needs an EAGLE-3 head to continue from, got {type(source).__name__}.")
    check_head_fits(source, target)
    attention = source.layers[0].self_attn
    layer_ids = source.feature_points(target.config.get_text_config().num_hidden_layers)[0]
    head = Eagle3Head(source.config, draft_vocab_size=len(draft_ids), aux_layer_ids=layer_ids, num_aux=len(layer_ids),
                      target_hidden_size=source.target_hidden_size, **source.flags,
                      qk_norm=attention.q_norm is not None, attention_bias=attention.q_proj.bias is not None)
    source_ids = torch.arange(source.draft_vocab_size) + (0 if source.d2t is None else source.d2t.cpu())
    row_of = torch.full((source.vocab_size,), -1, dtype=torch.long)
    row_of[source_ids] = torch.arange(source.draft_vocab_size)
    rows = row_of[draft_ids]
    weight = target.get_output_embeddings().weight.detach()  # on the target's device; the new head is on the CPU
    lm_head = weight[draft_ids.to(weight.device)].to("cpu", source.lm_head.weight.dtype)
    lm_head[rows >= 0] = source.lm_head.weight.detach()[rows[rows >= 0]]
    state = {name: tensor for name, tensor in source.state_dict().items()
             if name not in ("d2t", "embed_tokens.weight", "lm_head.weight")}
    head.load_state_dict({**state, "lm_head.weight": lm_head, **({} if head.d2t is None else
                                                                  {"d2t": draft_ids - torch.arange(len(draft_ids))})})
    return head.float()


def ttt_mask(num_pairs: int, step: int, device=None) -> torch.BoolTensor:
    """`(1, 1, P, (step + 1) P)`, True where a query of training-time-test step `step` attends: step 0's keys at or
    before its position (causal) and its own position's keys of steps 1..step."""
    causal = torch.ones(num_pairs, num_pairs, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(num_pairs, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)[None, None]


class Eagle3Loss:
    """The training-time-test loss of an `Eagle3Head` on a frozen target (see the module docstring).

    Called as `loss(head, batch)` with a batch of `hf_speculators.training.loop.collate`, it returns `(loss,
    metrics)`: the decayed sum over steps of each step's mean forward KL (nats), and per step `acc{k}`, how often
    the head's argmax equals the target's (within the draft vocabulary) on the trained positions.

    Args:
        target (`PreTrainedModel`): the frozen target.
        draft_ids (`torch.LongTensor` of shape `(K,)`): the draft vocabulary.
        aux_layer_ids (`list[int]`): the head's feature layers.
        ttt_steps (`int`, defaults to 3): steps unrolled (speculators 3, SpecForge and EAGLE 7).
        step_decay (`float`, defaults to 0.8): weight `step_decay ** k` of step k.
        features (`TargetFeatures`, *optional*): how the target's features are computed (default: on the fly).
    """

    def __init__(self, target, draft_ids: torch.LongTensor, aux_layer_ids: list[int], ttt_steps: int = 3,
                 step_decay: float = 0.8, features: TargetFeatures | None = None):
        if isinstance(ttt_steps, bool) or not isinstance(ttt_steps, int) or ttt_steps < 1:
            raise ValueError(f"ttt_steps must be an integer >= 1, got {ttt_steps!r}.")
        self.target, self.ttt_steps, self.step_decay = target, ttt_steps, step_decay
        self.features = features or TargetFeatures(target, aux_layer_ids)
        lm_head = target.get_output_embeddings()
        self.teacher_weight = lm_head.weight[draft_ids].detach()
        bias = getattr(lm_head, "bias", None)
        self.teacher_bias = None if bias is None else bias[draft_ids].detach()
        self.embeddings = target.get_input_embeddings()

    def __call__(self, head: Eagle3Head, batch: dict):
        input_ids = batch["input_ids"]
        aux, last = self.features(batch)
        with torch.no_grad():
            teacher = F.log_softmax(F.linear(last, self.teacher_weight.to(last.device), self.teacher_bias).float(), -1)
        weights = next_token_weights(batch["loss_mask"])
        num_pairs = input_ids.shape[1] - self.ttt_steps
        if num_pairs < 1:
            raise ValueError(f"Examples of {input_ids.shape[1]} tokens are too short for {self.ttt_steps} "
                             "training-time-test steps.")
        hidden, cache, loss, metrics = head.combine(aux[:, :num_pairs]), DynamicCache(), 0.0, {}
        for step in range(self.ttt_steps):
            window = slice(1 + step, 1 + step + num_pairs)
            with torch.no_grad():
                inputs = self.embeddings(input_ids[:, window])
            positions = torch.arange(step, step + num_pairs, device=input_ids.device)[None]
            hidden, logits = head(inputs, hidden, positions, cache, ttt_mask(num_pairs, step, input_ids.device))
            log_probs = F.log_softmax(logits.float(), -1)
            step_teacher, step_weights = teacher[:, window], weights[:, window]
            kl = F.kl_div(log_probs, step_teacher, log_target=True, reduction="none").sum(-1)
            total = step_weights.sum().clamp(min=1.0)
            loss = loss + self.step_decay ** step * (kl * step_weights).sum() / total
            hits = (log_probs.argmax(-1) == step_teacher.argmax(-1)).float()
            metrics[f"acc{step}"] = float((hits * step_weights).sum() / total)
        return loss, metrics
