"""The `hf-speculators` command: `generate` streams speculative output and compares it with plain generate,
`bench` compares methods on a prompt set, `sweep` measures the fidelity/acceptance trade-off of the relaxed
verifiers, `plot` draws a saved bench run, `presets` lists the bundled presets and `export` prints the vLLM
command of one."""

import argparse
import sys

import torch
from transformers import TextStreamer

from .benchmark import DEFAULT_METHODS as DEFAULT_BENCH_METHODS
from .benchmark import DRAFT_MODEL_METHODS
from .benchmark import METHODS as BENCH_METHODS
from .benchmark import load_prompts, run_benchmark
from .chat import encode_prompt, use_chat_template
from .config import SpeculativeConfig, method_fields
from .decoding import enable
from .drafters import DRAFTERS
from .drafters.prompt_lookup import MATCH_RULES
from .loading import AUTO, DEMO_DRAFT, DEMO_TARGET, DTYPES, load_model, load_tokenizer, resolve_device, resolve_dtype
from .metrics import clock
from .methods import METHODS, make_drafter
from .plotting import plot_benchmark, pyplot, read_records
from .presets import bundled_card, bundled_presets, card_results
from .quantization import QUANTIZATIONS
from .quiet import quiet_third_party
from .schedules import SCHEDULES
from .training.cli import add_training_commands
from .sweep import (
    DEFAULT_TOP_K_SETTINGS,
    DEFAULT_TYPICAL_EPSILONS,
    default_verifiers,
    plot_sweep,
    run_sweep,
    sweep_table,
)
from .verifiers import VERIFIERS
from .vllm_export import vllm_commands
from .vocab import ranked_draft_vocab

DEFAULT_PRESET = "demo-prompt-lookup"  # the fastest lossless demo preset (README, "The default job")
DEMO_EAGLE3, DEMO_MEDUSA = "hf_speculators/demo-eagle3", "hf_speculators/demo-medusa"
DEFAULT_GENERATE_SCHEDULE = "goodput"  # `generate`'s draft-length schedule when neither the flag nor the preset sets one


def _add_model_options(parser: argparse.ArgumentParser, threads: int | None, from_preset: bool) -> None:
    """Options shared by the commands. With `from_preset`, unset --model and --draft keep the preset's values."""
    model_help, draft_help = ("the preset's", "the preset's") if from_preset else ("the demo target", "the demo draft")
    parser.add_argument("--model", default=None if from_preset else DEMO_TARGET,
                        help=f"target: local folder or Hub id (default: {model_help})")
    parser.add_argument("--draft", default=None if from_preset else DEMO_DRAFT,
                        help=f"draft model: local folder or Hub id (default: {draft_help})")
    parser.add_argument("--num-draft-tokens", type=int, default=None,
                        help="draft tokens per step (k); for tree methods the depth")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=AUTO,
                        help="auto (default): the checkpoint's dtype on a GPU, float32 on a CPU")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="load the target quantized: int8 and int4 (torchao), nf4 (bitsandbytes), fp8 (torchao, "
                             "CUDA GPUs of compute capability >= 8.9); needs the quantization extra")
    parser.add_argument("--draft-quantization", choices=QUANTIZATIONS, default=None,
                        help="load the draft model quantized (same modes as --quantization)")
    parser.add_argument("--device", default=AUTO, help="auto (default): CUDA, then MPS, then the CPU")
    parser.add_argument("--threads", type=int, default=threads,
                        help=f"torch CPU threads (default: {threads or 'torch chooses'})")
    _add_chat_options(parser)
    parser.add_argument("--verbose", action="store_true",
                        help="let third-party logs, warnings and loading bars through (hidden by default)")


def _add_chat_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                        help="wrap the prompt in the tokenizer's chat template with a generation prompt (default: "
                             "when the tokenizer has one, as instruct models do)")
    parser.add_argument("--system", default=None, metavar="TEXT", help="a system turn before the prompt (--chat)")


def _add_schedule_option(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--num-draft-tokens-schedule", choices=sorted(SCHEDULES), default=None,
                        help="each step's draft length: constant (--num-draft-tokens every step), heuristic "
                             "(transformers' +2/-1 rule) or goodput (0 to --num-draft-tokens, the most tokens per "
                             f"second measured during the call) (default: {default})")


def _add_prompt_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", required=True, help="JSONL (Spec-Bench/MT-bench turns, HumanEval prompt) or text")
    parser.add_argument("--limit", type=int, default=None, help="prompts to run, spread over the categories")


