"""A self-refinement loop through one drafter: each call rewrites the last call's answer.

Round 0 answers a Spec-Bench question; round r asks the target to rewrite round r - 1's answer, so each call's
prompt holds the text its output will largely repeat, and a suffix drafter's memory holds the earlier rounds'
outputs. Per round, plain greedy `generate()`, prompt lookup and suffix decoding run side by side on the same prompt
(alternating, one thread), each drafter kept across the whole loop. Prints, per round, each method's speedup over
plain (total tokens over total seconds) and suffix decoding's tokens/s over its own round-0 tokens/s, and checks
that every output equals plain greedy's.

    python examples/self_refinement.py [--prompts spec-bench] [--limit 10]
        [--rounds 3] [--max-new-tokens 128] [--num-draft-tokens 8]
"""

import argparse
import time

import torch

import hf_speculators as hs
from hf_speculators.loading import DEMO_TARGET, load_model, load_tokenizer
from hf_speculators.prompts import encode_prompt, load_prompts, use_chat_template

REWRITE = "Rewrite the following answer so that it is clearer, keeping its content:\n\n{answer}"


def timed(target, inputs, max_new_tokens: int, **options) -> tuple[torch.LongTensor, float]:
    """The new tokens `(num_new,)` of one greedy call and its seconds."""
    start = time.perf_counter()
    out = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **options)
    return out[0, inputs["input_ids"].shape[1]:], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="spec-bench")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(DEMO_TARGET)
    target = hs.enable(load_model(DEMO_TARGET, "float32", "cpu"))
    chat = use_chat_template(tokenizer, None, None)
    drafters = {"prompt-lookup": hs.PromptLookupDrafter(num_draft_tokens=args.num_draft_tokens, max_ngram_size=3),
                "suffix": hs.SuffixDrafter(num_draft_tokens=args.num_draft_tokens)}
    totals = [{name: [0, 0.0] for name in ("plain", *drafters)} for _ in range(args.rounds)]  # [tokens, seconds]
    identical = True
    warm_up = encode_prompt(tokenizer, "Hello.", chat, None)
    for options in ({}, *({"candidate_generator": drafter} for drafter in drafters.values())):
        timed(target, warm_up, 4, pad_token_id=tokenizer.eos_token_id, **options)
    for prompt in load_prompts(args.prompts, args.limit):
        text = prompt.text
        for round_totals in totals:
            inputs = encode_prompt(tokenizer, text, chat, None)
            plain, seconds = timed(target, inputs, args.max_new_tokens, pad_token_id=tokenizer.eos_token_id)
            round_totals["plain"][0] += len(plain)
            round_totals["plain"][1] += seconds
            for name, drafter in drafters.items():
                ids, seconds = timed(target, inputs, args.max_new_tokens, candidate_generator=drafter,
                                     pad_token_id=tokenizer.eos_token_id)
                identical &= torch.equal(ids, plain)
                round_totals[name][0] += len(ids)
                round_totals[name][1] += seconds
            text = REWRITE.format(answer=tokenizer.decode(plain, skip_special_tokens=True))
    first_suffix = totals[0]["suffix"][0] / totals[0]["suffix"][1]
    print("round  " + "  ".join(f"{name:>14}" for name in drafters) + "  suffix / its round 0")
    for number, round_totals in enumerate(totals):
        rate = {name: tokens / seconds for name, (tokens, seconds) in round_totals.items()}
        cells = "  ".join(f"{rate[name] / rate['plain']:13.2f}x" for name in drafters)
        print(f"{number:5d}  {cells}  {rate['suffix'] / first_suffix:19.2f}x")
    print(f"every output identical to plain greedy: {'yes' if identical else 'NO'}")


if __name__ == "__main__":
    main()
