"""The default hybrid's model part: goodput against constant draft lengths, beside plain (and a slowed draft model).

`generate` with the `demo-hybrid` preset's drafter (suffix decoding with the demo draft model, k = 3) runs each
batch of prompts three ways, in turns (the order reversed every other batch): plain `generate()`, the hybrid as
it ships (`model_schedule="goodput"`: the model part drafts 1 to 3 tokens, as its measured acceptance and costs
say) and the hybrid with the model part at a constant 3 (`model_schedule="constant"`, as before). Each hybrid has
its own drafter, whose cross-call memory is cleared after the warm-up. It prints, per seed, each method's total
seconds and speedup over plain (wall time, one thread), and the model part's steps, drafted and accepted tokens and
the row-steps its floor held it back.

`--draft-sleep-ms MS` makes every draft-model forward sleep that long first: a draft model that costs more than its
accepted tokens bring, as a compiled one does on a GPU, where a step is mostly host work; `--suffix` adds suffix
decoding alone (the preset's suffix settings, its own memory), what the hybrid should fall back to there.

    python examples/held_out_prompts.py --out held_out.jsonl --per-kind 10
    python examples/hybrid_model_lengths.py --prompts held_out.jsonl [--batch-size 1] [--do-sample] [--seeds 1,2,3]
    python examples/hybrid_model_lengths.py --prompts held_out.jsonl --limit 15 --draft-sleep-ms 15 --suffix
"""

import argparse
import time

import torch

import hf_speculators as hs
from hf_speculators.config.build import build_drafter
from hf_speculators.prompts import load_prompts

from demo_runs import add_run_options, demo_target, generate_options

METHODS = ("plain", "goodput", "constant")
FIGURES = ("steps", "drafted_tokens", "accepted_tokens", "held_steps")  # the model part's, per hybrid


def hybrid(config, model, tokenizer, model_schedule: str) -> hs.HybridDrafter:
    """The preset's hybrid drafter with the model part's draft lengths chosen by `model_schedule`."""
    built = build_drafter(config, model, tokenizer)
    return hs.HybridDrafter(built.model_free, built.model_drafter, model_schedule=model_schedule)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_options(parser, limit=None)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seeds", default="1", help="comma-separated: one pass over the prompts per seed")
    parser.add_argument("--draft-sleep-ms", type=float, default=0.0, help="sleep before every draft-model forward")
    parser.add_argument("--suffix", action="store_true", help="also suffix decoding alone")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = demo_target(args)
    tokenizer.padding_side = "left"
    config = hs.SpeculativeConfig.from_pretrained("demo-hybrid")
    drafters = {name: hybrid(config, model, tokenizer, name) for name in METHODS[1:]}
    if args.draft_sleep_ms > 0:  # no hook in the timed path otherwise
        for drafter in drafters.values():
            sleep = lambda *_: time.sleep(args.draft_sleep_ms / 1e3)  # noqa: E731
            drafter.model_drafter.draft_model.register_forward_pre_hook(sleep)
    if args.suffix:
        drafters["suffix"] = build_drafter(config, model, tokenizer).model_free
    methods = (*METHODS, *drafters.keys() - set(METHODS))
    texts = [prompt.text for prompt in load_prompts(args.prompts, args.limit)]
    batches = [texts[i : i + args.batch_size] for i in range(0, len(texts), args.batch_size)]
    options = generate_options(args) | {"pad_token_id": tokenizer.pad_token_id}

    def run(name: str, batch: list[str], seed: int):
        inputs = tokenizer(batch, padding=True, return_tensors="pt").to(model.device)
        if name == "plain":
            torch.manual_seed(seed)
            return model.generate(**inputs, **options)
        return model.generate(**inputs, **options, candidate_generator=drafters[name], tokenizer=tokenizer,
                              generator=torch.Generator(model.device).manual_seed(seed), return_dict_in_generate=True)

    for name in methods:  # warm-up
        run(name, batches[0], 0)
    for drafter in drafters.values():
        drafter.clear_cache()
    for seed in (int(seed) for seed in args.seeds.split(",")):
        seconds, model_figures = dict.fromkeys(methods, 0.0), {name: [0] * len(FIGURES) for name in METHODS[1:]}
        for index, batch in enumerate(batches):
            for name in methods if index % 2 == 0 else methods[::-1]:
                start = time.perf_counter()
                out = run(name, batch, seed * 1000 + index)
                seconds[name] += time.perf_counter() - start
                if name in model_figures:
                    figures = out.speculative_stats.drafter_stats["model"]
                    model_figures[name] = [total + figures[key] for total, key in zip(model_figures[name], FIGURES)]
        print(f"seed {seed}: " + ", ".join(f"{name} {seconds[name]:.2f} s ({seconds['plain'] / seconds[name]:.3f}x)"
                                           for name in methods) + f"; model part ({', '.join(FIGURES)}): " +
              ", ".join(f"{name} {tuple(figures)}" for name, figures in model_figures.items()))


if __name__ == "__main__":
    main()
