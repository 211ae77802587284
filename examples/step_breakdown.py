"""Where an eager call of the default job spends its time: per phase of the loop, per verify width, against plain.

Runs the `demo-hybrid` preset's drafter (eager, one thread) on `--limit` prompts of a prompt file, once to warm
up (its cross-call memory cleared after), then again with the loop's phases timed by wrappers around its methods
(`prefill`, `_propose`, the target forward, `_verify_and_commit`, `_feedback`, `_keep_slots`, `_observe`), then
plain `generate()` on the same prompts. Prints each phase's total and per-call milliseconds, the target forward's
median milliseconds per query width (chains and trees apart), and tokens per step against plain's milliseconds per
token. Wall time on a shared machine: compare within one run.

    python examples/held_out_prompts.py --out held_out.jsonl --per-kind 10
    python examples/step_breakdown.py --prompts held_out.jsonl [--limit 12] [--do-sample] [--compile]

With `--compile`, both ours and plain decode compiled (the bench's `--compile`: a static cache and transformers'
`CompileConfig`, `tools.bench.engines.compiled_kwargs`); the warm-up call compiles, plain's own warm-up runs first.
"""

import argparse
import statistics
import time
from collections import Counter, defaultdict

import torch

import hf_speculators as hs
from hf_speculators import loop, target
from hf_speculators.config.build import build_drafter
from hf_speculators.prompts import load_prompts
from hf_speculators.tools.bench.engines import compiled_kwargs

from demo_runs import add_run_options, demo_target, generate_options

PHASES = ("prefill", "step", "_propose", "_verify_and_commit", "_feedback", "_keep_slots", "_observe")  # the loop's


class Timings:
    """Seconds and calls per phase, and the target forward's seconds per (query width, tree) pair."""

    def __init__(self):
        self.seconds, self.calls, self.widths = defaultdict(float), Counter(), defaultdict(list)

    def timed(self, name: str, method):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = method(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1
            return result
        return wrapper

    def timed_forward(self, method):
        def wrapper(forward, cache, query, *args, **kwargs):
            start = time.perf_counter()
            result = method(forward, cache, query, *args, **kwargs)
            self.widths[(query.valid.shape[1], query.visible is not None)].append(time.perf_counter() - start)
            return result
        return wrapper

    def install(self) -> None:
        for name in PHASES:
            setattr(loop.SpeculativeLoop, name, self.timed(name, getattr(loop.SpeculativeLoop, name)))
        target.TargetForward.__call__ = self.timed("target forward", self.timed_forward(target.TargetForward.__call__))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_options(parser, limit=12)
    parser.add_argument("--compile", action="store_true", help="ours and plain compiled, as the bench's --compile")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = demo_target(args.device)
    drafter = build_drafter(hs.SpeculativeConfig.from_pretrained("demo-hybrid"), model, tokenizer)
    encoded = [tokenizer(prompt.text, return_tensors="pt").to(model.device)
               for prompt in load_prompts(args.prompts, args.limit)]
    options = generate_options(args) | (compiled_kwargs(model) if args.compile else {})

    def calls(speculative: bool) -> tuple[float, int]:
        start, new_tokens = time.perf_counter(), 0
        for seed, inputs in enumerate(encoded):
            torch.manual_seed(seed)
            extra = dict(candidate_generator=drafter, tokenizer=tokenizer,
                         generator=torch.Generator(model.device).manual_seed(seed)) if speculative else {}
            new_tokens += model.generate(**inputs, **options, **extra).shape[1] - inputs.input_ids.shape[1]
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, new_tokens

    calls(True)  # warm-up
    if args.compile:  # plain-compiled compiles its own graphs
        calls(False)
    drafter.clear_cache()
    timings = Timings()
    timings.install()
    seconds, new_tokens = calls(True)
    plain_seconds, plain_tokens = calls(False)
    for name in (*PHASES[:3], "target forward", *PHASES[3:]):
        print(f"{name:20s} {timings.seconds[name]:7.3f} s  {timings.calls[name]:5d} calls  "
              f"{1e3 * timings.seconds[name] / max(timings.calls[name], 1):6.2f} ms each")
    print("target forward by query width (tree or not): " + ", ".join(
        f"{width}{' tree' if tree else ''}: {len(times)} x {1e3 * statistics.median(times):.2f} ms"
        for (width, tree), times in sorted(timings.widths.items()) if len(times) >= 3))
    per_token, plain_per_token = seconds / new_tokens, plain_seconds / plain_tokens
    print(f"ours: {seconds:.2f} s, {new_tokens / timings.calls['step']:.2f} tokens per step, "
          f"{1e3 * timings.seconds['step'] / new_tokens:.2f} ms per token in steps; plain: {plain_seconds:.2f} s, "
          f"{1e3 * plain_per_token:.2f} ms per token; {plain_per_token / per_token:.2f}x plain")


if __name__ == "__main__":
    main()
