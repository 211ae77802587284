"""The `hf-speculators` command: `generate` streams speculative output and compares it with plain generate,
`bench` compares methods on a prompt set, `sweep` measures the fidelity/acceptance trade-off of the relaxed
verifiers, `plot` draws a saved bench run, `presets` lists the bundled presets, `export` prints the vLLM
command of one and `env` the versions and device facts a bug report needs."""

import argparse
import sys
import traceback
from dataclasses import fields

import torch
from transformers import TextStreamer

from ..config import SpeculativeConfig, method_fields
from ..config.build import build_drafter
from ..config.methods import LOADED_DRAFT, METHODS, method_config
from ..config.presets import bundled_card, bundled_presets, card_results
from ..decoding import enable
from ..drafters.prompt_lookup import MATCH_RULES
from ..loading import AUTO, DEMO_DRAFT, DEMO_TARGET, DTYPES, load_model, load_tokenizer, resolve_device, resolve_dtype
from ..metrics import clock
from ..prompts import encode_prompt, load_prompts, use_chat_template
from ..quantization import QUANTIZATIONS
from ..schedules import SCHEDULES
from .bench import BenchSettings, named_methods, read_records, run_benchmark
from .bench import DEFAULT_METHODS as DEFAULT_BENCH_METHODS
from .bench import DRAFT_MODEL_METHODS
from .bench import METHODS as BENCH_METHODS
from .env import run_env
from .plots import plot_benchmark, pyplot
from .quiet import quiet_third_party
from .report import markdown_report
from ..training.cli import add_training_commands
from .sweep import (
    DEFAULT_TOP_K_SETTINGS,
    DEFAULT_TYPICAL_EPSILONS,
    default_verifiers,
    plot_sweep,
    run_sweep,
    sweep_table,
)
from ..config.vllm_export import vllm_commands
from ..verifiers import VERIFIERS

DEFAULT_PRESET = "demo-hybrid"  # the fastest lossless demo preset, greedy and sampling (docs/benchmarks/model_free.md)
DEMO_EAGLE3, DEMO_MEDUSA = "hf_speculators/demo-eagle3", "hf_speculators/demo-medusa"
DEFAULT_HEADS = {"eagle_head": DEMO_EAGLE3, "medusa_head": DEMO_MEDUSA}  # the head checkpoints of the demo target
DEFAULT_GENERATE_SCHEDULE = "goodput"  # `generate`'s draft-length schedule when neither the flag nor the preset sets one
INTERRUPTED = 130  # the exit status of a command stopped by Ctrl-C (128 + SIGINT), as shells report it
# what bad input raises (a bad value, a missing or unreadable file, a device or Hub repo out of reach, a missing
# extra): exit status 2; anything else raised during a run is a failure, exit status 1
BAD_INPUT = (ValueError, TypeError, OSError, ImportError)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr, naming the command and pointing to its help."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(kind, low=None, high=None, low_included=True, high_included=True):
    """An argparse type: a `kind` (int or float) within the bounds, else a one-line error that states them."""
    bounds = " and ".join(part for part in (
        None if low is None else f"{'>=' if low_included else '>'} {low}",
        None if high is None else f"{'<=' if high_included else '<'} {high}") if part)
    expected = f"{'an integer' if kind is int else 'a number'}{' ' + bounds if bounds else ''}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        too_low = low is not None and (value < low if low_included else value <= low)
        too_high = high is not None and (value > high if high_included else value >= high)
        if too_low or too_high or value != value:  # value != value: NaN
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse.__name__ = expected  # argparse names the type in its messages
    return parse


POSITIVE_INT = _number(int, low=1)
NON_NEGATIVE_INT = _number(int, low=0)
PROBABILITY = _number(float, low=0, high=1, low_included=False)
CONFIDENCE = _number(float, low=0, high=1, high_included=False)
POSITIVE_FLOAT = _number(float, low=0, low_included=False)
NON_NEGATIVE_FLOAT = _number(float, low=0)
UNIT_INTERVAL = _number(float, low=0, high=1)


