"""What one more query token costs: a forward of q new tokens after a cached context, relative to one token.

This is the cost ratio that decides whether wide queries pay (token trees, lookahead decoding's window): a step
that scores q tokens and commits t of them beats plain decoding only if t exceeds the q-token forward's cost in
one-token forwards (plus what drafting costs). Timed in CPU seconds of this process (`time.process_time`, steadier
than wall time on a shared machine), median of `--reps`, one thread.

    python examples/forward_cost.py [--model hf_speculators/demo/target] [--context 200] [--sizes 2,4,9,17,25]

With `--plain-step`, what a plain (one-token) step of the speculative loop costs beside transformers' own decoding
step (each step appends its token, as decoding does), after the longest Spec-Bench prompt of `--category` that leaves room for `--max-new-tokens` (or prompt
`--question-id`; 241, a summarization prompt of the bench's first 24, is 1,172 tokens of the demo tokenizer):
transformers' step (`DynamicCache`, the 2D attention mask and position ids `generate` passes), the loop's step
(`query.forward` over the `RaggedCache` that `prepare_cache` makes, of `GrowingLayer`s) and the same step over a
plain `DynamicCache` (the loop before it used growing layers), interleaved, medians of `--reps`; then whole calls of
`--max-new-tokens`: transformers' `generate()` against the loop with every step plain (a drafter that never drafts).

    python examples/forward_cost.py --plain-step [--category summarization | --question-id 241] [--reps 30] [--calls 5]

With `--products`, the model's linear layers alone (its matrix products, without the rest of its forward), one
after another as a forward runs them, on inputs of 1 and of `--sizes` rows: milliseconds per pass over all of them,
median of `--reps` (the rest of a forward's time is what its other operations and Python work cost).

    python examples/forward_cost.py --products [--model hf_speculators/demo/draft] [--sizes 4,16] [--cpu-linear onednn]
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

import hf_speculators as hs
from hf_speculators.cache import RaggedCache, cache_argument, prepare_cache
from hf_speculators.loading import DEMO_TARGET, load_tokenizer
from hf_speculators.onednn_linear import CPU_LINEAR_KERNELS, with_cpu_linear
from hf_speculators.prompts import load_prompts
from hf_speculators.query import Query, forward


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


class NeverDrafter(hs.Drafter):
    """Proposes nothing: every step of the loop is a plain one-token step."""

    name = "never"

    def draft_row(self, state, input_ids, max_tokens, row):
        return hs.Draft.empty(input_ids.device)


def interleaved(runs: dict, reps: int) -> dict:
    """Median CPU seconds of each of `runs` (name: callable), run in turns, `reps` times (order reversed each time)."""
    times = {name: [] for name in runs}
    for rep in range(reps):
        for name in list(runs)[:: 1 if rep % 2 == 0 else -1]:
            start = time.process_time()
            runs[name]()
            times[name].append(time.process_time() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def plain_step(model, args) -> None:
    """Prints a one-token step's cost and a whole plain call's, the loop's against transformers' (`--plain-step`)."""
    tokenizer = load_tokenizer(args.model)
    fits = model.config.max_position_embeddings - args.max_new_tokens  # as the bench cuts prompts (prompt_budget)
    encoded = [tokenizer(prompt.text, return_tensors="pt").input_ids for prompt in load_prompts("spec-bench")
               if prompt.category == args.category]
    input_ids = max((ids for ids in encoded if ids.shape[1] <= fits), key=lambda ids: ids.shape[1])
    if args.question_id is not None:
        input_ids = next(tokenizer(prompt.text, return_tensors="pt").input_ids for prompt in load_prompts("spec-bench")
                         if str(prompt.question_id) == args.question_id)
    context, name = input_ids.shape[1], cache_argument(model)
    caches = {}
    for kind in ("transformers", "loop", "loop, DynamicLayer"):
        cache = DynamicCache(config=model.config) if kind != "loop" else prepare_cache(None, model.config, context + 64)
        model(input_ids, use_cache=True, **{name: cache})
        caches[kind] = cache if kind == "transformers" else RaggedCache(cache, torch.ones(1, context, dtype=torch.bool))
    token = input_ids[:, -1:]

    def transformers_step():
        cache = caches["transformers"]
        length = cache.get_seq_length()
        model(input_ids=token, attention_mask=torch.ones(1, length + 1, dtype=torch.long),
              position_ids=torch.tensor([[length]]), use_cache=True, logits_to_keep=1, **{name: cache})

    def loop_step(cache: RaggedCache):
        forward(model, cache, Query.from_drafts(token[0], [hs.Draft.empty(token.device)], 0))
        cache.append(torch.ones(1, 1, dtype=torch.bool))

    steps = interleaved({"transformers": transformers_step, "loop": lambda: loop_step(caches["loop"]),
                         "loop, DynamicLayer": lambda: loop_step(caches["loop, DynamicLayer"])}, args.reps)
    print(f"one-token steps after {context} to {context + args.reps} tokens: " + ", ".join(
        f"{kind} {seconds * 1e3:.2f} ms ({seconds / steps['transformers']:.3f}x)" for kind, seconds in steps.items()))
    options = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    calls = interleaved({
        "generate()": lambda: model.generate(input_ids, **options),
        "loop, every step plain": lambda: model.generate(input_ids, custom_generate=hs.generate, plain_floor=False,
                                                         candidate_generator=NeverDrafter(1), **options),
    }, args.calls)
    print(f"{args.max_new_tokens} new tokens: " + ", ".join(
        f"{kind} {seconds:.2f} s ({seconds / calls['generate()']:.3f}x)" for kind, seconds in calls.items()))


def products(model, args) -> None:
    """Prints the median milliseconds of one pass over `model`'s linear layers, per number of input rows."""
    layers = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    times = {}
    for rows in (1, *map(int, args.sizes.split(","))):
        inputs = [torch.randn(rows, layer.in_features) for layer in layers]
        runs = []
        for _ in range(args.reps):
            start = time.process_time()
            for layer, x in zip(layers, inputs):
                layer(x)
            runs.append(time.process_time() - start)
        times[rows] = statistics.median(runs)
    print(f"{len(layers)} linear layers: " + ", ".join(
        f"{rows} row{'s' * (rows > 1)} {1e3 * t:.3f} ms ({t / times[1]:.2f}x)" for rows, t in times.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEMO_TARGET)
    parser.add_argument("--context", type=int, default=200, help="cached tokens before the query")
    parser.add_argument("--sizes", default="2,4,9,17,25", help="query sizes to compare with one token")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--plain-step", action="store_true", help="the loop's plain step against transformers'")
    parser.add_argument("--category", default="summarization", help="--plain-step: its longest Spec-Bench prompt")
    parser.add_argument("--question-id", help="--plain-step: this Spec-Bench prompt instead (241: 1,172 tokens)")
    parser.add_argument("--calls", type=int, default=5, help="--plain-step: whole generate calls of each")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="--plain-step: of each whole call")
    parser.add_argument("--products", action="store_true", help="the model's linear layers alone, per input rows")
    parser.add_argument("--cpu-linear", choices=CPU_LINEAR_KERNELS, default="torch",
                        help="torch (default, as the pages measured before 2026-11-28's oneDNN layers) or onednn "
                             "(hs.use_onednn_linear, the command line's default)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = with_cpu_linear(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32), args.cpu_linear)
    if args.plain_step or args.products:
        with torch.no_grad():
            (plain_step if args.plain_step else products)(model, args)
        return
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
