"""What the examples that time the default job on a prompts file share (`step_breakdown.py`,
`hybrid_model_lengths.py`): their command-line options, the `generate` options those give, and the demo target.
Not run by itself."""

import argparse

import hf_speculators as hs
from hf_speculators.loading import load_model, load_tokenizer
from hf_speculators.onednn_linear import with_cpu_linear
from hf_speculators.tools.cli_parser import add_cpu_linear_option

DEMO_TARGET = "hf_speculators/demo-target"


def add_run_options(parser: argparse.ArgumentParser, limit: int | None) -> None:
    """`--prompts`, `--limit` (default `limit`), `--max-new-tokens`, `--do-sample`, `--temperature`, `--device` and
    `--cpu-linear` (as the command line's)."""
    parser.add_argument("--prompts", required=True, help="a prompt file (JSONL) or spec-bench")
    parser.add_argument("--limit", type=int, default=limit)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--do-sample", action="store_true", help="sample at --temperature (default: greedy)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--device", default="cpu", help="where the models run (default: cpu; the GPU check: cuda)")
    add_cpu_linear_option(parser)


def generate_options(args: argparse.Namespace) -> dict:
    """The `generate` keywords of `add_run_options`' flags: new tokens, and greedy or sampling at the temperature."""
    return dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                **({"temperature": args.temperature} if args.do_sample else {}))


def demo_target(args: argparse.Namespace):
    """The demo target on `args.device` (its `generate` enabled for drafters: `hs.enable`; its linear layers through
    oneDNN unless `--cpu-linear torch`) and its tokenizer."""
    model = with_cpu_linear(load_model(DEMO_TARGET, device=args.device), args.cpu_linear)
    hs.enable(model)
    return model, load_tokenizer(DEMO_TARGET)
