"""Eager prompt lookup against eager plain decoding on CUDA, with PyTorch's cuDNN attention backend on and off.

On CUDA in half precision, `scaled_dot_product_attention` may pick cuDNN's kernel, which builds an execution plan
per new shape: an eager verify forward meets a new (query, key) shape at every step. This times `--limit`
Spec-Bench prompts with the demo target, plain decoding and ours (`PromptLookupDrafter`, `--num-draft-tokens`),
interleaved, medians of `--repeats`, once with `torch.backends.cuda.enable_cudnn_sdp(True)` (PyTorch's default) and
once with False, then prints `torch.profiler`'s operators of one call of ours by host time and by GPU time.

    python examples/eager_attention_backends.py --dtype bfloat16 [--device cuda] [--limit 4] [--repeats 3]
"""

import argparse
import statistics

import torch

import hf_speculators as hs
from hf_speculators.loading import DEMO_TARGET, load_model, load_tokenizer
from hf_speculators.metrics import clock
from hf_speculators.prompts import load_prompts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = hs.enable(load_model(DEMO_TARGET, args.dtype, args.device)), load_tokenizer(DEMO_TARGET)
    prompts = [tokenizer(p.text, return_tensors="pt").input_ids.to(model.device)
               for p in load_prompts("spec-bench", limit=args.limit)]

    def call(ids, ours: bool) -> float:
        extra = dict(custom_generate=hs.generate, tokenizer=tokenizer,
                     candidate_generator=hs.PromptLookupDrafter(args.num_draft_tokens)) if ours else {}
        start = clock(model.device)
        model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, **extra)
        return clock(model.device) - start

    for cudnn in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        call(prompts[0], True), call(prompts[0], False)  # warm-up
        seconds = {ours: [sum(call(ids, ours) for ids in prompts) for _ in range(args.repeats)]
                   for ours in (False, True)}
        plain, ours = statistics.median(seconds[False]), statistics.median(seconds[True])
        print(f"{args.dtype} cudnn_sdp={cudnn}: plain {plain:.3f} s, ours (prompt lookup) {ours:.3f} s, "
              f"{plain / ours:.2f}x")
    torch.backends.cuda.enable_cudnn_sdp(True)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as profile:
        call(prompts[-1], True)
    events = profile.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50))
    if model.device.type == "cuda":
        print(events.table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=50))


if __name__ == "__main__":
    main()
