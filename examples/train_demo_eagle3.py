"""Train the demo EAGLE-3 head for the demo target: self-distillation with EAGLE-3's training-time test.

The head (one decoder layer the width of the target, `hf_speculators.heads.eagle.Eagle3Head`) reads the inputs of
the target's decoder layers 2, 4 and 5 (EAGLE-3's default `[2, L // 2, L - 3]` for L = 8) and learns the target's
own next-token distributions on the demo corpus (labels from the frozen target, no human labels). Training-time
test (Li et al. 2025, section 3.2): each batch is unrolled for `--ttt-steps` steps; step k feeds the head's own
output states of step k - 1 with the next true tokens, each query attending to the real features before it and
to its own earlier steps (the attention a draft token at depth k has while drafting), and adds the forward KL to
the target's distribution at that depth.

The data helpers and the training loop (AdamW, warmup, cosine decay, bfloat16 autocast on CPU) are those of
`examples/train_demo_family.py`. The head is saved in the speculators `eagle3` format (float16 safetensors), with
a model card holding its held-out agreement per draft position and the command that retrains it.

Usage::

    python examples/train_demo_eagle3.py --data ../shared/data --out hf_speculators/demo/eagle3 --minutes 20
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_demo_family as family  # noqa: E402

from hf_speculators.heads.eagle import Eagle3Head, default_aux_layer_ids  # noqa: E402
from hf_speculators.heads.eagle_formats import load_eagle_head, save_eagle3_head  # noqa: E402

TARGET_ID = "hf_speculators/demo-target"
PEAK_LR = 2e-3
LOSS_STRIDE = 2
WARMUP = 30


def build_head(target) -> Eagle3Head:
    """A one-layer EAGLE-3 head as wide as `target`, its LM head initialized from the target's."""
    c = target.config
    config = LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=1,
                         num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                         head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, vocab_size=c.vocab_size,
                         max_position_embeddings=c.max_position_embeddings, rope_theta=10000.0)
    head = Eagle3Head(config, aux_layer_ids=default_aux_layer_ids(c.num_hidden_layers))
    with torch.no_grad():
        head.lm_head.weight.copy_(target.get_output_embeddings().weight)
    return head


def ttt_mask(num_pairs: int, step: int) -> torch.BoolTensor:
    """`(1, 1, P, (step + 1) P)`, True where a query of TTT step `step` attends: the real pairs at or before its
    position (step 0's keys, causal) and its own position in steps 1..step (its ancestors while drafting)."""
    causal = torch.ones(num_pairs, num_pairs, dtype=torch.bool).tril()
    diagonal = torch.eye(num_pairs, dtype=torch.bool)
    return torch.cat([causal] + [diagonal] * step, dim=1)[None, None]


