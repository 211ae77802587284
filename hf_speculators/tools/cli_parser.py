"""The `hf-speculators` command line's parser: every command and its flags, their types, defaults and help, and
usage errors as one line. The commands' functions are in `hf_speculators.tools.cli`, which binds them."""

import argparse
from typing import Callable, Mapping

from ..config.registry import METHOD_SPECS, checkpoint_settings, method_options, named_methods
from ..drafters.spec import Setting
from ..loading import AUTO, DEMO_DRAFT, DEMO_TARGET, DTYPES
from ..onednn_linear import CPU_LINEAR_KERNELS
from ..quantization import QUANTIZATIONS
from ..schedules import SCHEDULES
from ..training.cli import add_training_commands
from ..verifiers import VERIFIERS
from .bench import DEFAULT_METHODS as DEFAULT_BENCH_METHODS
from .bench import bench_methods
from .sweep import DEFAULT_TOP_K_SETTINGS, DEFAULT_TYPICAL_EPSILONS

DEFAULT_PRESET = "demo-hybrid"  # the fastest lossless demo preset, greedy and sampling (docs/benchmarks/model_free.md)
DEMO_EAGLE3, DEMO_MEDUSA = "hf_speculators/demo-eagle3", "hf_speculators/demo-medusa"
DEFAULT_GENERATE_SCHEDULE = "goodput"  # `generate`'s draft-length schedule when neither the flag nor the preset sets one


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr, naming the command and pointing to its help."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(setting: Setting):
    """An argparse type: a number of the `Setting`'s kind within its bounds, else a one-line error that states them."""
    expected = setting.requirement()

    def parse(text: str):
        try:
            value = setting.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value != value or not setting.accepts(value):  # value != value: NaN
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse.__name__ = expected  # argparse names the type in its messages
    return parse


POSITIVE_INT, NON_NEGATIVE_INT = _number(Setting("count", low=1)), _number(Setting("count", low=0))
PROBABILITY = _number(Setting("probability", float, low=0, high=1, low_included=False))
POSITIVE_FLOAT = _number(Setting("positive", float, low=0, low_included=False))


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
    add_cpu_linear_option(parser)
    _add_chat_options(parser)
    _add_verbose_option(parser)


def add_cpu_linear_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-linear", choices=CPU_LINEAR_KERNELS, default="onednn",
                        help="on the CPU, float32 linear layers over two rows or more (the verify forward, the "
                             "prefill): onednn (default: oneDNN over weights packed once, as vLLM's CPU build) or "
                             "torch (torch's linear)")


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


def _add_head_options(parser: argparse.ArgumentParser, default_eagle: str | None, default_medusa: str | None) -> None:
    """The flags naming a method's checkpoint (`--eagle-head`...), from the method specs."""
    defaults = {"eagle_head": default_eagle, "medusa_head": default_medusa}
    for setting in checkpoint_settings().values():
        _add_setting(parser, setting, "", defaults.get(setting.name))


def _add_setting(parser: argparse.ArgumentParser, setting, methods: str, default=None) -> None:
    """The flag of a method spec's `Setting`: its type and bounds checked at parsing, unset (`None`) by default."""
    kind = None if setting.kind is str else _number(setting)
    parser.add_argument(f"--{setting.name.replace('_', '-')}", type=kind, choices=setting.choices, default=default,
                        metavar=setting.metavar, help=setting.help.replace("{methods}", methods))


def _add_prompt_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", default="spec-bench",
                        help="a named set (spec-bench: Spec-Bench's 480 prompts, shipped in the package), or a file: "
                             "JSONL (Spec-Bench/MT-bench turns, HumanEval prompt, .jsonl.gz too) or text "
                             "(default: spec-bench)")
    parser.add_argument("--limit", type=POSITIVE_INT, default=None, help="prompts to run, spread over the categories")


def _add_drafter_settings(parser: argparse.ArgumentParser, skip: tuple = (), baselines: bool = False) -> None:
    """The flags of the method specs' settings (but those in `skip`, which the command defines itself), unset by
    default so that each keeps the method's default; a help's `{methods}` names the methods of the specs that take
    the setting (with `baselines`, transformers' ones too)."""
    for setting in method_options().values():
        if setting.flag and setting.name not in skip and setting.name not in checkpoint_settings():
            methods = (name for spec in METHOD_SPECS.values() if setting in spec.settings
                       for name in (*(spec.baselines if baselines else ()), *spec.variants))
            _add_setting(parser, setting, " and ".join(methods))


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


