"""What the method registry must keep: the CLI flags of every command, `method_config` of every named method, the
bench's method list and the vLLM export of every bundled preset, as plain data (`tests/data/registry_pins.json`).
Run `python tests/registry_snapshot.py` to print it."""

import argparse
import json
import warnings
from pathlib import Path

import hf_speculators

from hf_speculators.config import SpeculativeConfig
from hf_speculators.config.methods import method_config
from hf_speculators.config.registry import named_methods
from hf_speculators.config.presets import bundled_presets
from hf_speculators.tools import bench
from hf_speculators.tools.cli import build_parser

# the options every named method is asked with (those a method does not take are ignored)
OPTIONS = {"draft_model": "d", "num_draft_tokens": 3, "max_ngram_size": 2, "prefer": "earliest", "num_candidates": 2,
           "tree_top_k": 2, "tree_nodes": 5, "exit_layer": 1, "confidence_threshold": 0.5, "draft_vocab": "r.json",
           "draft_vocab_size": 8, "eagle_head": "e", "medusa_head": "m", "dflash_model": "f", "gemma4_assistant": "g",
           "max_tree_depth": 9, "max_cached_requests": 0, "max_spec_factor": 2.0, "min_token_prob": 0.2,
           "window_size": 3, "ngram_size": 4, "verification_set_size": 2}


def _flags(parser: argparse.ArgumentParser) -> dict:
    """Each command's flags: option string -> its default, help and choices (subcommands recursively)."""
    flags, commands = {}, {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            commands = {name: _flags(sub) for name, sub in action.choices.items()}
        elif action.option_strings:
            default = action.default if isinstance(action.default, (str, int, float, bool, type(None))) else repr(
                action.default)
            choices = sorted(action.choices) if action.choices else None
            for flag in action.option_strings:
                flags[flag] = {"dest": action.dest, "default": default, "help": action.help, "choices": choices}
    return {"flags": flags, "commands": commands}


def _vllm(name: str):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return SpeculativeConfig.from_pretrained(name).to_vllm()
    except ValueError as error:
        return f"ValueError: {error}"


def snapshot() -> dict:
    """The pinned data, with this checkout's package folder written as `<package>`."""
    data = {
        "cli": _flags(build_parser()),
        "method_config": {name: method_config(name, **OPTIONS).to_dict() for name in named_methods()},
        "bench_methods": list(bench.bench_methods()),
        "bench_configs": {label: m.config.to_dict() for label, m in bench.named_methods(
            [m for m in bench.bench_methods() if m not in ("plain",)], **OPTIONS).items()},
        "vllm": {name: _vllm(name) for name in sorted(bundled_presets())},
    }
    package = json.dumps(str(Path(hf_speculators.__file__).parent))[1:-1]
    return json.loads(json.dumps(data).replace(package, "<package>"))


if __name__ == "__main__":
    print(json.dumps(snapshot(), indent=1, sort_keys=True))