class TrainingTimeTest:
    """EAGLE-3's training-time test of `head` on the frozen `target` over `steps` steps."""

    def __init__(self, target, head: Eagle3Head, steps: int):
        self.target, self.head, self.steps = target, head, steps
        self.layer_ids = head.feature_points(target.config.num_hidden_layers)[0]

    def rollout(self, ids: torch.LongTensor):
        """For each step k, the head's logits `(B, P, V)` and the target's log-probabilities `(B, P, V)` of the
        token after the pair (f_t, x_{t+1+k}), for P = T - steps pairs of each window of `ids` `(B, T)`."""
        num_pairs = ids.shape[1] - self.steps
        with torch.no_grad():
            output = self.target(ids, output_hidden_states=True)
            features = torch.cat([output.hidden_states[i][:, :num_pairs] for i in self.layer_ids], dim=-1)
            target_log_probs = F.log_softmax(output.logits.float(), dim=-1)  # [B, T, V]
        hidden, cache = self.head.combine(features), DynamicCache()
        embeddings = self.target.get_input_embeddings()
        for step in range(self.steps):
            inputs = embeddings(ids[:, 1 + step : 1 + step + num_pairs])
            positions = torch.arange(step, step + num_pairs)[None]
            hidden, logits = self.head(inputs, hidden, positions, cache, ttt_mask(num_pairs, step))
            yield logits, target_log_probs[:, 1 + step : 1 + step + num_pairs]

    def loss(self, ids: torch.LongTensor) -> torch.Tensor:
        """The forward KL to the target's distribution, summed over the steps, averaged over every
        `LOSS_STRIDE`-th position (the full-vocabulary KL of every position would cost more than the forward)."""
        return sum(F.kl_div(F.log_softmax(logits[:, ::LOSS_STRIDE].float(), dim=-1), target[:, ::LOSS_STRIDE],
                            log_target=True, reduction="none").sum(-1).mean() for logits, target in self.rollout(ids))

    @torch.no_grad()
    def agreement(self, stream: np.ndarray, windows: int = 32) -> list[float]:
        """Per step, how often the head's argmax equals the target's on held-out windows (true tokens before)."""
        sums, data = [0.0] * self.steps, family.batches(stream, np.random.default_rng(1))
        for _ in range(windows // family.BATCH):
            for step, (logits, target) in enumerate(self.rollout(next(data))):
                sums[step] += (logits.argmax(-1) == target.argmax(-1)).float().mean().item()
        return [round(total / (windows // family.BATCH), 4) for total in sums]


def earlier_commands(folder: Path) -> list[str]:
    """The commands in the model card of the head saved in `folder` (those that trained it)."""
    card = (folder / "README.md").read_text(encoding="utf-8")
    return card.split("Retrain with:\n\n```\n", 1)[1].split("\n```", 1)[0].splitlines()


def model_card(head: Eagle3Head, steps: int, ttt_steps: int, agreement: list[float], minutes: float,
               command: str) -> str:
    params = sum(p.numel() for p in head.parameters())
    per_step = ", ".join(f"{k + 1}: {a:.1%}" for k, a in enumerate(agreement))
    return f"""---
license: apache-2.0
library_name: hf_speculators
tags: [hf_speculators, speculative-decoding, eagle3, speculators, demo]
base_model: {TARGET_ID}
---
# hf_speculators demo EAGLE-3 head

An EAGLE-3 draft head (Li et al. 2025) for the hf_speculators demo target, in the vllm-project/speculators
`eagle3` format (`config.json` + float16 `model.safetensors`): `hs.EagleDrafter.from_pretrained(
"hf_speculators/demo-eagle3")` drafts with it; vLLM reads the same files.

- Size: {params / 1e6:.2f}M parameters (the target's embeddings are reused, not stored): `fc` from 3 x
  {head.config.hidden_size} to {head.config.hidden_size}, one decoder layer whose attention reads [embedding |
  fused features] (width {2 * head.config.hidden_size}), intermediate size {head.config.intermediate_size},
  {head.config.num_attention_heads} heads, final norm, LM head over the full {head.draft_vocab_size}-token vocabulary.
- Features: the inputs of the target's decoder layers {head.aux_layer_ids} (EAGLE-3's default `[2, L // 2, L - 3]`).
- Data: the demo family's training corpus (Tiny Shakespeare, GSM8K train, Python standard library source; every
  {family.HELD_OUT_EVERY}th document held out), windows of {family.SEQ_LEN} tokens, batches of {family.BATCH}.
- Recipe: self-distillation, the forward KL to the frozen target's next-token distribution, with EAGLE-3's
  training-time test over {ttt_steps} steps (step k feeds the head's own states of step k - 1); each command
  below runs AdamW (peak learning rate {PEAK_LR}, warmup {WARMUP}, cosine decay to 10%) with bfloat16 autocast on
  one CPU thread (the last one: {steps} steps, {minutes:.0f} minutes on a shared 2-core machine).
- Held-out argmax agreement with the target per draft position (true tokens before it): {per_step}.

Retrain with:

```
{command}
```
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--target", type=Path, default=Path("hf_speculators/demo/target"))
    parser.add_argument("--out", type=Path, default=Path("hf_speculators/demo/eagle3"))
    parser.add_argument("--init", type=Path, help="continue from the head saved in this folder (its card's commands "
                        "are kept in the new card)")
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="windows per batch (the family's default: 8)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per window (the family's default: 512)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    # more, smaller updates than the family's 8 x 512 batches: a 20-minute CPU budget allows only ~100 of those
    family.BATCH, family.SEQ_LEN = args.batch, args.seq_len
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.target)
    train_stream, held_out = family.encode_splits(family.load_documents(args.data), tokenizer)
    target = LlamaForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
    head = build_head(target) if args.init is None else load_eagle_head(args.init).float()
    earlier = [] if args.init is None else earlier_commands(args.init)
    ttt = TrainingTimeTest(target, head, args.ttt_steps)
    start = time.time()
    steps = family.train(head, ttt.loss, train_stream, args.minutes, args.steps, PEAK_LR, "eagle3", warmup=WARMUP)
    minutes = (time.time() - start) / 60
    agreement = ttt.agreement(held_out)
    print(f"held-out argmax agreement per step: {agreement}", flush=True)
    save_eagle3_head(head, args.out, verifier_name_or_path=TARGET_ID, verifier_architectures=["LlamaForCausalLM"],
                     num_draft_tokens=args.ttt_steps, dtype=torch.float16)
    init = "" if args.init is None else f"--init {args.init} "
    command = (f"python examples/train_demo_eagle3.py --data {args.data} --target {args.target} {init}"
               f"--out {args.out} --steps {steps} --ttt-steps {args.ttt_steps} --batch {args.batch} "
               f"--seq-len {args.seq_len} --threads {args.threads}")
    (args.out / "README.md").write_text(model_card(head, steps, args.ttt_steps, agreement, minutes,
                                                   "\n".join(earlier + [command])))


if __name__ == "__main__":
    main()
