"""Train the demo model family that hf_speculators ships: a tokenizer, a Llama-style target and a distilled draft.

The family is trained from scratch on real text (Tiny Shakespeare, GSM8K train, the Python standard library's
own source), because no pretrained weights can be downloaded where this project is built.

Stages (all run by default, each reads what the previous one wrote under ``--out``):

1. ``tokenizer``: one byte-level BPE tokenizer (Hugging Face ``tokenizers``) shared by target and draft.
2. ``target``: a Llama-style causal LM trained with next-token cross-entropy.
3. ``layerskip``: continual pretraining of the target with the LayerSkip recipe (Elhoushi et al. 2024): layer
   dropout rising with depth and an early-exit loss through the shared final norm and LM head, so that the
   target's first layers draft for ``LayerSkipDrafter``. It replaces the saved target and reports the held-out
   loss and argmax agreement at every exit layer.
4. ``draft``: a much smaller Llama distilled from the final target with the forward KL divergence to its
   next-token distribution on the same corpus (DistillSpec, Zhou et al. 2023), so that it agrees with it.

Each model is saved as ``float16`` safetensors (to keep the shipped weights small) with a model card holding
its held-out loss and the command that retrains it. Training uses bfloat16 autocast on the CPU (``--autocast off``:
float32, faster on CPUs without native bfloat16 arithmetic).

Usage::

    python examples/train_demo_family.py --data ../shared/data --out hf_speculators/demo \\
        --target-minutes 50 --draft-minutes 18

``--target-steps`` / ``--draft-steps`` / ``--layerskip-steps`` replace the time budget with a fixed number of
steps (to reproduce a run exactly, pass the step counts its model cards record). ``--stages`` picks the stages;
a stage that is skipped reads what an earlier run saved under ``--out``.
"""

import argparse
import contextlib
import functools
import json
import math
import os
import random
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import ByteLevelBPETokenizer
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS = "<|endoftext|>"
SEQ_LEN = 512
BATCH = 8
HELD_OUT_EVERY = 50  # every 50th document is held out for evaluation
MAX_PYTHON_BYTES = 10_000_000  # keep English about half of the corpus

# LayerSkip (Elhoushi et al. 2024) continual pretraining: the last layer's dropout rate, the rotation of the
# early-exit curriculum (each step adds the exit loss of every ROTATION-th layer, rotating) and its scale
LAYER_DROPOUT_MAX = 0.1
EARLY_EXIT_ROTATION = 3
EARLY_EXIT_SCALE = 1.0
LAYERSKIP_PEAK_LR = 1e-3

STAGES = ("tokenizer", "target", "layerskip", "draft")
TARGET_SHAPE = dict(hidden_size=384, num_hidden_layers=8, intermediate_size=1024, num_attention_heads=6)
DRAFT_SHAPE = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=768, num_attention_heads=4)


def load_documents(data_dir: Path) -> list[str]:
    """Returns the corpus as documents: Shakespeare in 40-line scenes, GSM8K items, stdlib modules."""
    lines = (data_dir / "tinyshakespeare_input.txt").read_text().splitlines(keepends=True)
    docs = ["".join(lines[i : i + 40]) for i in range(0, len(lines), 40)]
    with open(data_dir / "gsm8k_train.jsonl") as f:
        docs += [f"Question: {row['question']}\nAnswer: {row['answer']}\n" for row in map(json.loads, f)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if not ({"test", "tests", "site-packages"} & set(p.parts)))
    random.Random(0).shuffle(files)
    python_bytes = 0
    for path in files:
        text = path.read_text(errors="ignore")
        if python_bytes + len(text) > MAX_PYTHON_BYTES:
            continue
        docs.append(text)
        python_bytes += len(text)
    return docs


