"""Benchmark the drafters transformers ships (MTP layers, DFlash) in our loop beside transformers' own.

Builds two seeded checkpoints in `--work` (no download), then runs `run_benchmark` on Tiny Shakespeare prompts,
every method side by side in one process, one thread:

- `mtp-target`: a small Mellum target (MoE, the demo tokenizer's 4096 tokens) trained briefly on Tiny Shakespeare
  (`--target-steps`), with one MTP layer stored beside its weights in Mellum's checkpoint layout, the layer distilled
  briefly (`distill_mtp`) on the target's own greedy continuations of Tiny Shakespeare lines. transformers' `generate(use_mtp=True)` and our
  `MTPDrafter.from_target` both load it from there.
- `dflash`: a one-layer DFlash block drafter (transformers' `MuseGlimmerAssistantModel`) for the trained demo
  target, reading the outputs of its layers 1, 3 and 5 (the last: the final norm's), distilled the same way.

Batch size 1: plain, transformers' `hf-mtp` / `hf-dflash`, ours (chains, same draft length) and ours with top-k trees.
Batch size 4: plain batched `generate()` and ours (transformers' cannot batch).

Usage::

    python examples/bench_native_drafters.py --data ../shared/data --work /tmp/native-bench \\
        --out docs/benchmarks/records/native_drafters
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import MellumConfig, MellumForCausalLM, MuseGlimmerAssistantConfig
from transformers import MuseGlimmerAssistantModel
from transformers.modeling_layers import MtpModel

from hf_speculators.loading import DEMO_TARGET, load_model, load_tokenizer
from hf_speculators.tools.bench import BenchSettings, named_methods, run_benchmark
from hf_speculators.training.native import distill_dflash, distill_mtp

SEED = 0


def shakespeare_lines(path: Path, count: int, skip: int = 0) -> list[str]:
    """`count` passages of three lines of Tiny Shakespeare, after the first `skip`."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return ["\n".join(lines[i : i + 3]) for i in range(3 * skip, 3 * (skip + count), 3)]


def greedy_sequences(target, tokenizer, texts: list[str], new_tokens: int) -> list[torch.LongTensor]:
    """The target's greedy continuations of `texts`, prompt included, `(1, length)` each."""
    with torch.no_grad():
        return [target.generate(**tokenizer(text, return_tensors="pt"), do_sample=False, max_new_tokens=new_tokens)
                for text in texts]


