"""The method registry: a toy drafter added through its `MethodSpec` alone is seen by `SpeculativeConfig`,
`method_config`, the drafter factory, the command line, the benchmark and the vLLM export."""

import argparse
import dataclasses

import pytest

from hf_speculators.config import SpeculativeConfig
from hf_speculators.config.build import build_drafter
from hf_speculators.config.methods import draft_model_methods, method_config
from hf_speculators.config.registry import METHOD_SPECS, method_settings
from hf_speculators.drafters import Baseline, MethodSpec, PromptLookupDrafter, Setting, Variant, VllmMapping
from hf_speculators.drafters.spec import DRAFT_MODEL
from hf_speculators.tools.bench import bench_methods, named_methods, transformers_methods
from hf_speculators.tools.bench.engines import generate_kwargs
from hf_speculators.tools.bench.settings import baseline_of
from hf_speculators.tools.cli import build_parser


class ToyDrafter(PromptLookupDrafter):
    """A new drafter: prompt lookup under another name, with its own defaults."""

    name = "toy"

    def __init__(self, num_draft_tokens: int = 3, max_ngram_size: int = 2):
        super().__init__(num_draft_tokens=num_draft_tokens, max_ngram_size=max_ngram_size)


TOY_SPEC = MethodSpec("toy", ToyDrafter, settings=(Setting("max_ngram_size", low=1, help="prompt lookup's longest n-gram"),),
                      variants={"toy": Variant(), "toy-tree": Variant(settings={"max_ngram_size": 1})})


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(METHOD_SPECS, "toy", TOY_SPEC)
    return TOY_SPEC


def _command(name: str) -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def test_the_toy_method_is_a_config_with_its_drafters_defaults(toy):
    config = SpeculativeConfig(method="toy", max_ngram_size=4)
    assert config.resolved("num_draft_tokens") == 3 and config.to_dict() == {"method": "toy", "max_ngram_size": 4}
    with pytest.raises(ValueError, match="exit_layer does not apply to method='toy'"):
        SpeculativeConfig(method="toy", exit_layer=2)
    with pytest.raises(ValueError, match="max_ngram_size must be an integer >= 1, got 0"):
        SpeculativeConfig(method="toy", max_ngram_size=0)
    assert isinstance(build_drafter(config, None), ToyDrafter)


def test_the_toy_methods_named_variants(toy):
    assert method_config("toy", num_draft_tokens=5, exit_layer=2).to_dict() == {"method": "toy", "num_draft_tokens": 5}
    assert method_config("toy-tree").to_dict() == {"method": "toy", "max_ngram_size": 1}
    assert method_config("toy-tree", max_ngram_size=3).max_ngram_size == 3  # a given setting wins


def test_the_command_line_offers_the_toy_method(toy):
    for command in ("generate", "sweep"):
        method = next(a for a in _command(command)._actions if a.dest == "method")
        assert {"toy", "toy-tree"} <= set(method.choices)
    args = build_parser().parse_args(["generate", "hi", "--method", "toy", "--max-ngram-size", "2"])
    assert (args.method, args.max_ngram_size) == ("toy", 2)
    assert "toy,toy-tree" in next(a for a in _command("bench")._actions if a.dest == "methods").help


def test_a_new_setting_gets_its_flag(toy, monkeypatch):
    spec = dataclasses.replace(TOY_SPEC, settings=(Setting("window_size", low=1, help="toy: a window"),))
    monkeypatch.setitem(METHOD_SPECS, "toy", spec)
    monkeypatch.delitem(METHOD_SPECS, "lookahead")  # the setting's first declaration is now the toy's
    assert method_settings()["window_size"].help == "toy: a window"
    flag = next(a for a in _command("bench")._actions if "--window-size" in a.option_strings)
    assert flag.help == "toy: a window"


def test_the_bench_runs_the_toy_method(toy):
    assert {"toy", "toy-tree"} <= set(bench_methods())
    chosen = named_methods(["plain", "toy"], num_draft_tokens=4)
    assert chosen["toy"].config.to_dict() == {"method": "toy", "num_draft_tokens": 4, "max_ngram_size": 2}  # bench: 2


def test_the_vllm_export_of_the_toy_method(toy, monkeypatch):
    with pytest.raises(ValueError, match="method='toy' has no vLLM equivalent"):
        SpeculativeConfig(method="toy").to_vllm()
    mapped = dataclasses.replace(TOY_SPEC, vllm=VllmMapping("ngram", fields={"max_ngram_size": "prompt_lookup_max"},
                                                            draft=False))
    monkeypatch.setitem(METHOD_SPECS, "toy", mapped)
    assert SpeculativeConfig(method="toy").to_vllm() == {"method": "ngram", "prompt_lookup_max": 2,
                                                         "num_speculative_tokens": 3}


def test_a_spec_added_later_reaches_the_lists_and_its_baseline_the_bench(toy, monkeypatch):
    baseline = Baseline(("num_draft_tokens",), lambda config, target, draft, build: {"toy_tokens": config.num_draft_tokens},
                        pinned=True)
    spec = dataclasses.replace(TOY_SPEC, shared=("draft_model",), checkpoint=DRAFT_MODEL, baselines={"hf-toy": baseline})
    monkeypatch.setitem(METHOD_SPECS, "toy", spec)
    assert {"toy", "toy-tree"} <= set(draft_model_methods()) and transformers_methods()["hf-toy"] == "toy"
    assert bench_methods().index("hf-toy") == bench_methods().index("toy") - 1  # a spec's baselines, then its methods
    method = named_methods(["hf-toy"], num_draft_tokens=4)["hf-toy"]
    assert (method.engine, method.config.to_dict()) == ("transformers", {"method": "toy", "num_draft_tokens": 4})
    assert baseline_of(method).pinned and generate_kwargs(method, None, None, do_sample=False) == {"toy_tokens": 4}