def train_tokenizer(docs: list[str], out: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(docs, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token=EOS, eos_token=EOS, pad_token=EOS)
    for name in ("target", "draft"):
        tokenizer.save_pretrained(out / name)
    return tokenizer


def encode_splits(docs: list[str], tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Encodes the documents into one train and one held-out token stream, each document ended by EOS."""
    ids = tokenizer(docs)["input_ids"]
    eos = tokenizer.eos_token_id
    train, held_out = [], []
    for i, doc in enumerate(ids):
        (held_out if i % HELD_OUT_EVERY == 0 else train).extend(doc + [eos])
    return np.array(train, dtype=np.int32), np.array(held_out, dtype=np.int32)


def batches(stream: np.ndarray, generator: np.random.Generator):
    while True:
        starts = generator.integers(0, len(stream) - SEQ_LEN - 1, BATCH)
        yield torch.from_numpy(np.stack([stream[s : s + SEQ_LEN] for s in starts]).astype(np.int64))


def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, loss_fn, stream, minutes: float, steps: int | None, peak_lr: float, label: str, autocast: bool,
          warmup: int = 200) -> int:
    """Runs AdamW with warmup and cosine decay; the step count is fixed after 20 steps from the time budget.
    Forwards run under bfloat16 autocast when `autocast`, else in float32."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    data = batches(stream, np.random.default_rng(0))
    total, start, step = steps or 10**9, time.time(), 0
    model.train()
    while step < total:
        if steps is None and step == 20:
            total = int(minutes * 60 / ((time.time() - start) / 20))
            print(f"[{label}] {total} steps fit in {minutes} minutes", flush=True)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, total, peak_lr, warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(next(data))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0:
            print(f"[{label}] step {step}/{total} loss {loss.item():.3f} {time.time() - start:.0f}s", flush=True)
        step += 1
    model.eval()
    return total


@torch.no_grad()
def evaluate(target, draft, stream: np.ndarray, windows: int = 64) -> dict:
    """Held-out cross-entropy (nats per token, fp32) of each model and the draft's top-1 agreement with the target."""
    data = batches(stream, np.random.default_rng(1))
    sums = {"target_loss": 0.0, "draft_loss": 0.0, "top1_agreement": 0.0}
    for _ in range(windows // BATCH):
        ids = next(data)
        target_logits = target(ids).logits[:, :-1]
        sums["target_loss"] += F.cross_entropy(target_logits.flatten(0, 1), ids[:, 1:].flatten()).item()
        if draft is not None:
            draft_logits = draft(ids).logits[:, :-1]
            sums["draft_loss"] += F.cross_entropy(draft_logits.flatten(0, 1), ids[:, 1:].flatten()).item()
            sums["top1_agreement"] += (draft_logits.argmax(-1) == target_logits.argmax(-1)).float().mean().item()
    return {key: round(value / (windows // BATCH), 4) for key, value in sums.items()}


class LayerSkipRecipe:
    """The LayerSkip training recipe (Elhoushi et al. 2024, section 4.1) on a Llama model, through forward hooks.

    - Layer dropout: in training, decoder layer l of L is skipped for a whole sequence with probability
      ``LAYER_DROPOUT_MAX * (exp(l ln 2 / (L - 1)) - 1)``: 0 at the first layer, rising to the maximum at the last.
    - Early-exit loss through the shared final norm and LM head after layer l, added to the final layer's
      cross-entropy for the layers with ``(l + step) % EARLY_EXIT_ROTATION == 0`` (rotational curriculum), each
      scaled by ``EARLY_EXIT_SCALE``. It is the forward KL from the final layer's (detached) next-token
      distribution to the exit's, rather than LayerSkip's cross-entropy to the data: a drafting exit is accepted
      when it agrees with the full model, so it is trained to (self-distillation, as DistillSpec trains the draft).
    """

    def __init__(self, model):
        self.model, self.exits, self.exit_states, self.step = model, set(), {}, 0
        depth = model.config.num_hidden_layers
        self.drop_rates = [LAYER_DROPOUT_MAX * (math.exp(i * math.log(2) / (depth - 1)) - 1) for i in range(depth)]

    @contextlib.contextmanager
    def hooked(self):
        handles = [layer.register_forward_hook(functools.partial(self._after_layer, i), with_kwargs=True)
                   for i, layer in enumerate(self.model.model.layers)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _after_layer(self, index, module, args, kwargs, output):
        hidden_in = args[0] if args else kwargs["hidden_states"]
        if self.model.training and self.drop_rates[index] > 0:
            keep = torch.rand(output.shape[0], 1, 1) >= self.drop_rates[index]
            output = torch.where(keep, output, hidden_in)
        if index in self.exits:
            self.exit_states[index] = output
        return output

    def exit_log_probs(self, index: int) -> torch.Tensor:
        """Next-token log-probabilities `(batch, seq, vocab)` of the exit after layer `index` (0-based), through the
        shared final norm and LM head, from the hidden states the last forward recorded."""
        logits = self.model.lm_head(self.model.model.norm(self.exit_states[index]))
        return F.log_softmax(logits.float(), dim=-1)

    def loss(self, ids: torch.LongTensor) -> torch.Tensor:
        depth = self.model.config.num_hidden_layers
        self.exits = {i for i in range(depth - 1) if (i + self.step) % EARLY_EXIT_ROTATION == 0}
        self.step += 1
        output = self.model(ids, labels=ids)
        final_log_probs = F.log_softmax(output.logits.float(), dim=-1).detach()
        loss = output.loss
        for i in self.exits:
            kl = F.kl_div(self.exit_log_probs(i), final_log_probs, log_target=True, reduction="none")
            loss = loss + EARLY_EXIT_SCALE * kl.sum(-1).mean()
        return loss

    @torch.no_grad()
    def held_out_exits(self, stream: np.ndarray, windows: int = 64) -> dict[str, list[float]]:
        """Per exit layer 1..L (fp32): held-out cross-entropy (nats per token) and the share of positions whose
        argmax equals the full model's (the last exit is the full model)."""
        depth = self.model.config.num_hidden_layers
        self.exits, data = set(range(depth)), batches(stream, np.random.default_rng(1))
        losses, agreements = [0.0] * depth, [0.0] * depth
        for _ in range(windows // BATCH):
            ids = next(data)
            self.model(ids)
            log_probs = [self.exit_log_probs(i)[:, :-1] for i in range(depth)]
            for i, exit_log_probs in enumerate(log_probs):
                losses[i] += F.nll_loss(exit_log_probs.flatten(0, 1), ids[:, 1:].flatten()).item()
                agreements[i] += (exit_log_probs.argmax(-1) == log_probs[-1].argmax(-1)).float().mean().item()
        self.exits = set()
        batches_run = windows // BATCH
        return {"exit_losses": [round(x / batches_run, 4) for x in losses],
                "exit_agreements": [round(x / batches_run, 4) for x in agreements]}


def layerskip_continual_pretraining(target, stream, minutes: float, steps: int | None, autocast: bool) -> int:
    """Continues training `target` with the LayerSkip recipe (`LayerSkipRecipe`); returns the steps it ran."""
    target.requires_grad_(True)
    recipe = LayerSkipRecipe(target)
    with recipe.hooked():
        return train(target, recipe.loss, stream, minutes, steps, LAYERSKIP_PEAK_LR, "layerskip", autocast,
                     warmup=50)


def held_out_exits(model, held_out: np.ndarray) -> dict[str, list[float]]:
    recipe = LayerSkipRecipe(model)
    with recipe.hooked():
        return recipe.held_out_exits(held_out)


def build_model(shape: dict, tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id, **shape,
    )
    return LlamaForCausalLM(config)


def save(model, out: Path) -> None:
    """Saves float16 weights (as shipped) and reloads them in float32, so evaluation sees the shipped model."""
    model.to(torch.float16).save_pretrained(out)
    model.to(torch.float32)
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = "float32"  # loads in float32 by default: float16 matmuls are slow on CPUs
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def model_card(role: str, model, steps: dict, stats: dict, command: str, autocast: bool) -> str:
    params = sum(p.numel() for p in model.parameters())
    c = model.config
    recipe = {
        "target": f"next-token cross-entropy for {steps['target']} steps (peak learning rate 2e-3, warmup 200), then "
                  f"{steps['layerskip']} steps of LayerSkip continual pretraining (peak {LAYERSKIP_PEAK_LR}, warmup 50): layer "
                  f"dropout rising with depth to {LAYER_DROPOUT_MAX} and an early-exit loss through the shared "
                  f"final norm and LM head at every {EARLY_EXIT_ROTATION}rd layer, rotating (Elhoushi et al. 2024), "
                  "here the forward KL to the final layer's next-token distribution (self-distillation)",
        "draft": f"forward KL to the next-token distribution of the target after its LayerSkip stage "
                 f"(DistillSpec), {steps['draft']} steps (peak learning rate 3e-3, warmup 200)",
    }[role]
    plain_loss = stats["plain_target_loss"]
    before = "" if plain_loss is None else f" (before its LayerSkip stage {plain_loss})"
    exits = " | ".join(f"{i + 1}: {loss} ({agreement:.1%})" for i, (loss, agreement)
                       in enumerate(zip(stats["exit_losses"], stats["exit_agreements"])))
    return f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [hf_speculators, speculative-decoding, demo]
---
# hf_speculators demo {role}

The {role} model of the hf_speculators demo family: a Llama-style causal LM trained from scratch on one CPU
machine, shipped so that speculative decoding can be demonstrated and benchmarked without downloads.
It writes Shakespeare-like verse, GSM8K-style arithmetic and Python; it is not a useful assistant.

- Size: {params / 1e6:.2f}M parameters; {c.num_hidden_layers} layers, hidden size {c.hidden_size},
  intermediate size {c.intermediate_size}, {c.num_attention_heads} heads, vocabulary {c.vocab_size} (tied embeddings).
- Tokenizer: byte-level BPE trained on the same corpus, shared by target and draft.
- Data: Tiny Shakespeare (karpathy/char-rnn), GSM8K train (openai/grade-school-math), and about
  {MAX_PYTHON_BYTES // 1_000_000} MB of the Python {'.'.join(map(str, __import__('sys').version_info[:2]))} standard library's source (tests excluded).
  Every {HELD_OUT_EVERY}th document is held out.
- Recipe: {recipe}. AdamW (betas 0.9/0.95, weight decay 0.1), cosine decay to 10%, batches of
  {BATCH} x {SEQ_LEN} tokens, {"bfloat16 autocast" if autocast else "float32"} on CPU. Weights stored in float16,
  loaded in float32.
- Held-out evaluation (float32, nats per token): target {stats["target_loss"]}{before}, draft
  {stats["draft_loss"]}; the draft's argmax equals the target's on
  {stats["top1_agreement"]:.1%} of held-out positions.
- The target's held-out loss when it exits after layer l (its first l layers, final norm and LM head; what
  `LayerSkipDrafter(exit_layer=l)` drafts with), and in brackets how often that exit's argmax equals the full
  model's: {exits}.

Retrain with:

```
{command}
```
"""


def distill_draft(target, tokenizer, stream, minutes: float, steps: int | None, autocast: bool):
    """Trains the draft on the forward KL to the target's next-token distribution (DistillSpec); returns it and its steps."""
    draft = build_model(DRAFT_SHAPE, tokenizer)
    target.requires_grad_(False)

    def distill_loss(ids):
        with torch.no_grad():
            target_log_probs = F.log_softmax(target(ids).logits.float(), dim=-1)
        draft_log_probs = F.log_softmax(draft(ids).logits.float(), dim=-1)
        return F.kl_div(draft_log_probs, target_log_probs, log_target=True, reduction="none").sum(-1).mean()

    return draft, train(draft, distill_loss, stream, minutes, steps, 3e-3, "draft", autocast)


def load_saved(out: Path, role: str):
    return LlamaForCausalLM.from_pretrained(out / role, dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path("hf_speculators/demo"))
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, from {STAGES}")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--target-minutes", type=float, default=50)
    parser.add_argument("--draft-minutes", type=float, default=18)
    parser.add_argument("--layerskip-minutes", type=float, default=20)
    parser.add_argument("--target-steps", type=int)
    parser.add_argument("--draft-steps", type=int)
    parser.add_argument("--layerskip-steps", type=int)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--autocast", choices=("bfloat16", "off"), default="bfloat16",
                        help="bfloat16 (default, as the shipped models were trained): fast where the CPU has bfloat16 "
                             "arithmetic (AVX-512 BF16, AMX); off: float32, several times faster on AVX2-only CPUs")
    args = parser.parse_args()
    autocast = args.autocast == "bfloat16"
    stages = args.stages.split(",")
    skipped_without_steps = [s for s in STAGES[1:] if s not in stages and getattr(args, f"{s}_steps") is None]
    if skipped_without_steps:
        parser.error(f"pass --{{stage}}-steps for the skipped stages {skipped_without_steps} (their model cards need it)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    docs = load_documents(args.data)
    if "tokenizer" in stages:
        tokenizer = train_tokenizer(docs, args.out, args.vocab_size)
    else:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.out / "target")
    train_stream, held_out = encode_splits(docs, tokenizer)
    print(f"{len(docs)} documents, {len(train_stream)} train / {len(held_out)} held-out tokens", flush=True)

    steps = {"target": args.target_steps, "draft": args.draft_steps, "layerskip": args.layerskip_steps}
    if "target" in stages:
        target = build_model(TARGET_SHAPE, tokenizer)
        target_loss = lambda ids: target(ids, labels=ids).loss  # noqa: E731
        steps["target"] = train(target, target_loss, train_stream, args.target_minutes, args.target_steps, 2e-3,
                                "target", autocast)
        save(target, args.out / "target")
    else:
        target = load_saved(args.out, "target")
    plain_target_loss = None  # the saved target may have had its LayerSkip stage already
    if "layerskip" in stages:
        print(f"[layerskip] before: {held_out_exits(target, held_out)}", flush=True)
        plain_target_loss = evaluate(target, None, held_out)["target_loss"]
        torch.manual_seed(0)  # layer dropout draws the same whichever stages ran before
        steps["layerskip"] = layerskip_continual_pretraining(target, train_stream, args.layerskip_minutes,
                                                             args.layerskip_steps, autocast)
        save(target, args.out / "target")
    if "draft" in stages:
        draft, steps["draft"] = distill_draft(target, tokenizer, train_stream, args.draft_minutes,
                                              args.draft_steps, autocast)
        save(draft, args.out / "draft")
    else:
        draft = load_saved(args.out, "draft")

    stats = evaluate(target, draft, held_out)
    stats.update(plain_target_loss=plain_target_loss, **held_out_exits(target, held_out))
    print(stats, flush=True)
    command = (f"python examples/train_demo_family.py --data {args.data} --out {args.out} --vocab-size "
               f"{args.vocab_size} --target-steps {steps['target']} --draft-steps {steps['draft']} "
               f"--layerskip-steps {steps['layerskip']}" + ("" if autocast else " --autocast off"))
    trained = {"target": {"target", "layerskip"} & set(stages), "draft": {"draft"} & set(stages)}
    for role, model in (("target", target), ("draft", draft)):
        if trained[role]:  # a card describes the run that trained its model
            (args.out / role / "README.md").write_text(model_card(role, model, steps, stats, command, autocast))


if __name__ == "__main__":
    main()
