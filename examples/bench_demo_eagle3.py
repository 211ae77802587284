"""Side-by-side figures for the demo EAGLE-3 head: plain greedy `generate`, the demo draft model and EAGLE-3
chains and a tree, on the same Spec-Bench prompts in one process (greedy, every method checked against plain).

Usage::

    python examples/bench_demo_eagle3.py --prompts ../shared/data/spec_bench_question.jsonl --limit 24
"""

import argparse
import time

import torch

import hf_speculators as hs
from hf_speculators.benchmark import load_prompts
from hf_speculators.drafters.eagle import EagleDrafter
from hf_speculators.heads.eagle import Eagle3Head
from hf_speculators.heads.eagle_formats import load_eagle_head
from hf_speculators.loading import load_model, load_tokenizer
from hf_speculators.metrics import SpeculativeStats
from hf_speculators.vocab import ranked_draft_vocab


def reduced_vocab_head(head: Eagle3Head, draft_vocab: torch.LongTensor) -> Eagle3Head:
    """A copy of a full-vocabulary `head` that drafts only `draft_vocab` (ascending ids) through `d2t`."""
    reduced = Eagle3Head(head.config, draft_vocab_size=len(draft_vocab), aux_layer_ids=head.aux_layer_ids)
    state = head.state_dict()
    state["lm_head.weight"] = state["lm_head.weight"][draft_vocab]
    state["d2t"] = draft_vocab - torch.arange(len(draft_vocab))
    reduced.load_state_dict(state)
    return reduced.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", default="../shared/data/spec_bench_question.jsonl")
    parser.add_argument("--limit", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--head", default="hf_speculators/demo/eagle3")
    parser.add_argument("--chains", default="3,4,5", help="EAGLE-3 chain lengths k")
    parser.add_argument("--trees", default="4,2,6;5,4,16", help="DynamicTrees depth,top_k,num_nodes; separated by ;")
    parser.add_argument("--draft-vocab-size", type=int, default=2048, help="also run k=3 with this reduced vocab")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, tokenizer = load_model("hf_speculators/demo-target"), load_tokenizer("hf_speculators/demo-target")
    draft, head = load_model("hf_speculators/demo-draft"), load_eagle_head(args.head)
    methods = {"plain": lambda: None, "draft-model k=3": lambda: hs.DraftModelDrafter(draft, 3)}
    methods |= {f"eagle3 k={k}": (lambda k=k: EagleDrafter(head, k)) for k in map(int, args.chains.split(","))}
    if args.draft_vocab_size:
        small = reduced_vocab_head(head, ranked_draft_vocab("hf_speculators/demo-target/token_ranking.json",
                                                            args.draft_vocab_size))
        methods[f"eagle3 k=3 vocab={args.draft_vocab_size}"] = lambda: EagleDrafter(small, 3)
    for tree in args.trees.split(";"):
        shape = tuple(map(int, tree.split(",")))
        methods[f"eagle3 tree {tree}"] = lambda shape=shape: EagleDrafter(head, tree=hs.DynamicTree(*shape))

    prompts = [tokenizer(p.text, return_tensors="pt").input_ids[:, -1024:] for p in load_prompts(args.prompts,
                                                                                               args.limit)]

    def run(name, input_ids):
        drafter = methods[name]()
        kwargs = {} if drafter is None else {"custom_generate": hs.generate, "candidate_generator": drafter}
        start = time.perf_counter()
        out = target.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                              return_dict_in_generate=True, **kwargs)
        return out.sequences[0, input_ids.shape[1]:], time.perf_counter() - start, getattr(out, "speculative_stats",
                                                                                          None)

    for name in methods:  # warm-up
        run(name, prompts[0])
    totals = {name: {"seconds": 0.0, "tokens": 0, "identical": 0, "stats": SpeculativeStats()} for name in methods}
    for input_ids in prompts:
        plain_ids = None
        for name in methods:  # back to back on each prompt
            new_ids, seconds, stats = run(name, input_ids)
            plain_ids = new_ids if plain_ids is None else plain_ids
            total = totals[name]
            total["seconds"] += seconds
            total["tokens"] += len(new_ids)
            total["identical"] += new_ids.tolist() == plain_ids.tolist()
            if stats is not None:
                pooled = total["stats"]
                pooled.num_drafts += stats.num_drafts
                pooled.num_accepted_tokens += stats.num_accepted_tokens
                pooled.draft_time += stats.draft_time
                pooled.num_draft_tokens += stats.num_draft_tokens
                for i, (d, a) in enumerate(zip(stats.drafted_per_position, stats.accepted_per_position)):
                    if i == len(pooled.drafted_per_position):
                        pooled.drafted_per_position.append(0)
                        pooled.accepted_per_position.append(0)
                    pooled.drafted_per_position[i] += d
                    pooled.accepted_per_position[i] += a
    plain_seconds = totals["plain"]["seconds"]
    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, greedy, {args.threads} thread(s)")
    print(f"{'method':28} {'tok/s':>7} {'speedup':>8} {'mean acc len':>12} {'draft ms/tok':>12} identical  "
          "acceptance per position")
    for name, total in totals.items():
        stats = total["stats"]
        per_position = " ".join(f"{rate:.2f}" for rate in stats.acceptance_rate_per_position)
        draft_ms = 1000 * stats.draft_time / stats.num_draft_tokens if stats.num_draft_tokens else 0.0
        length = f"{stats.mean_acceptance_length:.2f}" if stats.num_drafts else "-"
        print(f"{name:28} {total['tokens'] / total['seconds']:7.1f} {plain_seconds / total['seconds']:7.2f}x "
              f"{length:>12} {draft_ms:12.2f} {total['identical']:>4}/{len(prompts)}  {per_position}")


if __name__ == "__main__":
    main()
