"""What one more query token costs: a forward of q new tokens after a cached context, relative to one token.

This is the cost ratio that decides whether wide queries pay (token trees, lookahead decoding's window): a step
that scores q tokens and commits t of them beats plain decoding only if t exceeds the q-token forward's cost in
one-token forwards (plus what drafting costs). Timed in CPU seconds of this process (`time.process_time`, steadier
than wall time on a shared machine), median of `--reps`, one thread.

    python examples/forward_cost.py [--model hf_speculators/demo/target] [--context 200] [--sizes 2,4,9,17,25]
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from hf_speculators.cache import cache_argument
from hf_speculators.loading import DEMO_TARGET


def seconds(model, cache, num_query: int, reps: int, vocab_size: int) -> float:
    """Median CPU seconds of a forward of `num_query` random tokens after `cache` (rolled back after each)."""
    times = []
    for _ in range(reps):
        input_ids = torch.randint(0, vocab_size, (1, num_query))
        start = time.process_time()
        model(input_ids, use_cache=True, logits_to_keep=num_query, **{cache_argument(model): cache})
        times.append(time.process_time() - start)
        cache.crop(-num_query)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEMO_TARGET)
    parser.add_argument("--context", type=int, default=200, help="cached tokens before the query")
    parser.add_argument("--sizes", default="2,4,9,17,25", help="query sizes to compare with one token")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(0, vocab_size, (1, args.context)), use_cache=True, **{cache_argument(model): cache})
        one = seconds(model, cache, 1, args.reps, vocab_size)
        ratios = {q: seconds(model, cache, q, args.reps, vocab_size) / one for q in map(int, args.sizes.split(","))}
    print(f"one token after {args.context}: {one * 1e3:.2f} ms; " +
          ", ".join(f"{q} tokens: {ratio:.2f}x" for q, ratio in ratios.items()))


if __name__ == "__main__":
    main()
