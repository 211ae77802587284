"""What compaction costs and saves in batched speculative decoding: `RaggedCache(max_holes=...)` side by side.

A batch keeps each row's rejected draft slots as masked holes in the KV cache; once the widest row carries more
than `max_holes` holes, every row is compacted (its tokens gathered to the right end). Small values keep the cache
small and the attention short but gather often (0: realign after every step); large ones never gather but attend
over more slots. This runs the batched loop (prompt lookup, greedy) on the same left-padded batches once per value,
back to back per batch, and prints total throughput (new tokens per second), the peak cache width (slots per row)
the share of hole slots (prompt padding included) and the share of slots beyond the widest row's tokens (what
compaction would remove; `max_holes` bounds it), both over all steps. Every value must give the same tokens.

    python examples/batch_compaction.py [--prompts spec-bench] [--limit 16] \\
        [--batch-size 4] [--max-holes 0,8,32,128,100000] [--max-new-tokens 128]
"""

import argparse
import time

import torch

from hf_speculators import PromptLookupDrafter
from hf_speculators.tools.bench.batches import row_new_ids
from hf_speculators.prompts import load_prompts
from hf_speculators.cache import prepare_cache
from hf_speculators.checks import left_padding
from hf_speculators.loop import SpeculativeLoop
from hf_speculators.loading import DEMO_TARGET, load_model, load_tokenizer
from hf_speculators.schedules import make_schedule
from hf_speculators.verifiers import resolve_verifier


class CacheWidth:
    """Cache slots, hole slots and slots beyond the widest row's tokens, after every step of the runs it watches."""

    def __init__(self):
        self.peak_slots, self.slots, self.holes, self.excess = 0, 0, 0, 0

    def watch(self, cache) -> None:
        rows, slots = cache.valid.shape
        self.peak_slots = max(self.peak_slots, slots)
        self.slots += rows * slots
        self.holes += rows * slots - int(cache.valid.sum())
        self.excess += rows * (slots - int(cache.lengths.max()))


def batched_loop(drafter, max_holes: int, width: CacheWidth):
    """A `custom_generate` callable: the loop of `hf_speculators.generate` with `max_holes` set, greedy and exact,
    reporting the cache width after every step to `width`."""

    def loop(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False, **kwargs):
        run = SpeculativeLoop(model, drafter, resolve_verifier(None, False),
                              make_schedule("constant", drafter.num_draft_tokens), generation_config, logits_processor,
                              stopping_criteria, torch.Generator().manual_seed(0),
                              pad_token_id=generation_config.pad_token_id, max_holes=max_holes)
        run.prefill(input_ids, left_padding(kwargs.get("attention_mask"), input_ids),
                    prepare_cache(None, model.config))
        while not run.step():
            width.watch(run.cache)
        return run.output().sequences

    return loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEMO_TARGET)
    parser.add_argument("--prompts", default="spec-bench")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-holes", default="0,8,32,128,100000", help="comma-separated RaggedCache max_holes")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.model)
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = load_model(args.model, "float32", "cpu")
    texts = [p.text for p in load_prompts(args.prompts, args.limit)]
    batches = [tokenizer(texts[i : i + args.batch_size], padding=True, return_tensors="pt")
               for i in range(0, len(texts), args.batch_size)]
    values = [int(v) for v in args.max_holes.split(",")]
    drafter = PromptLookupDrafter(num_draft_tokens=args.num_draft_tokens)
    widths, seconds, outputs = {v: CacheWidth() for v in values}, dict.fromkeys(values, 0.0), {v: [] for v in values}
    common = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    for value in values:  # warm-up, untimed
        model.generate(**batches[0], custom_generate=batched_loop(drafter, value, CacheWidth()), **common)
    for batch in batches:
        for value in values:  # back to back per batch, so that machine noise hits every value alike
            start = time.perf_counter()
            out = model.generate(**batch, custom_generate=batched_loop(drafter, value, widths[value]), **common)
            seconds[value] += time.perf_counter() - start
            outputs[value] += row_new_ids(out, batch["input_ids"].shape[1], tokenizer.eos_token_id)
    print(f"{len(texts)} prompts, batch size {args.batch_size}, {args.max_new_tokens} new tokens, prompt lookup "
          f"k={args.num_draft_tokens}")
    print(f"{'max_holes':>10} {'tokens/s':>9} {'vs first':>9} {'peak slots':>11} {'hole share':>11} {'excess':>7} {'same tokens':>12}")
    first = sum(len(row) for row in outputs[values[0]]) / seconds[values[0]]
    for value in values:
        rate = sum(len(row) for row in outputs[value]) / seconds[value]
        same = all(torch.equal(a, b) for a, b in zip(outputs[value], outputs[values[0]]))
        print(f"{value:>10} {rate:>9.1f} {rate / first:>8.2f}x {widths[value].peak_slots:>11} "
              f"{widths[value].holes / widths[value].slots:>10.1%} {widths[value].excess / widths[value].slots:>6.1%} "
              f"{str(same):>12}")


if __name__ == "__main__":
    main()
