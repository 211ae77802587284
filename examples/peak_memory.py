"""Peak resident memory (RSS) of speculative methods: each method runs in a fresh process on the same prompt.

Every process loads the target (and imports the quantization library of a ``self-draft-*`` method, whose import
is not the draft's memory), resets the kernel's peak-RSS mark (Linux: ``/proc/self/clear_refs``, so the
transient peak of loading the target does not hide what comes after), then builds the drafter (loading the draft
model, or quantizing a copy of the target), generates once and reports its peak RSS (``VmHWM``). The first row, ``plain``, is the target alone
with plain greedy ``generate()``; the other rows give their excess over it, in MB and relative to it, and the
target's own weights are given for scale (the process's peak also holds Python, torch and transformers).

Usage::

    python examples/peak_memory.py --methods layer-skip,draft-model,self-draft-int8,self-draft-nf4,self-draft-int4
"""

import argparse
import importlib
import json
import subprocess
import sys

import torch

import hf_speculators
from hf_speculators.loading import DEMO_DRAFT, DEMO_TARGET, load_model, load_tokenizer
from hf_speculators.methods import DRAFT_MODEL_METHODS, SELF_DRAFT_METHODS, make_drafter
from hf_speculators.quantization import LIBRARIES

PROMPT = "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."


def peak_rss_mb() -> float:
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    return int(status["VmHWM"].split()[0]) / 1024


def run_one(args) -> None:
    """In the child process: load, generate once, print the peak RSS and the target's weights in MB as JSON."""
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.model)
    target = load_model(args.model)
    for library in LIBRARIES.get(SELF_DRAFT_METHODS.get(args.run), ()):
        importlib.import_module(library)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # the peak RSS mark restarts from the current RSS
    inputs = tokenizer(PROMPT, return_tensors="pt")
    kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    if args.run != "plain":
        draft = load_model(args.draft) if args.run in DRAFT_MODEL_METHODS else None
        drafter = make_drafter(args.run, draft, exit_layer=args.exit_layer, target=target)
        kwargs.update(custom_generate=hf_speculators.generate, candidate_generator=drafter)
    target.generate(**inputs, **kwargs)
    weights = sum(p.numel() * p.element_size() for p in target.parameters()) / 2**20
    print(json.dumps({"peak_rss_mb": peak_rss_mb(), "target_weights_mb": weights}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEMO_TARGET)
    parser.add_argument("--draft", default=DEMO_DRAFT)
    parser.add_argument("--methods", default="plain,layer-skip,draft-model")
    parser.add_argument("--exit-layer", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--run", help=argparse.SUPPRESS)  # set in the child processes
    args = parser.parse_args()
    if args.run:
        return run_one(args)
    methods = ["plain"] + [m for m in args.methods.split(",") if m and m != "plain"]
    common = ["--model", args.model, "--draft", args.draft, "--exit-layer", str(args.exit_layer),
              "--max-new-tokens", str(args.max_new_tokens)]
    peaks = {}
    for method in methods:
        child = subprocess.run([sys.executable, __file__, "--run", method, *common], capture_output=True, text=True,
                               check=True)
        result = json.loads(child.stdout.strip().splitlines()[-1])
        peaks[method] = result["peak_rss_mb"]
    print(f"target weights: {result['target_weights_mb']:.0f} MB")
    print("| method | peak RSS (MB) | over plain (MB) | over plain |\n| --- | --- | --- | --- |")
    for method, peak in peaks.items():
        extra = peak - peaks["plain"]
        print(f"| {method} | {peak:.0f} | {extra:+.0f} | {extra / peaks['plain']:+.1%} |")


if __name__ == "__main__":
    main()