def train_target(target, tokenizer, corpus: str, steps: int, length: int = 128, batch_size: int = 8) -> None:
    """Next-token training of `target` on random `length`-token windows of `corpus` (AdamW, lr 3e-3, seeded)."""
    ids = torch.tensor(tokenizer(corpus[:400_000])["input_ids"])
    generator = torch.Generator().manual_seed(SEED)
    optimizer = torch.optim.AdamW(target.parameters(), lr=3e-3, weight_decay=0.0)
    target.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - length - 1, (batch_size,), generator=generator)
        batch = torch.stack([ids[start : start + length] for start in starts.tolist()])
        loss = target(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    target.eval()


def build_mtp_target(folder: Path, tokenizer, corpus: str, train_texts: list[str], target_steps: int,
                     steps: int) -> None:
    """A seeded Mellum target, trained for `target_steps`, with a distilled MTP layer beside its weights (Mellum's
    `mtp.layers.0.` keys)."""
    torch.manual_seed(SEED)
    config = MellumConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                          num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          num_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
                          num_mtp_layers=1, mtp_layer_types=["full_attention"], tie_word_embeddings=False,
                          bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target = MellumForCausalLM(config)
    train_target(target, tokenizer, corpus, target_steps)
    mtp_model = MtpModel(target, 1)
    mtp_model.layers.apply(target._init_weights)  # the constructor leaves the experts' weights uninitialized
    distill_mtp(mtp_model, target, greedy_sequences(target, tokenizer, train_texts, 96), steps=steps)
    target.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    for name, tensor in mtp_model.state_dict().items():
        if not name.startswith(("embed_tokens", "shared_head")):
            weights["mtp." + name.replace(".mtp_block.", ".")] = tensor.contiguous()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def build_dflash(folder: Path, target, tokenizer, train_texts: list[str], steps: int) -> None:
    """A seeded one-layer DFlash drafter (block size 5: 4 draft tokens) for the demo target, distilled on its outputs."""
    torch.manual_seed(SEED)
    hidden = target.config.hidden_size
    config = MuseGlimmerAssistantConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=1024, block_size=5,
        mask_token_id=len(tokenizer) - 1, target_layer_ids=[1, 3, target.config.num_hidden_layers - 1],
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = MuseGlimmerAssistantModel(config)
    distill_dflash(model, target, greedy_sequences(target, tokenizer, train_texts, 96), steps=steps)
    model.save_pretrained(folder)


def run(target, tokenizer, prompts, names: list[str], batch_size: int, out: Path | None, new_tokens: int, **options):
    settings = BenchSettings(max_new_tokens=new_tokens, batch_size=batch_size, num_threads=1,
                             out_path=None if out is None else str(out))
    result = run_benchmark(target, tokenizer, prompts, named_methods(names, **options), settings)
    print(result.table())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="folder with tinyshakespeare_input.txt")
    parser.add_argument("--work", type=Path, required=True, help="folder for the two checkpoints built here")
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSONL records")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--steps", type=int, default=300, help="distillation steps of each drafter")
    parser.add_argument("--target-steps", type=int, default=400, help="training steps of the Mellum target")
    args = parser.parse_args()
    torch.set_num_threads(1)
    corpus = args.data / "tinyshakespeare_input.txt"
    train_texts, prompts = shakespeare_lines(corpus, 24), shakespeare_lines(corpus, args.prompts, skip=200)
    tokenizer = load_tokenizer(DEMO_TARGET)
    demo = load_model(DEMO_TARGET)
    mtp_folder, dflash_folder = args.work / "mtp-target", args.work / "dflash"
    if not (mtp_folder / "model.safetensors").exists():
        build_mtp_target(mtp_folder, tokenizer, corpus.read_text(), train_texts, args.target_steps, args.steps)
    if not (dflash_folder / "model.safetensors").exists():
        build_dflash(dflash_folder, demo, tokenizer, train_texts, args.steps)
    mellum = MellumForCausalLM.from_pretrained(mtp_folder, dtype=torch.float32).eval()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    record = (lambda name: None) if args.out is None else (lambda name: args.out / f"{name}.jsonl")
    results = {
        "mtp_b1": run(mellum, tokenizer, prompts, ["hf-mtp", "mtp", "mtp-tree"], 1, record("mtp_b1"),
                      args.new_tokens, tree_top_k=4, tree_nodes=4),
        "mtp_b4": run(mellum, tokenizer, prompts, ["mtp", "mtp-tree"], 4, record("mtp_b4"), args.new_tokens,
                      tree_top_k=4, tree_nodes=4),
        "dflash_b1": run(demo, tokenizer, prompts, ["hf-dflash", "dflash", "dflash-tree"], 1, record("dflash_b1"),
                         args.new_tokens, dflash_model=str(dflash_folder), tree_top_k=2, tree_nodes=8),
        "dflash_b4": run(demo, tokenizer, prompts, ["dflash", "dflash-tree"], 4, record("dflash_b4"),
                         args.new_tokens, dflash_model=str(dflash_folder), tree_top_k=2, tree_nodes=8),
    }
    print(json.dumps({name: {"ok": result.ok, **{method: {k: figures.get(k) for k in (
        "speedup", "mean_acceptance_length", "acceptance_rate_per_position", "tokens_per_s", "draft_cost_ratio")} for method, figures in result.summary["all"].items()}}
        for name, result in results.items()}, indent=1, default=str))


if __name__ == "__main__":
    main()
