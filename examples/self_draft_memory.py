"""Peak resident memory (RSS) of the demo target alone and with a quantized copy of itself as its draft.

Each measurement runs in a fresh process (peak RSS only grows): load the target, import the mode's library (so
that its import is not counted as the draft's; its cost shows against the first line), build
`DraftModelDrafter.from_target(target, mode)` unless measuring the target alone, and generate 128 tokens greedily
from one prompt.

    python examples/self_draft_memory.py                  # int8, nf4, int4
    python examples/self_draft_memory.py --modes int8
"""

import argparse
import importlib
import resource
import subprocess
import sys

import hf_speculators as hs
from hf_speculators.loading import DEMO_TARGET, load_model, load_tokenizer
from hf_speculators.quantization import LIBRARIES

PROMPT = "def fibonacci(n):"


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def measure(mode: str, with_draft: bool) -> None:
    """In this process: the target, the mode's libraries imported, the self-draft if asked, one generate call."""
    import torch

    torch.set_num_threads(1)
    tokenizer, target = load_tokenizer(DEMO_TARGET), load_model(DEMO_TARGET)
    for library in LIBRARIES.get(mode, ()):  # "none": no quantization library
        importlib.import_module(library)
    kwargs = {}
    if with_draft:
        kwargs = {"custom_generate": hs.generate, "candidate_generator": hs.DraftModelDrafter.from_target(target, mode)}
    target.generate(**tokenizer(PROMPT, return_tensors="pt"), max_new_tokens=128, do_sample=False, **kwargs)
    print(f"{peak_rss_mib():.1f}")


def run(mode: str, with_draft: bool) -> float:
    command = [sys.executable, __file__, "--measure", mode] + (["--with-draft"] if with_draft else [])
    return float(subprocess.run(command, capture_output=True, text=True, check=True).stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="int8,nf4,int4")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--with-draft", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        return measure(args.measure, args.with_draft)
    print(f"target alone, no quantization library imported: {run('none', False):.1f} MiB")
    print("mode  target alone (MiB)  target + self-draft (MiB)  added")
    for mode in args.modes.split(","):
        alone, both = run(mode, False), run(mode, True)
        print(f"{mode:<5} {alone:18.1f}  {both:25.1f}  {both - alone:+.1f} MiB ({both / alone - 1:+.1%})")


if __name__ == "__main__":
    main()
