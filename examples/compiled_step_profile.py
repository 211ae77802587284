"""Where a compiled speculative step's time goes, on one prompt: a profile of one warmed-up call, then interleaved
medians of plain (eager), plain-compiled and ours compiled (demo target, demo draft model). Prints each warm-up
call's seconds and dynamo's compile seconds per graph first (`TORCHINDUCTOR_CACHE_DIR=<an empty folder>`: cold).

    python examples/compiled_step_profile.py [--prompt-index 0] [--max-new-tokens 64] [--num-draft-tokens 3] \\
        [--repeats 5]
"""

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from torch._dynamo.utils import compile_times

import hf_speculators as hs
from hf_speculators.loading import DEMO_DRAFT, DEMO_TARGET, load_model, load_tokenizer
from hf_speculators.prompts import load_prompts
from hf_speculators.tools.bench.engines import compiled_kwargs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-index", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = hs.enable(load_model(DEMO_TARGET, "float32", "cpu")), load_tokenizer(DEMO_TARGET)
    drafter = hs.DraftModelDrafter(load_model(DEMO_DRAFT, "float32", "cpu"), num_draft_tokens=args.num_draft_tokens)
    prompt = load_prompts("spec-bench", limit=args.prompt_index + 1)[args.prompt_index].text
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    runs = {"plain": common, "plain-compiled": {**common, **compiled_kwargs(model)},
            "ours compiled": {**common, **compiled_kwargs(model), "candidate_generator": drafter}}
    for label, kwargs in runs.items():  # warm-up: compiles (plain-compiled one graph, ours the target's and the draft's)
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        print(f"first call, compiling included: {label} {time.perf_counter() - start:.1f} s")
    print("dynamo's seconds per compiled graph, in compile order:", compile_times(repr="str"))
    profile = cProfile.Profile()
    profile.enable()
    out = model.generate(ids, return_dict_in_generate=True, **runs["ours compiled"])
    profile.disable()
    stats = out.speculative_stats
    print(f"prompt {args.prompt_index} ({ids.shape[1]} tokens), {stats.num_steps} steps for {stats.num_generated_tokens} "
          f"tokens; the profile's top functions by total time (the compiled graph is inductor's `call`):")
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)
    print("the step's stages, cumulative: drafting, the draft model's catch-up, the target's forward, verification")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(
        r"draft_model.py.*\((propose|_catch_up)\)|target.py.*\(__call__\)|loop.py.*\((_verify_and_commit|_keep_slots)\)")
    seconds = {label: [] for label in runs}
    for _ in range(args.repeats):
        for label, kwargs in runs.items():  # interleaved
            start = time.perf_counter()
            model.generate(ids, **kwargs)
            seconds[label].append(time.perf_counter() - start)
    print(", ".join(f"{label} {statistics.median(s) * 1e3 / args.max_new_tokens:.2f} ms/token"
                    for label, s in seconds.items()) + f" (medians of {args.repeats})")


if __name__ == "__main__":
    main()