def _add_model_options(parser: argparse.ArgumentParser, threads: int | None, from_preset: bool) -> None:
    """Options shared by the commands. With `from_preset`, unset --model and --draft keep the preset's values."""
    model_help, draft_help = ("the preset's", "the preset's") if from_preset else ("the demo target", "the demo draft")
    parser.add_argument("--model", default=None if from_preset else DEMO_TARGET,
                        help=f"target: local folder or Hub id (default: {model_help})")
    parser.add_argument("--draft", default=None if from_preset else DEMO_DRAFT,
                        help=f"draft model: local folder or Hub id (default: {draft_help})")
    parser.add_argument("--num-draft-tokens", type=POSITIVE_INT, default=None,
                        help="draft tokens per step (k); for tree methods the depth")
    parser.add_argument("--max-new-tokens", type=POSITIVE_INT, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=AUTO,
                        help="auto (default): the checkpoint's dtype on a GPU, float32 on a CPU")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="load the target quantized: int8 and int4 (torchao), nf4 (bitsandbytes), fp8 (torchao, "
                             "CUDA GPUs of compute capability >= 8.9); needs the quantization extra")
    parser.add_argument("--draft-quantization", choices=QUANTIZATIONS, default=None,
                        help="load the draft model quantized (same modes as --quantization)")
    parser.add_argument("--device", default=AUTO, help="auto (default): CUDA, then MPS, then the CPU")
    parser.add_argument("--threads", type=POSITIVE_INT, default=threads,
                        help=f"torch CPU threads (default: {threads or 'torch chooses'})")
    _add_chat_options(parser)
    _add_verbose_option(parser)


def _add_verbose_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true", help="let third-party logs, warnings and loading bars through (hidden by default), "
                                         "and show an error's traceback")


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


def _add_sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=POSITIVE_FLOAT, default=1.0)
    parser.add_argument("--top-p", type=PROBABILITY, default=1.0)
    parser.add_argument("--top-k", type=NON_NEGATIVE_INT, default=0, help="0 disables top-k filtering")
    parser.add_argument("--seed", type=NON_NEGATIVE_INT, default=0, help="torch.manual_seed before each generate call")


def _add_verifier_option(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--verifier", choices=sorted(VERIFIERS), default=None, help=f"default: {default}")
    parser.add_argument("--verification", choices=sorted(VERIFIERS), default=None, dest="verification_alias",
                        help=argparse.SUPPRESS)  # the former name, deprecated


def _verifier(args) -> str | None:
    """`--verifier`, or its deprecated spelling `--verification` (with a warning)."""
    if args.verification_alias is not None:
        if args.verifier not in (None, args.verification_alias):
            raise ValueError("--verifier and its deprecated spelling --verification disagree: pass --verifier only.")
        print(f"hf-speculators {args.command}: warning: --verification is deprecated, use --verifier.", file=sys.stderr)
    return args.verifier or args.verification_alias


def _add_head_options(parser: argparse.ArgumentParser, default_eagle: str | None, default_medusa: str | None) -> None:
    parser.add_argument("--eagle-head", default=default_eagle,
                        help="eagle3 and eagle3-tree: the EAGLE draft head checkpoint (default: the demo target's)")
    parser.add_argument("--medusa-head", default=default_medusa,
                        help="medusa and medusa-tree: the Medusa heads checkpoint (default: the demo target's)")
    parser.add_argument("--dflash-model", default=None,
                        help="dflash and dflash-tree: the DFlash block drafter's checkpoint, made for the target")


def _add_prompt_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", required=True, help="JSONL (Spec-Bench/MT-bench turns, HumanEval prompt) or text")
    parser.add_argument("--limit", type=POSITIVE_INT, default=None, help="prompts to run, spread over the categories")


def _add_tree_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-candidates", type=POSITIVE_INT, default=None,
                        help="prompt-lookup-tree: continuations merged into the trie (default 4)")
    parser.add_argument("--tree-top-k", type=POSITIVE_INT, default=None,
                        help="draft-model-tree: nodes expanded per depth and children per node (default 4)")
    parser.add_argument("--tree-nodes", type=POSITIVE_INT, default=None, help="draft-model-tree: node budget (default 24)")