def _int_list(text: str) -> list[int]:
    """`"3,5,8"` -> `[3, 5, 8]`."""
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _variant_list(text: str) -> list[tuple[int, str]]:
    """`"1,2,goodput:6"` -> `[(1, "constant"), (2, "constant"), (6, "goodput")]`."""
    try:
        return [(int(item), "constant") if ":" not in item else (int(item.split(":")[1]), item.split(":")[0])
                for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated K or SCHEDULE:K items, got {text!r}") from None


def _add_generate(commands, run) -> None:
    gen = commands.add_parser("generate", help="stream speculative output and compare it with plain generate()")
    gen.add_argument("prompt")
    gen.add_argument("--preset", default=DEFAULT_PRESET,
                     help=f"bundled preset name, model card, folder or Hub id (default: {DEFAULT_PRESET}); "
                          "the flags below override its settings")
    _add_model_options(gen, threads=None, from_preset=True)
    _add_schedule_option(gen, f"the preset's, else {DEFAULT_GENERATE_SCHEDULE}")
    gen.add_argument("--method", choices=tuple(named_methods()), default=None,
                     help="default: the preset's (the same method names as bench and sweep)")
    _add_drafter_settings(gen)
    _add_head_options(gen, None, None)  # None: the preset's head, else the demo target's
    _add_verifier_option(gen, "the preset's, else exact for greedy decoding and rejection when sampling")
    _add_sampling_options(gen)
    _add_compile_option(gen, "both the speculative and the plain run")
    gen.set_defaults(run=run)


def _add_compile_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--compile", action="store_true",
                        help=f"run {what} with a static cache and torch.compile (transformers' compile_config, told "
                             "to compile on the CPU too); the warm-up call compiles")


