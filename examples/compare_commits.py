"""Tokens per second of two source trees of hf_speculators side by side: the speed check of a refactor.

Each (tree, method, batch size) runs in its own process with that tree first on `PYTHONPATH`, alternating between
the trees `--rounds` times, so that machine noise hits both alike; a run is `--limit` prompts on the demo family,
greedy (or sampled with `--temperature`, seeded per batch), one thread, and reports new tokens per CPU second of the
process (`time.process_time`, less sensitive than wall time to other processes on a shared machine). It prints each
method's median ratio (after / before) and checks that both trees give the same tokens (sampled runs may differ
where a drafter reads the clock, as the hybrid's does). Only the public drafter constructors and `generate` are
used, so any two commits with this API compare; `hybrid` is the default job's drafter (suffix decoding and the
demo draft model, k = 3).

    git worktree add /tmp/before <commit>
    python examples/compare_commits.py --before /tmp/before --after . [--methods prompt-lookup,draft-model,eagle3,layer-skip,hybrid]
        [--batch-sizes 1,4] [--prompts spec-bench | FILE.jsonl] [--limit 10] [--max-new-tokens 64] [--rounds 3]
        [--temperature 0.7]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from hf_speculators.prompts import prompts_path

RUN = r'''
import gzip, json, sys, time
import torch
torch.set_num_threads(1)
import hf_speculators as hs
from transformers import AutoModelForCausalLM, AutoTokenizer
method, batch_size, limit, max_new_tokens, prompts_file = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
temperature = float(sys.argv[6])
demo = hs.__file__.rsplit("/", 1)[0] + "/demo/"
tokenizer = AutoTokenizer.from_pretrained(demo + "target", padding_side="left")
model = AutoModelForCausalLM.from_pretrained(demo + "target", dtype=torch.float32)
load_draft = lambda: AutoModelForCausalLM.from_pretrained(demo + "draft", dtype=torch.float32)
if method == "prompt-lookup":
    drafter = hs.PromptLookupDrafter(num_draft_tokens=8)
elif method == "draft-model":
    drafter = hs.DraftModelDrafter(load_draft(), num_draft_tokens=3)
elif method == "eagle3":
    drafter = hs.EagleDrafter.from_pretrained(demo + "eagle3", num_draft_tokens=3)
elif method == "layer-skip":
    drafter = hs.LayerSkipDrafter(exit_layer=1, num_draft_tokens=3)
elif method == "hybrid":
    drafter = hs.HybridDrafter(hs.SuffixDrafter(), hs.DraftModelDrafter(load_draft(), num_draft_tokens=3))
sampling = {"do_sample": True, "temperature": temperature} if temperature else {"do_sample": False}
opener = gzip.open if prompts_file.endswith(".gz") else open
texts = [json.loads(line)["turns"][0] for line in opener(prompts_file, "rt", encoding="utf-8")][:limit]
tokens, seconds, outputs = 0, 0.0, []
for i in range(0, len(texts), batch_size):
    batch = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True)
    start = time.process_time()
    out = model.generate(**batch, custom_generate=hs.generate, candidate_generator=drafter, **sampling,
                         generator=torch.Generator().manual_seed(i), max_new_tokens=max_new_tokens,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    seconds += time.process_time() - start
    tokens += (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    outputs += out[:, batch["input_ids"].shape[1]:].tolist()
print(json.dumps({"tokens_per_second": tokens / seconds, "outputs": outputs}))
'''


def run(tree: Path, method: str, batch_size: int, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    result = subprocess.run([sys.executable, "-c", RUN, method, str(batch_size), str(args.limit),
                             str(args.max_new_tokens), args.prompts, str(args.temperature)], env=env,
                            capture_output=True, text=True, check=True, cwd="/")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, default=Path("."))
    parser.add_argument("--methods", default="prompt-lookup,draft-model,eagle3,layer-skip")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--prompts", default="spec-bench", help="a named set (spec-bench) or a Spec-Bench-style JSONL")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy)")
    args = parser.parse_args()
    args.prompts = str(prompts_path(args.prompts).resolve())
    print(f"{'method':>14} {'batch':>5} {'before tok/s':>13} {'after tok/s':>12} {'median ratio':>13} {'same tokens':>12}")
    for method in args.methods.split(","):
        for batch_size in map(int, args.batch_sizes.split(",")):
            ratios, before, after, same = [], [], [], True
            for round_ in range(args.rounds):
                order = [args.before, args.after] if round_ % 2 == 0 else [args.after, args.before]
                results = {tree: run(tree, method, batch_size, args) for tree in order}
                before.append(results[args.before]["tokens_per_second"])
                after.append(results[args.after]["tokens_per_second"])
                ratios.append(after[-1] / before[-1])
                same &= results[args.before]["outputs"] == results[args.after]["outputs"]
            print(f"{method:>14} {batch_size:>5} {statistics.median(before):>13.1f} {statistics.median(after):>12.1f} "
                  f"{statistics.median(ratios):>12.3f}x {str(same):>12}", flush=True)


if __name__ == "__main__":
    main()
