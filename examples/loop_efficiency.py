"""How close the speculative loop comes to the ideal speedup of a drafter that costs nothing, eager and compiled.

A scripted drafter proposes each row's own greedy continuation (from a plain run) with every draft position right
with probability `acceptance` (given the ones before it were), wrong otherwise, at no cost (list slicing). For the
tokens per step E it reached, the ideal speedup over plain decoding is

    ideal = E * plain_step / (plain_step - forward(1) + forward(k + 1))

plain's own step, its one-token forward replaced by the (k + 1)-token verify forward, both forwards timed here over a
static cache at the prompts' mean context (eager, or through the compiled call the loop uses). measured / ideal is
the loop's efficiency: what its per-step host work (drafts to a query, masks, verification, commits, cache length
resets) costs beyond plain decoding's. Plain, plain-compiled and every acceptance run back to back per repeat,
medians reported; the first call of each compiled configuration is timed apart (its compile time).

    python examples/loop_efficiency.py [--limit 4] [--max-new-tokens 64] [--num-draft-tokens 3] \\
        [--acceptance 0.6,0.8,0.9] [--batch-sizes 1,4] [--modes eager,compiled] [--repeats 3] [--device cuda]

On CUDA every timing ends with a synchronization.
"""

import argparse
import random
import statistics
import time

import torch

import hf_speculators as hs
from transformers import StaticCache

from hf_speculators.cache import DEFAULT_MAX_HOLES, RaggedCache, rollback
from hf_speculators.loading import DEMO_TARGET, load_model, load_tokenizer
from hf_speculators.metrics import clock
from hf_speculators.prompts import encode_truncated, load_prompts
from hf_speculators.query import Query, forward
from hf_speculators.static_cache import length_bucket
from hf_speculators.tools.bench.batches import make_batches, pad_token, row_new_ids
from hf_speculators.tools.bench.engines import compiled_kwargs


class ScriptedAcceptanceDrafter(hs.Drafter):
    """Proposes each row's reference continuation, each position right with probability `acceptance` given the
    earlier ones were (a wrong token ends what can be accepted), from a seeded `random.Random`."""

    name = "scripted-acceptance"

    def __init__(self, references: list[list[int]], num_draft_tokens: int, acceptance: float, vocab_size: int,
                 seed: int = 0):
        super().__init__(num_draft_tokens)
        self.references, self.acceptance, self.vocab_size = references, acceptance, vocab_size
        self.random = random.Random(seed)

    def draft_row(self, state, input_ids, max_tokens, row):
        future = self.references[row][input_ids.shape[1] : input_ids.shape[1] + max_tokens]
        tokens, right = [], True
        for token in future:
            right = right and self.random.random() < self.acceptance
            tokens.append(token if right else (token + 1) % self.vocab_size)
        return hs.Draft.chain(torch.tensor(tokens, dtype=torch.long, device=input_ids.device))


def forward_seconds(model, call, context: int, width: int, batch_size: int, slots: int, repeats: int = 20) -> float:
    """Median seconds of one forward of `width` tokens per row after `context` cached tokens, over a static cache
    of `length_bucket(slots)` slots (the loop's, so a compiled call meets its graph), run as the loop runs it
    (`query.forward` through `call`). With a compiled `call`, dynamo's cache is emptied first: the new cache's
    tensors are new static inputs, and on CUDA the graphs the generate calls compiled for their own cache would
    otherwise be recompiled per timing until dynamo's `recompile_limit` ran the forward eagerly (the second GPU
    check's compiled forward timings). Its warm-up forwards compile."""
    if call is not None:
        torch._dynamo.reset()
    cache = StaticCache(config=model.config, max_cache_len=length_bucket(slots))
    ids = torch.randint(0, model.config.vocab_size, (batch_size, context + width), device=model.device)
    ragged = RaggedCache(cache, torch.ones(batch_size, 0, dtype=torch.bool))
    forward(model, ragged, Query.chain(ids[:, :context], torch.ones(batch_size, context, dtype=torch.bool)), 1)
    ragged.append(torch.ones(batch_size, context, dtype=torch.bool))
    query = Query.chain(ids[:, context:], torch.ones(batch_size, width, dtype=torch.bool))
    times = []
    for _ in range(repeats + 2):
        start = clock(model.device)
        forward(model, ragged, query, None, call)
        times.append(clock(model.device) - start)
        rollback(cache, width)
    return statistics.median(times[2:])


