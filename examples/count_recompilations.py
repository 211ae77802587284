"""Counts the graphs dynamo compiles for the speculative loop's decoding steps over a run of Spec-Bench prompts.

The demo target and a preset run greedy with a static cache and transformers' compile switch, compiled with dynamo's
`"eager"` backend (graphs captured and guarded as under inductor, no code generated: the count is inductor's, at a
fraction of its time). Each call's prompt length, the goodput schedule's draft lengths and the rows' rejections
change from call to call. The warm-up runs the first batch of each shape the run meets (a cache length bucket,
`hf_speculators.static_cache.length_bucket`, and a number of rows: each is a new shape, as the bench warms up every
batch's shape) twice: the second time a hybrid's suffix decoding drafts from the first call's output, so its longer
verify width compiles as well. After the warm-up no new graph should appear. Prints the graph count after the
warm-up and after every call, and the graphs of each draft frame against dynamo's limit per frame (past it, dynamo
runs the frame eagerly).

    python examples/count_recompilations.py [--limit 30] [--max-new-tokens 64] [--preset demo-hybrid] \\
        [--schedule goodput] [--batch-size 1]
"""

import argparse

import torch
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters
from transformers import CompileConfig

import hf_speculators as hs
from hf_speculators import compiled
from hf_speculators.loading import DEMO_TARGET, load_model, load_tokenizer
from hf_speculators.prompts import encode_truncated, load_prompts
from hf_speculators.static_cache import length_bucket
from hf_speculators.tools.bench.batches import make_batches, pad_token


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=30)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--preset", default="demo-hybrid")
    parser.add_argument("--schedule", default="goodput")
    parser.add_argument("--batch-size", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = hs.enable(load_model(DEMO_TARGET, "float32", "cpu")), load_tokenizer(DEMO_TARGET)
    config = hs.SpeculativeConfig.from_pretrained(args.preset)
    compile_config = CompileConfig(backend="eager", mode=None)
    compile_config._compile_all_devices = True
    encoded = [encode_truncated(tokenizer, p.text, False, 512, model.device)
               for p in load_prompts("spec-bench", limit=args.limit)]
    batches = make_batches(encoded, args.batch_size, pad_token(tokenizer))
    # the slots `decoding.generate` adds to a row's length
    extra = config.build(model, tokenizer)[0].num_draft_tokens + (32 if args.batch_size > 1 else 0)
    first_of_shape = {}  # (cache length bucket, rows): a batch of that shape (a last batch may hold fewer rows)
    for batch in batches:
        bucket = length_bucket(batch.input_ids.shape[1] + args.max_new_tokens + extra)
        first_of_shape.setdefault((bucket, batch.input_ids.shape[0]), batch)
    run = lambda batch: check(model, tokenizer, config, compile_config, batch, args)  # noqa: E731
    for batch in first_of_shape.values():
        run(batch)
        run(batch)
    warm = counters["stats"]["unique_graphs"]
    graphs = []
    for batch in batches:
        run(batch)
        graphs.append(counters["stats"]["unique_graphs"])
    print(f"{args.preset}, {args.schedule} schedule, {len(graphs)} calls of batch {args.batch_size}, "
          f"{args.max_new_tokens} new tokens; (cache length bucket, rows) {sorted(first_of_shape)}, warmed up on two "
          f"calls each: {warm} graphs; after each call {graphs}; new graphs after the warm-up: {graphs[-1] - warm}")
    frames = {name: len(_debug_get_cache_entry_list(getattr(compiled, name).__code__)) for name in (
        "run_draft_model", "run_draft_model_step", "run_draft_head", "run_draft_head_step")}
    print(f"graphs per draft frame (dynamo's limit: {torch._dynamo.config.recompile_limit} each): "
          + ", ".join(f"{name} {count}" for name, count in frames.items() if count))


def check(model, tokenizer, config, compile_config, batch, args) -> None:
    """One compiled speculative call on `batch`, checked against plain greedy decoding."""
    padding = {} if batch.attention_mask is None else {"attention_mask": batch.attention_mask,
                                                       "pad_token_id": batch.pad_token_id}
    out = model.generate(batch.input_ids, speculative_config=config, tokenizer=tokenizer, do_sample=False,
                         max_new_tokens=args.max_new_tokens, num_draft_tokens_schedule=args.schedule,
                         cache_implementation="static", compile_config=compile_config, **padding)
    plain = model.generate(batch.input_ids, do_sample=False, max_new_tokens=args.max_new_tokens, **padding)
    assert torch.equal(out, plain), "the compiled loop's output differs from plain greedy decoding"


if __name__ == "__main__":
    main()
