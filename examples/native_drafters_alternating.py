"""Ours against transformers' own MTP or DFlash chain, alternating calls in one process: a quieter check than the
bench's single pass on a busy machine. Uses the checkpoints `examples/bench_native_drafters.py` built in `--work`.

Usage::

    python examples/native_drafters_alternating.py --data ../shared/data --work /tmp/nb --method dflash
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import MellumForCausalLM, MuseGlimmerAssistantModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_native_drafters import shakespeare_lines  # noqa: E402

import hf_speculators as hs  # noqa: E402
from hf_speculators.loading import DEMO_TARGET, load_model, load_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--method", choices=("mtp", "dflash"), required=True)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(DEMO_TARGET)
    if args.method == "mtp":
        target = MellumForCausalLM.from_pretrained(args.work / "mtp-target", dtype=torch.float32).eval()
        drafter, theirs_kwargs = hs.MTPDrafter.from_target(target), {"use_mtp": True}
    else:
        target = load_model(DEMO_TARGET)
        model = MuseGlimmerAssistantModel.from_pretrained(args.work / "dflash").eval()
        drafter, theirs_kwargs = hs.DFlashDrafter(model), {"assistant_model": model, "speculation_type": "dflash"}
    runs = {"ours": {"custom_generate": hs.generate, "candidate_generator": drafter}, "theirs": theirs_kwargs}
    ratios = []
    for text in shakespeare_lines(args.data / "tinyshakespeare_input.txt", args.prompts, skip=200):
        inputs = tokenizer(text, return_tensors="pt")
        for kwargs in runs.values():  # warm-up
            target.generate(**inputs, do_sample=False, max_new_tokens=96, **kwargs)
        for _ in range(args.repeats):
            seconds = {}
            for name, kwargs in runs.items():
                start = time.perf_counter()
                target.generate(**inputs, do_sample=False, max_new_tokens=96, **kwargs)
                seconds[name] = time.perf_counter() - start
            ratios.append(seconds["theirs"] / seconds["ours"])
    print(f"{args.method}: transformers' seconds / ours, median {statistics.median(ratios):.2f} over "
          f"{len(ratios)} pairs (min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main()