def run(model, batch, kwargs: dict, max_new_tokens: int):
    """One timed greedy generate call: (seconds, output)."""
    padding = {} if batch.attention_mask is None else {"attention_mask": batch.attention_mask,
                                                       "pad_token_id": batch.pad_token_id}
    start = clock(model.device)
    output = model.generate(batch.input_ids, max_new_tokens=max_new_tokens, do_sample=False,
                            return_dict_in_generate=True, **padding, **kwargs)
    return clock(model.device) - start, output


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--acceptance", default="0.6,0.8,0.9")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model(DEMO_TARGET, "float32", args.device), load_tokenizer(DEMO_TARGET)
    k, acceptances = args.num_draft_tokens, [float(a) for a in args.acceptance.split(",")]
    prompts = load_prompts("spec-bench", limit=args.limit)
    encoded = [encode_truncated(tokenizer, p.text, False, 512, model.device) for p in prompts]
    context = int(statistics.mean(ids.shape[1] for ids, _ in encoded)) + args.max_new_tokens // 2
    print(f"demo target, fp32, {args.device}, 1 thread, {len(prompts)} Spec-Bench prompts, {args.max_new_tokens} "
          f"new tokens, k={k}, {args.repeats} repeats (medians)")
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        batches = make_batches(encoded, batch_size, pad_token(tokenizer))
        for mode in args.modes.split(","):
            extra = compiled_kwargs(model) if mode == "compiled" else {}
            call = model.get_compiled_call(extra["compile_config"]) if extra else None
            references = []
            for batch in batches:  # each row's own greedy output: what the drafter proposes
                _, output = run(model, batch, {}, args.max_new_tokens)
                news = row_new_ids(output.sequences, batch.input_ids.shape[1], model.generation_config.eos_token_id)
                references.append([batch.input_ids[row][batch.input_ids.shape[1] - n:].tolist() + new.tolist()
                                   for row, (n, new) in enumerate(zip(batch.prompt_tokens, news))])
            methods = {"plain": lambda i: extra} | {
                f"p={p}": (lambda i, p=p: {"custom_generate": hs.generate, **extra, "candidate_generator":
                                           ScriptedAcceptanceDrafter(references[i], k, p, model.config.vocab_size)})
                for p in acceptances}
            first = {label: run(model, batches[0], make(0), args.max_new_tokens)[0] for label, make in methods.items()}
            seconds = {label: [] for label in methods}  # per repeat: every batch's seconds added up
            generated, steps = {label: 0 for label in methods}, {label: 0 for label in methods}
            for _ in range(args.repeats):
                totals = dict.fromkeys(methods, 0.0)
                for i, batch in enumerate(batches):
                    for label, make in methods.items():  # back to back, interleaved
                        elapsed, output = run(model, batch, make(i), args.max_new_tokens)
                        totals[label] += elapsed
                        stats = getattr(output, "speculative_stats", None)
                        if stats is not None:
                            generated[label] += stats.num_generated_tokens  # a batch's: every row's
                            steps[label] += stats.num_steps
                for label, total in totals.items():
                    seconds[label].append(total)
            new_tokens = sum(len(r) - n for refs, b in zip(references, batches)
                             for r, n in zip(refs, b.prompt_tokens))
            plain_total = statistics.median(seconds["plain"])
            plain_step = plain_total / (new_tokens / batch_size)  # a plain step gives every row a token
            slots = max(ids.shape[1] for ids, _ in encoded) + args.max_new_tokens + k + (
                DEFAULT_MAX_HOLES if batch_size > 1 else 0)
            f1 = forward_seconds(model, call, context, 1, batch_size, slots)
            fk = forward_seconds(model, call, context, k + 1, batch_size, slots)
            print(f"\nbatch {batch_size}, {mode}: plain {new_tokens / plain_total:.1f} tokens/s, plain step "
                  f"{plain_step * 1e3:.1f} ms, forward(1) {f1 * 1e3:.1f} ms, forward({k + 1}) {fk * 1e3:.1f} ms, "
                  f"first call (compile included) " + ", ".join(f"{l} {s:.1f} s" for l, s in first.items()))
            for p in acceptances:
                label = f"p={p}"
                e = generated[label] / steps[label]
                measured = plain_total / statistics.median(seconds[label])
                ideal = e * plain_step / (plain_step - f1 + fk)
                print(f"  {label}: tokens/step {e:.2f}, speedup {measured:.2f}x, ideal {ideal:.2f}x, "
                      f"efficiency {measured / ideal:.0%}")


if __name__ == "__main__":
    main()
