"""The default job under sampling with this package's sampler and logits processing against the earlier ones
(`torch.multinomial`, one processor call per position), patched in, interleaved in one process.

Each prompt runs with the earlier functions, with the current ones and plain sampled `generate()`, in alternating
order, `--rounds` times; prints tokens per second (wall time) of each and their ratios. The demo-hybrid preset
without memory across calls (`max_cached_requests=0`), temperature 0.7, one thread.

    python examples/sampling_step_costs.py --limit 13 --rounds 2
"""

import argparse
import dataclasses
import time

import torch

import hf_speculators as hs
import hf_speculators.drafters.base as drafter_base
import hf_speculators.loop as loop
import hf_speculators.verifiers.rejection as rejection
from hf_speculators.loading import load_model, load_tokenizer, resolve_model_id
from hf_speculators.prompts import load_prompts

PATCHED = ((loop, "process_logits"), (drafter_base, "process_logits"), (drafter_base, "sample"), (rejection, "sample"))


def per_position_processing(logits_processor, prefixes, logits):
    """The earlier `process_logits`: one processor call per row."""
    scores = logits.float()
    if not logits_processor:
        return scores
    return torch.cat([logits_processor(prefix, scores[i : i + 1].clone()) for i, prefix in enumerate(prefixes)])


def multinomial_sample(probs, generator):
    """The earlier `sample`."""
    return torch.multinomial(probs, 1, generator=generator)[0]


EARLIER = (per_position_processing, per_position_processing, multinomial_sample, multinomial_sample)
CURRENT = tuple(getattr(module, name) for module, name in PATCHED)


def timed_run(target, config, input_ids, functions, seed: int) -> tuple[float, int]:
    """Seconds and new tokens of one sampled call: plain `generate()` when `functions` is `None`."""
    start = time.perf_counter()
    if functions is None:
        torch.manual_seed(seed)
        output = target.generate(input_ids, do_sample=True, temperature=0.7, top_k=0, max_new_tokens=96, pad_token_id=0)
    else:
        for (module, name), function in zip(PATCHED, functions):
            setattr(module, name, function)
        output = target.generate(input_ids, custom_generate=hs.generate, speculative_config=config, do_sample=True,
                                 temperature=0.7, top_k=0, max_new_tokens=96, pad_token_id=0,
                                 generator=torch.Generator().manual_seed(seed))
    return time.perf_counter() - start, output.shape[1] - input_ids.shape[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=13, help="Spec-Bench prompts, round-robin over the categories")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_model(resolve_model_id("hf_speculators/demo-target"))
    tokenizer = load_tokenizer(resolve_model_id("hf_speculators/demo-target"))
    config = dataclasses.replace(hs.SpeculativeConfig.from_pretrained("demo-hybrid"), max_cached_requests=0)
    prompts = [tokenizer(prompt.text, return_tensors="pt").input_ids
               for prompt in load_prompts("spec-bench", args.limit)]
    runs = {"earlier": EARLIER, "current": CURRENT, "plain": None}
    for name, functions in runs.items():  # warm-up
        timed_run(target, config, prompts[0], functions, 0)
    totals = {name: [0.0, 0] for name in runs}
    for round_index in range(args.rounds):
        for i, input_ids in enumerate(prompts):
            order = ["earlier", "current", "plain"] if (i + round_index) % 2 else ["current", "earlier", "plain"]
            for name in order:
                seconds, tokens = timed_run(target, config, input_ids, runs[name], 100 * round_index + i)
                totals[name][0] += seconds
                totals[name][1] += tokens
    rates = {name: tokens / seconds for name, (seconds, tokens) in totals.items()}
    print(", ".join(f"{name} {rate:.1f} tokens/s" for name, rate in rates.items()))
    print(f"current / earlier {rates['current'] / rates['earlier']:.3f}, current / plain "
          f"{rates['current'] / rates['plain']:.3f}, earlier / plain {rates['earlier'] / rates['plain']:.3f}")


if __name__ == "__main__":
    main()
