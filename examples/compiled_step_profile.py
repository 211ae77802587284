"""Where a compiled speculative step's time goes, on one prompt: a profile of one warmed-up call, then interleaved
medians of plain (eager), plain-compiled and ours compiled (demo target; the demo draft model, or a preset's
drafter). Prints each warm-up call's seconds and dynamo's compile seconds per graph first
(`TORCHINDUCTOR_CACHE_DIR=<an empty folder>`: cold). On CUDA each call ends with a synchronization, and the
profile's time in a function that waits for the GPU (`.tolist()`, `.item()`) is the host waiting: what is left is
the loop's host work per step.

With `--trace FILE`, one more call each of plain-compiled and ours runs under `torch.profiler` (the CPU and, on
CUDA, the GPU): per call, the wall time, the GPU's busy time (its kernels' and copies' time, added up) and its
share of the wall time, then ours' operators and CUDA runtime calls by host time (the launches, copies and
synchronizations a step pays); ours' trace is written to FILE (Chrome's trace format, gzipped when FILE ends in
`.gz`: chrome://tracing or Perfetto).

    python examples/compiled_step_profile.py [--prompt-index 0] [--max-new-tokens 64] [--num-draft-tokens 3] \\
        [--repeats 5] [--preset demo-hybrid] [--device cuda] [--dtype bfloat16] [--trace ours.json.gz]
"""

import argparse
import cProfile
import pstats
import statistics

import torch
from torch.autograd import DeviceType
from torch._dynamo.utils import compile_times

import hf_speculators as hs
from hf_speculators.config.build import build_drafter
from hf_speculators.loading import DEMO_DRAFT, DEMO_TARGET, load_model, load_tokenizer
from hf_speculators.metrics import clock
from hf_speculators.prompts import load_prompts
from hf_speculators.tools.bench.engines import compiled_kwargs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-index", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--preset", default=None, help="draft with this preset's drafter (default: the demo draft "
                        "model drafting --num-draft-tokens)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="the demo models' dtype (default: float32, as the tests)")
    parser.add_argument("--trace", default=None, help="also profile with torch.profiler; ours' trace to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = hs.enable(load_model(DEMO_TARGET, args.dtype, args.device)), load_tokenizer(DEMO_TARGET)
    drafter = (build_drafter(hs.SpeculativeConfig.from_pretrained(args.preset), model, tokenizer) if args.preset else
               hs.DraftModelDrafter(load_model(DEMO_DRAFT, args.dtype, args.device),
                                    num_draft_tokens=args.num_draft_tokens))
    prompt = load_prompts("spec-bench", limit=args.prompt_index + 1)[args.prompt_index].text
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    runs = {"plain": common, "plain-compiled": {**common, **compiled_kwargs(model)},
            "ours compiled": {**common, **compiled_kwargs(model), "candidate_generator": drafter,
                              "tokenizer": tokenizer}}
    for label, kwargs in runs.items():  # warm-up: compiles (plain-compiled one graph, ours the target's and the draft's)
        print(f"first call, compiling included: {label} {timed_generate(model, ids, kwargs):.1f} s")
    print("dynamo's seconds per compiled graph, in compile order:", compile_times(repr="str"))
    drafter.clear_cache()  # no drafting from the warm-up's output (suffix decoding's memory across calls)
    profile = cProfile.Profile()
    profile.enable()
    out = model.generate(ids, return_dict_in_generate=True, **runs["ours compiled"])
    clock(model.device)  # the device's queue drained inside the profile
    profile.disable()
    stats = out.speculative_stats
    print(f"prompt {args.prompt_index} ({ids.shape[1]} tokens), {stats.num_steps} steps for {stats.num_generated_tokens} "
          f"tokens; the profile's top functions by total time (the compiled graph is inductor's `call`):")
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    print("the step's stages, cumulative: drafting, the draft model's catch-up, the target's forward, verification")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(
        r"(draft_model|hybrid|prompt_lookup|suffix).py.*\((propose|_feed|_greedy_chain)\)|target.py.*\(__call__\)"
        r"|loop.py.*\((_verify_and_commit|_keep_slots|_feedback|_observe)\)")
    if args.trace:
        for label in ("plain-compiled", "ours compiled"):
            drafter.clear_cache()
            torch_profile(model, ids, label, runs[label], args.trace if label == "ours compiled" else None)
    seconds = {label: [] for label in runs}
    for _ in range(args.repeats):
        for label, kwargs in runs.items():  # interleaved
            drafter.clear_cache()
            seconds[label].append(timed_generate(model, ids, kwargs))
    print(", ".join(f"{label} {statistics.median(s) * 1e3 / args.max_new_tokens:.2f} ms/token"
                    for label, s in seconds.items()) + f" (medians of {args.repeats})")


def torch_profile(model, ids, label: str, kwargs: dict, trace: str | None) -> None:
    """One call of `model.generate(ids, **kwargs)` under `torch.profiler`: its wall time and the GPU's busy time
    (every kernel's and copy's device time, added up) printed; with `trace`, the operators and CUDA runtime calls by
    host time, and the Chrome trace to `trace` (gzipped when its name ends in `.gz`)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if model.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        start = clock(model.device)
        model.generate(ids, **kwargs)
        wall = clock(model.device) - start
    events = profile.key_averages()
    busy = sum(event.self_device_time_total for event in events  # the device's own events (kernels, copies):
               if event.device_type == DeviceType.CUDA and not event.is_user_annotation) / 1e6  # us to seconds
    guards = [event for event in events if event.key == "TorchDynamo Cache Lookup"]  # dynamo's guards, per call
    print(f"{label} under torch.profiler: {wall * 1e3:.1f} ms wall, GPU busy {busy * 1e3:.1f} ms "
          f"({busy / wall:.0%}); dynamo's guard checks " + ", ".join(
              f"{event.count} x {event.cpu_time_total / event.count:.0f} us" for event in guards))
    if trace is None:
        return
    print(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    profile.export_chrome_trace(trace)  # torch gzips it when the name ends in .gz


def timed_generate(model, ids, kwargs) -> float:
    """The seconds of `model.generate(ids, **kwargs)`, the device's queue drained (`metrics.clock`)."""
    start = clock(model.device)
    model.generate(ids, **kwargs)
    return clock(model.device) - start


if __name__ == "__main__":
    main()
