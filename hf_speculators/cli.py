"""The `hf-speculators` command: `generate` streams speculative output and compares it with plain generate."""

import argparse
import sys
import time

import torch
from transformers import TextStreamer

from .benchmark import METHODS as BENCH_METHODS
from .benchmark import load_prompts, run_benchmark
from .decoding import enable
from .drafters import DraftModelDrafter, PromptLookupDrafter
from .loading import DEMO_DRAFT, DEMO_TARGET, DTYPES, load_model, load_tokenizer
from .verifiers import VERIFIERS

METHODS = ("draft-model", "prompt-lookup")


def _add_model_options(parser: argparse.ArgumentParser, threads: int | None) -> None:
    parser.add_argument("--model", default=DEMO_TARGET, help="target: local folder or Hub id (default: demo target)")
    parser.add_argument("--draft", default=DEMO_DRAFT, help="draft model: local folder or Hub id (default: demo draft)")
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="draft tokens per step (k)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=threads,
                        help=f"torch CPU threads (default: {threads or 'torch chooses'})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-speculators", description="Speculative decoding for transformers.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="stream speculative output and compare it with plain generate()")
    gen.add_argument("prompt")
    _add_model_options(gen, threads=None)
    gen.add_argument("--method", choices=METHODS, default="draft-model")
    gen.add_argument("--verification", choices=sorted(VERIFIERS), default=None,
                     help="default: exact for greedy decoding, rejection when sampling")
    gen.add_argument("--do-sample", action="store_true")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 disables top-k filtering")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(run=run_generate)

    bench = commands.add_parser("bench", help="compare plain, transformers' and our speculative methods")
    bench.add_argument("--prompts", required=True, help="JSONL (Spec-Bench/MT-bench turns, HumanEval prompt) or text")
    _add_model_options(bench, threads=1)
    bench.add_argument("--limit", type=int, default=None, help="prompts to run, spread over the categories")
    bench.add_argument("--methods", default=",".join(BENCH_METHODS), help=f"comma-separated: {','.join(BENCH_METHODS)}")
    bench.add_argument("--max-ngram-size", type=int, default=2, help="for both prompt lookups (transformers' default)")
    bench.add_argument("--out", default="bench_results/bench.jsonl", help="JSONL records, one per (prompt, method)")
    bench.set_defaults(run=run_bench)
    return parser


def make_drafter(method: str, num_draft_tokens: int | None, draft_model=None, draft_tokenizer=None):
    """Builds the drafter for a CLI `--method`, with the drafter's own default k when `num_draft_tokens` is None."""
    k = {} if num_draft_tokens is None else {"num_draft_tokens": num_draft_tokens}
    if method == "prompt-lookup":
        return PromptLookupDrafter(**k)
    return DraftModelDrafter(draft_model, draft_tokenizer=draft_tokenizer, **k)


def _timed_generate(model, inputs, **kwargs) -> tuple[torch.Tensor | object, float]:
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    output = model.generate(**inputs, **kwargs)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return output, time.perf_counter() - start


def run_generate(args) -> int:
    tokenizer = load_tokenizer(args.model)
    target = enable(load_model(args.model, args.dtype, args.device))
    draft = load_model(args.draft, args.dtype, args.device) if args.method == "draft-model" else None
    draft_tokenizer = load_tokenizer(args.draft) if draft is not None else None
    drafter = make_drafter(args.method, args.num_draft_tokens, draft, draft_tokenizer)
    inputs = tokenizer(args.prompt, return_tensors="pt").to(args.device)
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    sampling = sampling if args.do_sample else dict(do_sample=False)
    common = dict(max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.eos_token_id, **sampling)
    speculative = dict(candidate_generator=drafter, verifier=args.verification, tokenizer=tokenizer,
                       return_dict_in_generate=True)
    for options in ({}, speculative):  # warm-up, untimed
        target.generate(**inputs, **{**common, "max_new_tokens": 4}, **options)

    torch.manual_seed(args.seed)
    streamer = TextStreamer(tokenizer, skip_prompt=True)
    out, seconds = _timed_generate(target, inputs, **common, **speculative, streamer=streamer)
    torch.manual_seed(args.seed)
    plain, plain_seconds = _timed_generate(target, inputs, **common)
    _report(out, seconds, plain, plain_seconds, inputs["input_ids"].shape[1], args.do_sample)
    return 0


def run_bench(args) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    needs_draft = any(m in ("hf-assisted", "draft-model") for m in methods)
    prompts = load_prompts(args.prompts, args.limit)
    tokenizer = load_tokenizer(args.model)
    target = load_model(args.model, args.dtype, args.device)
    draft = load_model(args.draft, args.dtype, args.device) if needs_draft else None
    result = run_benchmark(
        target, draft, tokenizer, prompts, methods, args.max_new_tokens, args.num_draft_tokens or 5, args.out,
        max_ngram_size=args.max_ngram_size, num_threads=args.threads,
    )
    print(f"records: {args.out}")
    return 0 if result.ok else 1


def _report(out, seconds: float, plain: torch.Tensor, plain_seconds: float, prompt_length: int, sampled: bool) -> None:
    stats = out.speculative_stats
    new_tokens = out.sequences.shape[1] - prompt_length
    plain_tokens = plain.shape[1] - prompt_length
    speed, plain_speed = new_tokens / seconds, plain_tokens / plain_seconds
    if sampled:
        identical = "n/a (sampling: lossless in distribution, not token for token)"
    else:
        identical = "yes" if torch.equal(out.sequences, plain) else "NO"
    print(f"\n---\ndrafter: {stats.drafter}; verifier: {stats.verifier} ({'lossless' if stats.lossless else 'relaxed'})")
    print(f"speculative: {new_tokens} tokens in {seconds:.2f} s = {speed:.1f} tokens/s")
    print(f"plain generate(): {plain_tokens} tokens in {plain_seconds:.2f} s = {plain_speed:.1f} tokens/s")
    print(f"speedup: {speed / plain_speed:.2f}x")
    print(f"mean acceptance length: {stats.mean_acceptance_length:.2f} tokens per draft "
          f"(acceptance rate {stats.acceptance_rate:.2f}, {stats.num_target_forwards} target forwards)")
    print(f"identical to plain greedy: {identical}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, OSError) as error:
        print(f"hf-speculators {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
