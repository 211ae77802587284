"""Where an eager call of the default job spends its time: per phase of the loop, per verify width, against plain.

Runs the `demo-hybrid` preset's drafter, or `--preset`'s (eager, one thread), on `--limit` prompts of a prompt file,
once to warm up (its cross-call memory cleared after), then again with the loop's phases timed by wrappers around
its methods (`prefill`, `_propose`, the target forward, `_verify_and_commit`, `_feedback`, `_keep_slots`,
`_observe`), then plain `generate()` on the same prompts. Prints each phase's total and per-call milliseconds, the
target forward's median milliseconds per query width (chains and trees apart), and tokens per step against plain's
milliseconds per token. Wall time on a shared machine: compare within one run.

    python examples/held_out_prompts.py --out held_out.jsonl --per-kind 10
    python examples/step_breakdown.py --prompts held_out.jsonl [--limit 12] [--do-sample] [--compile] [--ops] \
        [--batch-size 4] [--preset demo-draft-model --num-draft-tokens 3]

With `--compile`, both ours and plain decode compiled (the bench's `--compile`: a static cache and transformers'
`CompileConfig`, `tools.bench.engines.compiled_kwargs`); the warm-up call compiles, plain's own warm-up runs first.

With `--ops`, one more pass of ours and of plain, untimed, counts per phase the torch operations dispatched (aten
operators: on a GPU each is a kernel launch or a copy, paid in host time) and the host reads (`.tolist()`,
`.item()`, `bool()`, `int()` of a tensor on the model's device, `torch.equal`: on a GPU each waits for the device).
On a CPU they are the host work a GPU step pays beside its forwards, so they can be cut without a GPU. Under
`--compile` the forwards' counts are an eager forward's (inside the counting mode their operators are dispatched
one by one); the loop's own are the compiled path's.

    python examples/step_breakdown.py --prompts spec-bench --limit 2 --max-new-tokens 32 --ops [--compile]
"""

import argparse
import statistics
import time
from collections import Counter, defaultdict

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import hf_speculators as hs
from hf_speculators import loop, target
from hf_speculators.config.build import build_drafter
from hf_speculators.metrics import clock
from hf_speculators.prompts import load_prompts
from hf_speculators.tools.bench.batches import make_batches, pad_token, row_new_ids
from hf_speculators.tools.bench.engines import compiled_kwargs

from demo_runs import add_run_options, demo_target, generate_options

PHASES = ("prefill", "step", "_propose", "_verify_and_commit", "_feedback", "_keep_slots", "_observe")  # the loop's


HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__index__, torch.Tensor.__float__, torch.equal}  # each waits for a GPU's queue


class OpCounts(TorchDispatchMode):
    """While active (with `reads`, its `TorchFunctionMode`): the aten operators dispatched, and the host reads of
    tensors on `device` (on a GPU the CPU's bookkeeping tensors are read without waiting)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.ops = self.host_reads = 0
        counts = self

        class Reads(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                counts.host_reads += func in HOST_READS and args[0].device == device
                return func(*args, **(kwargs or {}))
        self.reads = Reads()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class Timings:
    """Seconds and calls per phase, the target forward's seconds per (query width, tree) pair, and while `counts`
    is set, the operators and host reads per phase."""

    def __init__(self):
        self.seconds, self.calls, self.widths = defaultdict(float), Counter(), defaultdict(list)
        self.ops, self.reads, self.counts = Counter(), Counter(), None

    def timed(self, name: str, method):
        def wrapper(*args, **kwargs):
            counts = self.counts
            if counts is not None:
                ops, reads = counts.ops, counts.host_reads
            start = time.perf_counter()
            result = method(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1
            if counts is not None:
                self.ops[name] += counts.ops - ops
                self.reads[name] += counts.host_reads - reads
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
    parser.add_argument("--ops", action="store_true", help="also count torch operators and host reads per phase")
    parser.add_argument("--preset", default="demo-hybrid", help="the preset whose drafter runs (default: the default "
                        "job's, demo-hybrid)")
    parser.add_argument("--num-draft-tokens", type=int, default=None, metavar="K",
                        help="the preset's drafter at a constant K draft tokens (as vllm_check.bench runs it)")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per call, left padded (a step serves every "
                        "row: its tokens per step are the batch's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = demo_target(args)
    config = hs.SpeculativeConfig.from_pretrained(args.preset)
    if args.num_draft_tokens is not None:
        config = config.override(num_draft_tokens=args.num_draft_tokens, num_draft_tokens_schedule="constant")
    drafter = build_drafter(config, model, tokenizer)
    encoded = [(tokenizer(prompt.text, return_tensors="pt").input_ids.to(model.device), False)
               for prompt in load_prompts(args.prompts, args.limit)]
    batches = make_batches(encoded, args.batch_size, pad_token(tokenizer))
    options = generate_options(args) | (compiled_kwargs(model) if args.compile else {})

    def calls(speculative: bool) -> tuple[float, int]:
        start, new_tokens = clock(model.device), 0
        for seed, batch in enumerate(batches):
            torch.manual_seed(seed)
            extra = dict(candidate_generator=drafter, tokenizer=tokenizer,
                         generator=torch.Generator(model.device).manual_seed(seed)) if speculative else {}
            padding = {} if batch.attention_mask is None else dict(attention_mask=batch.attention_mask,
                                                                   pad_token_id=batch.pad_token_id)
            out = model.generate(batch.input_ids, **padding, **options, **extra)
            width = batch.input_ids.shape[1]
            new_tokens += sum(len(ids) for ids in row_new_ids(out, width, model.generation_config.eos_token_id))
        return clock(model.device) - start, new_tokens

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
    if args.ops:
        print_op_counts(calls, drafter, model.device)


def print_op_counts(calls, drafter, device: torch.device) -> None:
    """One more untimed pass of ours and of plain under `OpCounts`: operators and host reads per phase call."""
    timings = Timings()
    timings.install()
    counts = timings.counts = OpCounts(device)
    drafter.clear_cache()
    with counts, counts.reads:
        calls(True)
        ours = counts.ops, counts.host_reads
        _, plain_tokens = calls(False)
    steps = timings.calls["step"]
    phases = ("step", "_propose", "target forward", *PHASES[3:])
    print("per step (ours): " + ", ".join(
        f"{name} {timings.ops[name] / steps:.1f} ops {timings.reads[name] / steps:.1f} reads" for name in phases))
    print(f"whole calls: ours {ours[0] / steps:.1f} ops and {ours[1] / steps:.1f} host reads per step; plain "
          f"{(counts.ops - ours[0]) / plain_tokens:.1f} ops and {(counts.host_reads - ours[1]) / plain_tokens:.1f} "
          f"host reads per token")


if __name__ == "__main__":
    main()