def command_parser(runs: Mapping[str, Callable]) -> argparse.ArgumentParser:
    """The `hf-speculators` parser: every command with its flags, each bound (`args.run`) to its function in `runs`
    (command name -> function; `"presets show"` for the subcommand), the training commands to theirs."""
    parser = _Parser(prog="hf-speculators", description="Speculative decoding for transformers.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands, runs["generate"])

    bench = commands.add_parser("bench", help="compare plain, transformers' and our speculative methods")
    _add_prompt_options(bench)
    _add_model_options(bench, threads=1, from_preset=False)
    _add_schedule_option(bench, "constant")
    bench.add_argument("--variants", type=_variant_list, default=None, metavar="K,...,SCHEDULE:K",
                       help="run each of our methods once per item, side by side: K draft tokens every step, or "
                            "SCHEDULE with bound K (e.g. 1,2,3,4,5,6,goodput:6); transformers' methods run once per K")
    bench.add_argument("--baseline-k", type=_int_list, default=None, metavar="K,...",
                       help="run transformers' methods once per K (e.g. 3,5,8,10), whatever --variants says; the "
                            "tables add each one's best K per category")
    bench.add_argument("--compare-floor", action="store_true",
                       help="also run each of our methods without the plain-speed floor (labelled [no floor]); "
                            "the hybrid, which has a floor of its own, with the loop's as well ([loop floor])")
    bench.add_argument("--compare-eager", action="store_true",
                       help="with --compile, also run each of our methods eagerly (labelled [eager]); the tables add "
                            "the share of its eager lead over plain that it keeps compiled")
    bench.add_argument("--methods", default=",".join(DEFAULT_BENCH_METHODS),
                       help=f"comma-separated: {','.join(bench_methods())} (default: those without an exit layer)")
    bench.add_argument("--presets", default=None, metavar="NAME,...",
                       help="also run these presets (bundled names, card folders or Hub ids) as generate --preset "
                            "runs them, their own settings and draft models, labelled by name (e.g. demo-hybrid, "
                            "the default job); the drafter flags below do not apply to them")
    bench.add_argument("--max-ngram-size", type=POSITIVE_INT, default=2, help="for both prompt lookups (transformers' default)")
    _add_drafter_settings(bench, skip=("max_ngram_size",), baselines=True)
    _add_verifier_option(bench, f"exact (rejection with --do-sample) for our methods ({', '.join(named_methods())})")
    _add_head_options(bench, DEMO_EAGLE3, DEMO_MEDUSA)
    _add_sampling_options(bench)
    bench.add_argument("--batch-size", type=POSITIVE_INT, default=1, metavar="B",
                       help="prompts per generate call, grouped in order and left padded; each method runs per batch "
                            "against plain batched generate(), methods that cannot batch are skipped (default: 1)")
    bench.add_argument("--out", default="bench_results/bench.jsonl",
                       help="JSONL records, one per (prompt, method), each written as soon as it is measured")
    _add_compile_option(bench, "every method, beside plain (eager) and plain-compiled (the compiled baseline),")
    bench.add_argument("--resume", action="store_true",
                       help="continue the run recorded in --out (same methods, settings and prompts)")
    bench.add_argument("--plot", default=None, metavar="FILE.png",
                       help="also draw speedup and mean acceptance length per method and category (matplotlib)")
    bench.set_defaults(run=runs["bench"])

    sweep = commands.add_parser("sweep", help="fidelity/acceptance trade-off of the relaxed verifiers (greedy)")
    _add_prompt_options(sweep)
    _add_model_options(sweep, threads=1, from_preset=False)
    sweep.add_argument("--method", choices=tuple(named_methods()), default="draft-model-tree")
    _add_drafter_settings(sweep)
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
    sweep.set_defaults(run=runs["sweep"])

    _add_plot(commands, runs["plot"])
    _add_report(commands, runs["report"])
    _add_presets(commands, runs["presets"], runs["presets show"])
    _add_export(commands, runs["export"])
    add_training_commands(commands)
    env = commands.add_parser("env", help="print the versions and device facts a bug report needs")
    env.set_defaults(run=runs["env"])
    return parser


def _add_plot(commands, run) -> None:
    plot = commands.add_parser("plot", help="draw a saved bench run (its JSONL records)")
    plot.add_argument("records", help="the JSONL file of hf-speculators bench --out")
    plot.add_argument("--out", default="bench_results/bench.png", help="the image file (PNG, SVG or PDF)")
    _add_verbose_option(plot)
    plot.set_defaults(run=run)


def _add_report(commands, run) -> None:
    report = commands.add_parser("report", help="print a saved bench run (its JSONL records) as Markdown tables")
    report.add_argument("records", help="the JSONL file of hf-speculators bench --out")
    _add_verbose_option(report)
    report.set_defaults(run=run)


def _add_presets(commands, run, run_show) -> None:
    presets = commands.add_parser("presets", help="list the bundled presets (model cards) and their measured speed")
    presets.set_defaults(run=run)
    _add_verbose_option(presets)
    show = presets.add_subparsers(dest="presets_command").add_parser("show", help="print a preset's whole card")
    show.add_argument("name", help="a bundled preset (hf-speculators presets lists them)")
    show.set_defaults(run=run_show)


def _add_export(commands, run) -> None:
    export = commands.add_parser("export", help="print the command and code that run a preset in another engine")
    export.add_argument("name", help="bundled preset name, model card, folder or Hub id")
    export.add_argument("--to", choices=("vllm",), required=True, help="the engine: vllm")
    _add_verbose_option(export)
    export.add_argument("--out", default=None,
                        help="Medusa heads and DFlash drafters: where to write them in the form vLLM reads (default: a "
                             "temporary folder)")
    export.add_argument("--check", action="store_true",
                        help="serve the export in vLLM on a few Spec-Bench prompts and print vLLM's and our "
                             "acceptance per position side by side and whether the greedy outputs agree")
    export.add_argument("--vllm-python", default=None, metavar="PATH",
                        help="--check: the Python of the environment holding vLLM (default: "
                             "$HF_SPECULATORS_VLLM_PYTHON, else .vllm-env made by tests/make_vllm_env.sh)")
    export.add_argument("--prompts", default=None, metavar="FILE",
                        help="--check: your prompts (a JSONL or text file, as bench reads; its first 4 are served) "
                             "instead of Spec-Bench's")
    export.set_defaults(run=run)