def _add_tree_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-candidates", type=int, default=None,
                        help="prompt-lookup-tree: continuations merged into the trie (default 4)")
    parser.add_argument("--tree-top-k", type=int, default=None,
                        help="draft-model-tree: nodes expanded per depth and children per node (default 4)")
    parser.add_argument("--tree-nodes", type=int, default=None, help="draft-model-tree: node budget (default 24)")


def _add_draft_vocab_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft-vocab", default=None, metavar="RANKING",
                        help="layer-skip: draft from a token ranking (JSON ids, most frequent first; FR-Spec)")
    parser.add_argument("--draft-vocab-size", type=int, default=None,
                        help="layer-skip: how many of the ranking's first ids draft (default: all)")


def _typical_settings(text: str) -> list[float | tuple[float, float]]:
    try:
        return [tuple(map(float, item.split(":"))) if ":" in item else float(item)
                for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated EPSILON or EPSILON:DELTA, got {text!r}") from None


def _top_k_settings(text: str) -> list[tuple[int, float]]:
    try:
        return [(int(k), float(tolerance)) for k, tolerance in (item.split(":") for item in text.split(",") if item)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated TOP_K:TOLERANCE pairs, got {text!r}") from None


def _variant_list(text: str) -> list[tuple[int, str]]:
    """`"1,2,goodput:6"` -> `[(1, "constant"), (2, "constant"), (6, "goodput")]`."""
    try:
        return [(int(item), "constant") if ":" not in item else (int(item.split(":")[1]), item.split(":")[0])
                for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated K or SCHEDULE:K items, got {text!r}") from None


def _add_generate(commands) -> None:
    gen = commands.add_parser("generate", help="stream speculative output and compare it with plain generate()")
    gen.add_argument("prompt")
    gen.add_argument("--preset", default=DEFAULT_PRESET,
                     help=f"bundled preset name, model card, folder or Hub id (default: {DEFAULT_PRESET}); "
                          "the flags below override its settings")
    _add_model_options(gen, threads=None, from_preset=True)
    _add_schedule_option(gen, f"the preset's, else {DEFAULT_GENERATE_SCHEDULE}")
    gen.add_argument("--method", choices=sorted(DRAFTERS), default=None, help="default: the preset's")
    gen.add_argument("--exit-layer", type=int, default=None, help="layer-skip: the layers that draft")
    gen.add_argument("--confidence-threshold", type=float, default=None,
                     help="layer-skip: stop drafting after a token less likely than this")
    _add_draft_vocab_options(gen)
    gen.add_argument("--max-ngram-size", type=int, default=None, help="prompt lookup's longest n-gram")
    gen.add_argument("--min-ngram-size", type=int, default=None, help="prompt lookup's shortest n-gram")
    gen.add_argument("--verification", "--verifier", choices=sorted(VERIFIERS), default=None,
                     help="default: the preset's, else exact for greedy decoding and rejection when sampling")
    gen.add_argument("--do-sample", action="store_true")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 disables top-k filtering")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(run=run_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-speculators", description="Speculative decoding for transformers.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands)

    bench = commands.add_parser("bench", help="compare plain, transformers' and our speculative methods")
    _add_prompt_options(bench)
    _add_model_options(bench, threads=1, from_preset=False)
    _add_schedule_option(bench, "constant")
    bench.add_argument("--variants", type=_variant_list, default=None, metavar="K,...,SCHEDULE:K",
                       help="run each of our methods once per item, side by side: K draft tokens every step, or "
                            "SCHEDULE with bound K (e.g. 1,2,3,4,5,6,goodput:6)")
    bench.add_argument("--methods", default=",".join(DEFAULT_BENCH_METHODS),
                       help=f"comma-separated: {','.join(BENCH_METHODS)} (default: those without an exit layer)")
    bench.add_argument("--max-ngram-size", type=int, default=2, help="for both prompt lookups (transformers' default)")
    bench.add_argument("--exit-layer", type=int, default=None, help="hf-early-exit and layer-skip: the layers that draft")
    bench.add_argument("--confidence-threshold", type=float, default=None,
                       help="hf-early-exit and layer-skip: stop drafting after a token less likely than this")
    _add_draft_vocab_options(bench)
    _add_tree_options(bench)
    bench.add_argument("--verification", "--verifier", choices=sorted(VERIFIERS), default=None,
                       help=f"verifier of our methods ({', '.join(METHODS)}); default: exact")
    bench.add_argument("--eagle-head", default=DEMO_EAGLE3,
                       help="eagle3 and eagle3-tree: the EAGLE draft head checkpoint (default: the demo target's)")
    bench.add_argument("--medusa-head", default=DEMO_MEDUSA,
                       help="medusa and medusa-tree: the Medusa heads checkpoint (default: the demo target's)")
    bench.add_argument("--prefer", choices=MATCH_RULES, default=None,
                       help="our prompt lookups' match rule among earlier occurrences (default: latest)")
    bench.add_argument("--batch-size", type=int, default=1, metavar="B",
                       help="prompts per generate call, grouped in order and left padded; each method runs per batch "
                            "against plain batched generate(), methods that cannot batch are skipped (default: 1)")
    bench.add_argument("--out", default="bench_results/bench.jsonl", help="JSONL records, one per (prompt, method)")
    bench.add_argument("--plot", default=None, metavar="FILE.png",
                       help="also draw speedup and mean acceptance length per method and category (matplotlib)")
    bench.set_defaults(run=run_bench)

    sweep = commands.add_parser("sweep", help="fidelity/acceptance trade-off of the relaxed verifiers (greedy)")
    _add_prompt_options(sweep)
    _add_model_options(sweep, threads=1, from_preset=False)
    sweep.add_argument("--method", choices=METHODS, default="draft-model-tree")
    sweep.add_argument("--exit-layer", type=int, default=None, help="layer-skip: the layers that draft")
    _add_tree_options(sweep)
    sweep.add_argument("--typical-settings", "--typical-epsilons", type=_typical_settings,
                       default=list(DEFAULT_TYPICAL_EPSILONS),
                       help="typical settings: EPSILON (delta = sqrt(epsilon)) or EPSILON:DELTA (comma-separated)")
    sweep.add_argument("--top-k-settings", type=_top_k_settings, default=list(DEFAULT_TOP_K_SETTINGS),
                       help="top_k settings: TOP_K:TOLERANCE pairs, tolerance in nats (comma-separated)")
    sweep.add_argument("--out", default="bench_results/sweep.jsonl", help="JSONL records, one per (prompt, setting)")
    sweep.add_argument("--plot", default="bench_results/sweep.png", help="where to save the figure (matplotlib)")
    sweep.add_argument("--no-plot", action="store_true", help="print the table only")
    sweep.set_defaults(run=run_sweep_command)

    _add_plot(commands)
    _add_presets(commands)
    _add_export(commands)
    add_training_commands(commands)
    return parser


def _add_plot(commands) -> None:
    plot = commands.add_parser("plot", help="draw a saved bench run (its JSONL records)")
    plot.add_argument("records", help="the JSONL file of hf-speculators bench --out")
    plot.add_argument("--out", default="bench_results/bench.png", help="the image file (PNG, SVG or PDF)")
    plot.set_defaults(run=run_plot)


def _add_presets(commands) -> None:
    presets = commands.add_parser("presets", help="list the bundled presets (model cards) and their measured speed")
    presets.set_defaults(run=run_presets)
    show = presets.add_subparsers(dest="presets_command").add_parser("show", help="print a preset's whole card")
    show.add_argument("name", help="a bundled preset (hf-speculators presets lists them)")
    show.set_defaults(run=run_presets_show)


def _add_export(commands) -> None:
    export = commands.add_parser("export", help="print the command and code that run a preset in another engine")
    export.add_argument("name", help="bundled preset name, model card, folder or Hub id")
    export.add_argument("--to", choices=("vllm",), required=True, help="the engine: vllm")
    export.add_argument("--out", default=None, help="Medusa heads: where to write them in vLLM's layout")
    export.set_defaults(run=run_export)


def _drafter(args, target, draft_model=None, draft_tokenizer=None):
    """The drafter of `args.method` for `target` with the command's drafter options."""
    return make_drafter(args.method, draft_model, num_draft_tokens=args.num_draft_tokens,
                        num_candidates=args.num_candidates, tree_top_k=args.tree_top_k, tree_nodes=args.tree_nodes,
                        draft_tokenizer=draft_tokenizer, target=target, exit_layer=args.exit_layer)


def config_from_args(args) -> SpeculativeConfig:
    """The preset's config with every flag that was given applied over it (`SpeculativeConfig.override`); `--draft`
    without `--method` over a preset whose method takes no draft model switches to `draft-model`."""
    flags = {
        "method": args.method, "num_draft_tokens": args.num_draft_tokens, "max_ngram_size": args.max_ngram_size,
        "min_ngram_size": args.min_ngram_size, "draft_model": args.draft, "verification": args.verification,
        "target_model": args.model, "draft_quantization": args.draft_quantization, "exit_layer": args.exit_layer,
        "confidence_threshold": args.confidence_threshold, "draft_vocab": args.draft_vocab,
        "draft_vocab_size": args.draft_vocab_size, "num_draft_tokens_schedule": args.num_draft_tokens_schedule,
    }
    config = SpeculativeConfig.from_pretrained(args.preset)
    if args.draft is not None and args.method is None and "draft_model" not in method_fields(config.method):
        flags["method"] = "draft-model"  # --draft alone over a preset without a draft model (the default's)
    return config.override(**{name: value for name, value in flags.items() if value is not None})


def _timed_generate(model, inputs, **kwargs) -> tuple[torch.Tensor | object, float]:
    start = clock(model.device)
    output = model.generate(**inputs, **kwargs)
    return output, clock(model.device) - start


def _placement(args) -> None:
    """Resolves `--device auto` and `--dtype auto` in place (see `resolve_device` and `resolve_dtype`)."""
    args.device = resolve_device(args.device)
    args.dtype = resolve_dtype(args.dtype, args.device)


def _print_placement(model) -> None:
    print(f"device: {model.device}, dtype: {str(model.dtype).removeprefix('torch.')}")


def run_generate(args) -> int:
    config = config_from_args(args)
    target_name = config.target_model or DEMO_TARGET
    tokenizer = load_tokenizer(target_name)
    chat = use_chat_template(tokenizer, args.chat, args.system)
    target = enable(load_model(target_name, args.dtype, args.device, quantization=args.quantization))
    _print_placement(target)
    drafter, verifier = config.build(target, tokenizer)
    inputs = encode_prompt(tokenizer, args.prompt, chat, args.system).to(target.device)
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    sampling = sampling if args.do_sample else dict(do_sample=False)
    common = dict(max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.eos_token_id, **sampling)
    speculative = dict(candidate_generator=drafter, verifier=verifier, tokenizer=tokenizer,
                       num_draft_tokens_schedule=config.num_draft_tokens_schedule or DEFAULT_GENERATE_SCHEDULE,
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


def _load_models(args, needs_draft: bool):
    """`(target, draft)` as the command's model options say; `draft` is `None` unless `needs_draft`."""
    if args.draft_quantization is not None and not needs_draft:
        raise ValueError("--draft-quantization quantizes the draft model, and no method chosen uses one.")
    target = load_model(args.model, args.dtype, args.device, quantization=args.quantization)
    _print_placement(target)
    if not needs_draft:
        return target, None
    return target, load_model(args.draft, args.dtype, args.device, quantization=args.draft_quantization)


def run_bench(args) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    needs_draft = any(m in DRAFT_MODEL_METHODS for m in methods)
    prompts = load_prompts(args.prompts, args.limit)
    tokenizer = load_tokenizer(args.model)
    if args.draft_vocab_size is not None and args.draft_vocab is None:
        raise ValueError("--draft-vocab-size takes the first ids of a token ranking: pass --draft-vocab as well.")
    draft_vocab = None if args.draft_vocab is None else ranked_draft_vocab(args.draft_vocab, args.draft_vocab_size)
    chat = use_chat_template(tokenizer, args.chat, args.system)
    if args.plot is not None:
        pyplot()  # fail before the run, not after it, when matplotlib is missing
    target, draft = _load_models(args, needs_draft)
    result = run_benchmark(
        target, draft, tokenizer, prompts, methods, args.max_new_tokens, args.num_draft_tokens or 5, args.out,
        max_ngram_size=args.max_ngram_size, num_threads=args.threads, verifier=args.verification, prefer=args.prefer,
        num_candidates=args.num_candidates, tree_top_k=args.tree_top_k, tree_nodes=args.tree_nodes,
        exit_layer=args.exit_layer, confidence_threshold=args.confidence_threshold,
        draft_vocab=draft_vocab, chat_template=chat, system_prompt=args.system, eagle_head=args.eagle_head,
        medusa_head=args.medusa_head, num_draft_tokens_schedule=args.num_draft_tokens_schedule,
        variants=args.variants, batch_size=args.batch_size,
    )
    print(f"records: {args.out}")
    if args.plot is not None:
        plot_benchmark(result.records, args.plot)
        print(f"plot: {args.plot}")
    return 0 if result.ok else 1


def run_sweep_command(args) -> int:
    if not args.no_plot:
        pyplot()  # fail before the sweep, not after it, when matplotlib is missing
    verifiers = default_verifiers(args.typical_settings, args.top_k_settings)
    prompts = load_prompts(args.prompts, args.limit)
    tokenizer = load_tokenizer(args.model)
    chat = use_chat_template(tokenizer, args.chat, args.system)
    target, draft = _load_models(args, args.method in DRAFT_MODEL_METHODS)
    drafter = _drafter(args, target, draft, load_tokenizer(args.draft) if draft is not None else None)
    points = run_sweep(target, tokenizer, prompts, drafter, verifiers, args.max_new_tokens, args.out,
                       num_threads=args.threads, chat_template=chat, system_prompt=args.system)
    print(sweep_table(points))
    print(f"records: {args.out}")
    if not args.no_plot:
        plot_sweep(points, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _speedup(results: dict | None) -> str:
    """The measured speedup of a card's results block, naming its baseline unless it is plain greedy decoding."""
    if not results:
        return "-"
    baseline = results.get("baseline")
    return f"{results['speedup']:.2f}x" + (f" vs {baseline}" if baseline else "")


def run_presets(args) -> int:
    rows = [("name", "method", "target", "speedup", "measured on")]
    for name, folder in bundled_presets().items():
        config = SpeculativeConfig.from_pretrained(str(folder))
        results = card_results(folder / "README.md")
        rows.append((name, config.method, config.target_model or "-", _speedup(results),
                     results["hardware"] if results else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    print("\nspeedup: tokens/s over plain greedy decoding unless another baseline is named (the relaxed presets: "
          "over exact verification with the same draft); hf-speculators presets show NAME prints a card with its "
          "settings, sources and the command that measured it")
    return 0


def run_presets_show(args) -> int:
    print(bundled_card(args.name).read_text(encoding="utf-8"), end="")
    return 0


def run_export(args) -> int:
    print(vllm_commands(SpeculativeConfig.from_pretrained(args.name), args.out))
    return 0


def run_plot(args) -> int:
    plot_benchmark(read_records(args.records), args.out)
    print(f"plot: {args.out}")
    return 0


def _report(out, seconds: float, plain: torch.Tensor, plain_seconds: float, prompt_length: int, sampled: bool) -> None:
    stats = out.speculative_stats
    new_tokens = out.sequences.shape[1] - prompt_length
    plain_tokens = plain.shape[1] - prompt_length
    speed, plain_speed = new_tokens / seconds, plain_tokens / plain_seconds
    if sampled:
        identical = "n/a (sampling: " + ("lossless in distribution, not token for token)" if stats.lossless else
                                         "relaxed verification, not the target's distribution)")
    elif torch.equal(out.sequences, plain):
        identical = "yes"
    else:
        relaxed = "no (relaxed verification keeps tokens that are not the target's argmax)"
        identical = "NO" if stats.lossless else relaxed
    print(f"\n---\ndrafter: {stats.drafter}; verifier: {stats.verifier} ({'lossless' if stats.lossless else 'relaxed'})")
    print(f"speculative: {new_tokens} tokens in {seconds:.2f} s = {speed:.1f} tokens/s")
    print(f"plain generate(): {plain_tokens} tokens in {plain_seconds:.2f} s = {plain_speed:.1f} tokens/s")
    print(f"speedup: {speed / plain_speed:.2f}x")
    print(f"mean acceptance length: {stats.mean_acceptance_length:.2f} tokens per draft "
          f"(acceptance rate {stats.acceptance_rate:.2f}, {stats.num_target_forwards} target forwards)")
    print(f"identical to plain greedy: {identical}")
    lengths = ", ".join(f"{k}: {n}" for k, n in enumerate(stats.draft_lengths) if n)
    print(f"draft lengths (tokens asked: steps): {lengths}; {stats.num_steps_without_draft} steps without a draft")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "threads", None) is not None:  # `presets` has no --threads
        torch.set_num_threads(args.threads)
    try:
        if hasattr(args, "device"):  # the commands that load models
            _placement(args)
        with quiet_third_party(getattr(args, "verbose", False)):
            return args.run(args)
    except (ValueError, FileNotFoundError, OSError, ImportError) as error:
        print(f"hf-speculators {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
