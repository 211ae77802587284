"""Train Medusa heads for the hf_speculators demo target by self-distillation, and save them with a model card.

Medusa heads (Cai et al. 2024) read the target's last hidden state (after its final norm) at position t; head i
learns the target's own next-token distribution at position t + i + 1, i.e. the token t + i + 2 (the target's LM
head predicts t + 1). Labels are the target's outputs on the demo corpus (self-distillation, as Medusa-2 trains
its heads on the model's own distribution): the forward KL divergence from the target's distribution, summed over
the heads. The heads are in Medusa's "version 2" format: residual blocks only, their logits through the target's
(tied) LM head, which stays frozen.

The corpus, its held-out split and the training loop (AdamW, warmup and cosine decay, bfloat16 autocast on the
CPU) are those of `examples/train_demo_family.py`, imported from it.

Usage::

    python examples/train_demo_medusa.py --data ../shared/data --out hf_speculators/demo/medusa --minutes 15 \\
        --threads 1

``--steps`` replaces the time budget with a fixed number of steps (the model card records the count that
reproduces a run).
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_demo_family as family  # noqa: E402

from hf_speculators.heads.medusa import MedusaHeads  # noqa: E402
from hf_speculators.heads.medusa_formats import save_medusa_heads  # noqa: E402
from hf_speculators.loading import DEMO_TARGET  # noqa: E402

PEAK_LR, WARMUP = 2e-3, 50


def head_log_probs(heads: MedusaHeads, target, hidden: torch.FloatTensor) -> list[torch.FloatTensor]:
    """Head i's log-probabilities `(batch, length - i - 2, vocab)` at the positions whose token t + i + 2 exists."""
    logits = heads(hidden, target.get_output_embeddings())  # [num_heads, batch, length, vocab]
    return [F.log_softmax(logits[i, :, : hidden.shape[1] - i - 2].float(), dim=-1) for i in range(heads.num_heads)]


def distillation_loss(heads: MedusaHeads, target, ids: torch.LongTensor) -> torch.FloatTensor:
    """Sum over heads of the forward KL from the target's distribution at t + i + 1 to head i's at t."""
    with torch.no_grad():
        hidden = target.model(ids).last_hidden_state
        target_log_probs = F.log_softmax(target.lm_head(hidden).float(), dim=-1)
    loss = 0.0
    for i, log_probs in enumerate(head_log_probs(heads, target, hidden)):
        labels = target_log_probs[:, i + 1 : i + 1 + log_probs.shape[1]]
        loss = loss + F.kl_div(log_probs, labels, log_target=True, reduction="none").sum(-1).mean()
    return loss


@torch.no_grad()
def held_out_agreement(heads: MedusaHeads, target, stream: np.ndarray, windows: int = 64) -> list[float]:
    """How often head i's argmax at t equals the target's argmax at t + i + 1, on held-out windows (float32)."""
    data, hits = family.batches(stream, np.random.default_rng(1)), [0.0] * heads.num_heads
    for _ in range(windows // family.BATCH):
        hidden = target.model(next(data)).last_hidden_state
        target_top = target.lm_head(hidden).argmax(-1)
        for i, log_probs in enumerate(head_log_probs(heads, target, hidden)):
            hits[i] += (log_probs.argmax(-1) == target_top[:, i + 1 : i + 1 + log_probs.shape[1]]).float().mean().item()
    return [round(hit / (windows // family.BATCH), 4) for hit in hits]


def model_card(heads: MedusaHeads, steps: int, agreement: list[float], command: str) -> str:
    params = sum(p.numel() for p in heads.parameters())
    layout = (f"Medusa v0.1's format: `config.json` and `medusa_lm_head.safetensors` holding, per head, "
              f"{heads.num_layers} residual block(s) (`x + SiLU(linear(x))`) and its own LM head" if heads.has_lm_heads else
              f"Medusa's \"version 2\" format: `config.json` (`\"version\": \"2\"`) and `medusa_lm_head.safetensors` "
              f"holding {heads.num_layers} residual block(s) (`x + SiLU(linear(x))`) per head; the logits come from "
              "the target's own (tied) LM head")
    per_head = ", ".join(f"head {i} (token t + {i + 2}): {a:.1%}" for i, a in enumerate(agreement))
    return f"""---
license: apache-2.0
library_name: hf_speculators
tags: [hf_speculators, speculative-decoding, medusa, demo]
base_model: hf_speculators/demo-target
---
# hf_speculators demo Medusa heads

{heads.num_heads} Medusa heads (Cai et al. 2024) for the hf_speculators demo target (`hf_speculators/demo-target`), in
{layout}. Load with `hs.MedusaDrafter.from_pretrained("hf_speculators/demo-medusa")`.

- Size: {params / 1e6:.2f}M parameters, float16.
- Data: the demo family's corpus (Tiny Shakespeare, GSM8K train, part of the Python standard library's source;
  see the target's card), every {family.HELD_OUT_EVERY}th document held out.
- Recipe: self-distillation: head i reads the target's last hidden state at position t and learns the target's
  next-token distribution at t + i + 1 (the token t + i + 2) on corpus windows, forward KL summed over the heads;
  the target frozen. {steps} steps of AdamW (peak learning rate {PEAK_LR}, warmup {WARMUP}, cosine
  decay to 10%), batches of {family.BATCH} x {family.SEQ_LEN} tokens, bfloat16 autocast on one CPU thread.
- Held-out top-1 agreement with the target (head i's argmax at t equals the target's argmax at t + i + 1, float32,
  {64 * family.SEQ_LEN} positions): {per_head}.

Retrain with:

```
{command}
```
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path("hf_speculators/demo/medusa"))
    parser.add_argument("--num-heads", type=int, default=3)
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument("--own-lm-heads", action="store_true",
                        help="give each head its own LM head (Medusa v0.1) instead of the target's (version 2)")
    parser.add_argument("--minutes", type=float, default=15)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4, help="windows per step (the demo family trains with 8)")
    args = parser.parse_args()
    family.BATCH = args.batch  # the heads are small: more, smaller steps converge further in the same CPU time
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    target = LlamaForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32).requires_grad_(False).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(DEMO_TARGET)
    train_stream, held_out = family.encode_splits(family.load_documents(args.data), tokenizer)
    lm_weight = target.get_output_embeddings().weight
    heads = MedusaHeads(target.config.hidden_size, args.num_heads, args.num_layers,
                        lm_weight.shape[0] if args.own_lm_heads else None)
    if args.own_lm_heads:  # Medusa's initialisation: every head's LM head starts as the target's
        for head in heads.heads:
            head[-1].weight.data.copy_(lm_weight)
    steps = family.train(heads, lambda ids: distillation_loss(heads, target, ids), train_stream, args.minutes,
                         args.steps, PEAK_LR, "medusa", warmup=WARMUP)
    save_medusa_heads(heads, args.out, base_model_name_or_path="hf_speculators/demo-target", dtype=torch.float16)
    heads.to(torch.float16).float()  # evaluate the weights as shipped
    agreement = held_out_agreement(heads, target, held_out)
    print(f"held-out top-1 agreement per head: {agreement}", flush=True)
    command = (f"python examples/train_demo_medusa.py --data {args.data} --out {args.out} --num-heads "
               f"{args.num_heads} --num-layers {args.num_layers}{' --own-lm-heads' * args.own_lm_heads} "
               f"--batch {args.batch} --steps {steps} --threads 1")
    (args.out / "README.md").write_text(model_card(heads, steps, agreement, command))


if __name__ == "__main__":
    main()
