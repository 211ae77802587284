"""Peak resident memory (RSS) of speculative methods: each method runs in a fresh process on the same prompt.

Every process loads the target (and imports the quantization library of a ``self-draft-*`` method, whose import
is not the draft's memory), notes its resident memory (``VmRSS``) and resets the kernel's peak-RSS mark (Linux:
``/proc/self/clear_refs``, so the transient peak of loading does not hide what comes after), then builds the
drafter (loading the draft model, or quantizing a copy of the target), generates once and reports its peak
(``VmHWM``). The first row, ``plain``, is the target alone with plain greedy ``generate()``; for the others,
"added" is what drafting adds to it (their peak over their loaded process, minus plain's), in MB and relative to
plain's peak. The target's own weights are given for scale (each process also holds Python, torch and
transformers).

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
from hf_speculators.config.methods import draft_model_methods, make_drafter, self_draft_methods
from hf_speculators.quantization import LIBRARIES

PROMPT = "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."


def rss_mb(field: str) -> float:
    """`VmHWM` (peak) or `VmRSS` (current) resident memory of this process, in MB."""
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    return int(status[field].split()[0]) / 1024


def run_one(args) -> None:
    """In the child process: load, generate once, print the peak RSS and the target's weights in MB as JSON."""
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.model)
    target = load_model(args.model)
    for library in LIBRARIES.get(self_draft_methods().get(args.run), ()):
        importlib.import_module(library)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # the peak RSS mark restarts from the current RSS
    loaded = rss_mb("VmRSS")
    inputs = tokenizer(PROMPT, return_tensors="pt")
    kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    if args.run != "plain":
        draft = load_model(args.draft) if args.run in draft_model_methods() else None
        drafter = make_drafter(args.run, draft, exit_layer=args.exit_layer, target=target)
        kwargs.update(custom_generate=hf_speculators.generate, candidate_generator=drafter)
    target.generate(**inputs, **kwargs)
    weights = sum(p.numel() * p.element_size() for p in target.parameters()) / 2**20
    print(json.dumps({"loaded_mb": loaded, "peak_mb": rss_mb("VmHWM"), "target_weights_mb": weights}))


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
    runs = {}
    for method in methods:
        child = subprocess.run([sys.executable, __file__, "--run", method, *common], capture_output=True, text=True,
                               check=True)
        runs[method] = json.loads(child.stdout.strip().splitlines()[-1])
    plain = runs["plain"]
    print(f"target weights: {plain['target_weights_mb']:.0f} MB; 'added' is a method's peak over its own loaded "
          "process minus plain's, i.e. what drafting adds to generating with the target alone")
    print("| method | loaded (MB) | peak (MB) | added (MB) | added / plain peak |\n| --- | --- | --- | --- | --- |")
    for method, run in runs.items():
        added = (run["peak_mb"] - run["loaded_mb"]) - (plain["peak_mb"] - plain["loaded_mb"])
        print(f"| {method} | {run['loaded_mb']:.0f} | {run['peak_mb']:.0f} | {added:+.0f} | "
              f"{added / plain['peak_mb']:+.1%} |")

if __name__ == "__main__":
    main()