def _add_model_free_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tree-depth", type=POSITIVE_INT, default=None,
                        help="suffix, hybrid: the most tokens of a match and its draft together (default 24)")
    parser.add_argument("--max-cached-requests", type=NON_NEGATIVE_INT, default=None,
                        help="suffix, hybrid: earlier outputs the drafter remembers across calls (default 1000; 0: none)")
    parser.add_argument("--max-spec-factor", type=NON_NEGATIVE_FLOAT, default=None,
                        help="suffix, hybrid: draft tokens allowed per matched token (default 1.0)")
    parser.add_argument("--min-token-prob", type=UNIT_INTERVAL, default=None,
                        help="suffix, hybrid: the lowest frequency-estimated probability drafted (default 0.1)")
    parser.add_argument("--window-size", type=POSITIVE_INT, default=None, help="lookahead: W, the window's columns (default 4)")
    parser.add_argument("--ngram-size", type=POSITIVE_INT, default=None, help="lookahead: N, the n-gram length (default 3)")
    parser.add_argument("--verification-set-size", type=POSITIVE_INT, default=None,
                        help="lookahead: G, the most n-grams verified per step (default 4)")


def _add_draft_vocab_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft-vocab", default=None, metavar="RANKING",
                        help="layer-skip: draft from a token ranking (JSON ids, most frequent first; FR-Spec)")
    parser.add_argument("--draft-vocab-size", type=POSITIVE_INT, default=None,
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
    gen.add_argument("--method", choices=METHODS, default=None,
                     help="default: the preset's (the same method names as bench and sweep)")
    gen.add_argument("--exit-layer", type=POSITIVE_INT, default=None, help="layer-skip: the layers that draft")
    gen.add_argument("--confidence-threshold", type=CONFIDENCE, default=None,
                     help="layer-skip: stop drafting after a token less likely than this")
    _add_draft_vocab_options(gen)
    _add_tree_options(gen)
    _add_model_free_options(gen)
    _add_head_options(gen, None, None)  # None: the preset's head, else the demo target's
    gen.add_argument("--max-ngram-size", type=POSITIVE_INT, default=None, help="prompt lookup's longest n-gram")
    gen.add_argument("--min-ngram-size", type=POSITIVE_INT, default=None, help="prompt lookup's shortest n-gram")
    _add_verifier_option(gen, "the preset's, else exact for greedy decoding and rejection when sampling")
    _add_sampling_options(gen)
    gen.set_defaults(run=run_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hf-speculators", description="Speculative decoding for transformers.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands)

    bench = commands.add_parser("bench", help="compare plain, transformers' and our speculative methods")
    _add_prompt_options(bench)
    _add_model_options(bench, threads=1, from_preset=False)
    _add_schedule_option(bench, "constant")
    bench.add_argument("--variants", type=_variant_list, default=None, metavar="K,...,SCHEDULE:K",
                       help="run each of our methods once per item, side by side: K draft tokens every step, or "
                            "SCHEDULE with bound K (e.g. 1,2,3,4,5,6,goodput:6); transformers' methods run once per K")
    bench.add_argument("--methods", default=",".join(DEFAULT_BENCH_METHODS),
                       help=f"comma-separated: {','.join(BENCH_METHODS)} (default: those without an exit layer)")
    bench.add_argument("--max-ngram-size", type=POSITIVE_INT, default=2, help="for both prompt lookups (transformers' default)")
    bench.add_argument("--exit-layer", type=POSITIVE_INT, default=None, help="hf-early-exit and layer-skip: the layers that draft")
    bench.add_argument("--confidence-threshold", type=CONFIDENCE, default=None,
                       help="hf-early-exit and layer-skip: stop drafting after a token less likely than this")
    _add_draft_vocab_options(bench)
    _add_tree_options(bench)
    _add_model_free_options(bench)
    _add_verifier_option(bench, f"exact (rejection with --do-sample) for our methods ({', '.join(METHODS)})")
    _add_head_options(bench, DEMO_EAGLE3, DEMO_MEDUSA)
    _add_sampling_options(bench)
    bench.add_argument("--prefer", choices=MATCH_RULES, default=None,
                       help="our prompt lookups' match rule among earlier occurrences (default: latest)")
    bench.add_argument("--batch-size", type=POSITIVE_INT, default=1, metavar="B",
                       help="prompts per generate call, grouped in order and left padded; each method runs per batch "
                            "against plain batched generate(), methods that cannot batch are skipped (default: 1)")
    bench.add_argument("--out", default="bench_results/bench.jsonl",
                       help="JSONL records, one per (prompt, method), each written as soon as it is measured")
    bench.add_argument("--resume", action="store_true",
                       help="continue the run recorded in --out (same methods, settings and prompts)")
    bench.add_argument("--plot", default=None, metavar="FILE.png",
                       help="also draw speedup and mean acceptance length per method and category (matplotlib)")
    bench.set_defaults(run=run_bench)

    sweep = commands.add_parser("sweep", help="fidelity/acceptance trade-off of the relaxed verifiers (greedy)")
    _add_prompt_options(sweep)
    _add_model_options(sweep, threads=1, from_preset=False)
    sweep.add_argument("--method", choices=METHODS, default="draft-model-tree")
    sweep.add_argument("--exit-layer", type=POSITIVE_INT, default=None, help="layer-skip: the layers that draft")
    _add_tree_options(sweep)
    _add_head_options(sweep, DEMO_EAGLE3, DEMO_MEDUSA)
    _add_sampling_options(sweep)
    sweep.add_argument("--typical-settings", "--typical-epsilons", type=_typical_settings,
                       default=list(DEFAULT_TYPICAL_EPSILONS),
                       help="typical settings: EPSILON (delta = sqrt(epsilon)) or EPSILON:DELTA (comma-separated)")
    sweep.add_argument("--top-k-settings", type=_top_k_settings, default=list(DEFAULT_TOP_K_SETTINGS),
                       help="top_k settings: TOP_K:TOLERANCE pairs, tolerance in nats (comma-separated)")
    sweep.add_argument("--out", default="bench_results/sweep.jsonl",
                       help="JSONL records, one per (prompt, setting), each written as soon as it is measured")
    sweep.add_argument("--resume", action="store_true",
                       help="continue the sweep recorded in --out (same method, settings and prompts)")
    sweep.add_argument("--plot", default="bench_results/sweep.png", help="where to save the figure (matplotlib)")
    sweep.add_argument("--no-plot", action="store_true", help="print the table only")
    sweep.set_defaults(run=run_sweep_command)

    _add_plot(commands)
    _add_report(commands)
    _add_presets(commands)
    _add_export(commands)
    add_training_commands(commands)
    env = commands.add_parser("env", help="print the versions and device facts a bug report needs")
    env.set_defaults(run=run_env)
    return parser


def _add_plot(commands) -> None:
    plot = commands.add_parser("plot", help="draw a saved bench run (its JSONL records)")
    plot.add_argument("records", help="the JSONL file of hf-speculators bench --out")
    plot.add_argument("--out", default="bench_results/bench.png", help="the image file (PNG, SVG or PDF)")
    _add_verbose_option(plot)
    plot.set_defaults(run=run_plot)


def _add_report(commands) -> None:
    report = commands.add_parser("report", help="print a saved bench run (its JSONL records) as Markdown tables")
    report.add_argument("records", help="the JSONL file of hf-speculators bench --out")
    _add_verbose_option(report)
    report.set_defaults(run=run_report)


def _add_presets(commands) -> None:
    presets = commands.add_parser("presets", help="list the bundled presets (model cards) and their measured speed")
    presets.set_defaults(run=run_presets)
    _add_verbose_option(presets)
    show = presets.add_subparsers(dest="presets_command").add_parser("show", help="print a preset's whole card")
    show.add_argument("name", help="a bundled preset (hf-speculators presets lists them)")
    show.set_defaults(run=run_presets_show)


def _add_export(commands) -> None:
    export = commands.add_parser("export", help="print the command and code that run a preset in another engine")
    export.add_argument("name", help="bundled preset name, model card, folder or Hub id")
    export.add_argument("--to", choices=("vllm",), required=True, help="the engine: vllm")
    _add_verbose_option(export)
    export.add_argument("--out", default=None, help="Medusa heads: where to write them in vLLM's layout")
    export.set_defaults(run=run_export)


def _method_options(args) -> dict:
    """The named-method options of `hf_speculators.config.methods.method_config` that the command's flags give."""
    names = ("num_draft_tokens", "max_ngram_size", "prefer", "num_candidates", "tree_top_k", "tree_nodes",
             "exit_layer", "confidence_threshold", "draft_vocab", "draft_vocab_size", "eagle_head", "medusa_head",
             "dflash_model", "max_tree_depth", "max_cached_requests", "max_spec_factor", "min_token_prob",
             "window_size", "ngram_size", "verification_set_size")
    return {name: getattr(args, name, None) for name in names}


def config_from_args(args) -> SpeculativeConfig:
    """The preset's config with every flag that was given applied over it (`SpeculativeConfig.override`).

    `--method NAME` (a named method, as for `bench` and `sweep`) replaces the preset's method by
    `method_config(NAME, ...)` with the drafter flags given, keeping the preset's draft model or head checkpoint
    where the new method takes one; `--draft` without `--method` over a preset whose method takes no draft model
    switches to `draft-model`. `--eagle-head`, `--medusa-head` and `--dflash-model` name the head of an EAGLE,
    Medusa or DFlash method.
    """
    config = SpeculativeConfig.from_pretrained(args.preset)
    method = args.method
    if method is None and args.draft is not None and "draft_model" not in method_fields(config.method):
        method = "draft-model"  # --draft alone over a preset without a draft model (the default's)
    heads = {"eagle_head": ("eagle3", "eagle"), "medusa_head": ("medusa",), "dflash_model": ("dflash",)}
    given_head = next((name for name in heads if getattr(args, name) is not None), None)
    if method is None and given_head is not None:
        if config.method not in heads[given_head]:
            raise ValueError(f"--{given_head.replace('_', '-')} names the head of a {' or '.join(heads[given_head])} "
                             f"method, and the preset's method is {config.method!r}: pass --method as well.")
        config = config.override(draft_model=getattr(args, given_head))
    if method is not None:
        kept = config.draft_model if "draft_model" in method_fields(config.method) else None
        options = {name: value for name, value in _method_options(args).items() if value is not None}
        for name, methods in heads.items():
            options.setdefault(name, kept if config.method in methods else DEFAULT_HEADS.get(name))
        named = method_config(method, draft_model=args.draft or kept, **options)
        config = config.override(**named.to_dict())
    flags = {
        "verification": _verifier(args), "target_model": args.model, "draft_quantization": args.draft_quantization,
        "min_ngram_size": args.min_ngram_size, "num_draft_tokens_schedule": args.num_draft_tokens_schedule,
    }
    if method is None:  # the drafter flags apply to the preset's own method
        config_fields = {f.name for f in fields(SpeculativeConfig)}
        flags |= {name: value for name, value in _method_options(args).items() if name in config_fields}
        flags["draft_model"] = args.draft
        tree = {key: value for key, value in (("top_k", args.tree_top_k), ("num_nodes", args.tree_nodes))
                if value is not None}
        flags["tree"] = {**(config.tree or {}), **tree} if tree else None
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
    if not args.prompt.strip():
        raise ValueError("the prompt is empty: pass the text to continue, e.g. hf-speculators generate "
                         "\"def fibonacci(n):\"")
    config = config_from_args(args)
    target_name = config.target_model or DEMO_TARGET
    tokenizer = load_tokenizer(target_name)
    chat = use_chat_template(tokenizer, args.chat, args.system)
    target = enable(load_model(target_name, args.dtype, args.device, quantization=args.quantization))
    _print_placement(target)
    drafter, verifier = config.build(target, tokenizer)
    inputs = encode_prompt(tokenizer, args.prompt, chat, args.system).to(target.device)
    if inputs["input_ids"].shape[1] == 0:
        raise ValueError(f"the prompt {args.prompt!r} tokenizes to no tokens: pass some text.")
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
    try:
        out, seconds = _timed_generate(target, inputs, **common, **speculative, streamer=streamer)
    except KeyboardInterrupt:
        streamer.end()  # prints the text it holds back until a word ends
        print("\nhf-speculators generate: interrupted; the text above is what was generated.", file=sys.stderr)
        return INTERRUPTED
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


def _bench_settings(args) -> BenchSettings:
    return BenchSettings(max_new_tokens=args.max_new_tokens, batch_size=getattr(args, "batch_size", 1),
                         do_sample=args.do_sample, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                         seed=args.seed, chat_template=args.chat, system_prompt=args.system,
                         num_threads=args.threads, out_path=args.out, resume=args.resume)


def run_bench(args) -> int:
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.draft_vocab_size is not None and args.draft_vocab is None:
        raise ValueError("--draft-vocab-size takes the first ids of a token ranking: pass --draft-vocab as well.")
    options = {**_method_options(args), "num_draft_tokens": args.num_draft_tokens or 5}
    methods = named_methods(names, variants=args.variants, verification=_verifier(args),
                            num_draft_tokens_schedule=args.num_draft_tokens_schedule, **options)
    settings = _bench_settings(args)
    prompts = load_prompts(args.prompts, args.limit)
    tokenizer = load_tokenizer(args.model)
    use_chat_template(tokenizer, args.chat, args.system)  # fails before any model loads
    if args.plot is not None:
        pyplot()  # fail before the run, not after it, when matplotlib is missing
    target, draft = _load_models(args, any(m in DRAFT_MODEL_METHODS for m in names))
    draft_tokenizer = None if draft is None else load_tokenizer(args.draft)
    try:
        result = run_benchmark(target, tokenizer, prompts, methods, settings, draft=draft,
                               draft_tokenizer=draft_tokenizer)
    except KeyboardInterrupt:
        print(f"hf-speculators bench: interrupted; the records measured so far are in {args.out}: rerun the same "
              "command with --resume to continue.", file=sys.stderr)
        return INTERRUPTED
    print(f"records: {args.out}")
    if args.plot is not None:
        plot_benchmark(result.records, args.plot)
        print(f"plot: {args.plot}")
    return 0 if result.ok else 1


def run_sweep_command(args) -> int:
    if not args.no_plot:
        pyplot()  # fail before the sweep, not after it, when matplotlib is missing
    verifiers = default_verifiers(args.typical_settings, args.top_k_settings)
    config = method_config(args.method, draft_model=LOADED_DRAFT, **_method_options(args))
    settings = _bench_settings(args)
    prompts = load_prompts(args.prompts, args.limit)
    tokenizer = load_tokenizer(args.model)
    use_chat_template(tokenizer, args.chat, args.system)
    target, draft = _load_models(args, args.method in DRAFT_MODEL_METHODS)
    loaded = {} if draft is None else {"draft_model": draft, "draft_tokenizer": load_tokenizer(args.draft)}
    drafter = build_drafter(config, target, tokenizer, **loaded)
    try:
        points = run_sweep(target, tokenizer, prompts, drafter, verifiers, settings)
    except KeyboardInterrupt:
        print(f"hf-speculators sweep: interrupted; the records measured so far are in {args.out}: rerun the same "
              "command with --resume to continue.", file=sys.stderr)
        return INTERRUPTED
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


def run_report(args) -> int:
    print(markdown_report(read_records(args.records)), end="")
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


def _fail(args, error: BaseException, status: int) -> int:
    """Prints `error` as one line on stderr (its traceback first with `--verbose`) and returns `status`."""
    if getattr(args, "verbose", False):
        traceback.print_exception(error)
    message = " ".join(str(error).split()) or type(error).__name__
    if status == 2:
        print(f"hf-speculators {args.command}: error: {message}", file=sys.stderr)
    else:
        hint = "" if getattr(args, "verbose", False) else " (--verbose shows the traceback)"
        print(f"hf-speculators {args.command}: failed: {type(error).__name__}: {message}{hint}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    """Runs the `hf-speculators` command.

    Returns:
        `int`: the exit status: 0 on success; 1 for a failure during the run (a bench mismatch, or an error raised
        by a model or library while running); 2 for bad input (a bad flag value, a missing or unreadable file, a
        device or Hub repo that cannot be reached), reported as one line on stderr; 130 when interrupted (Ctrl-C),
        after keeping what was measured. With `--verbose` an error also prints its traceback.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "threads", None) is not None:  # `presets` has no --threads
            torch.set_num_threads(args.threads)
        if hasattr(args, "device"):  # the commands that load models
            _placement(args)
        with quiet_third_party(getattr(args, "verbose", False)):
            return args.run(args)
    except KeyboardInterrupt:
        print(f"hf-speculators {args.command}: interrupted.", file=sys.stderr)
        return INTERRUPTED
    except BAD_INPUT as error:
        return _fail(args, error, 2)
    except Exception as error:  # a failure during the run: a library or model error
        return _fail(args, error, 1)


if __name__ == "__main__":
    sys.exit(main())
