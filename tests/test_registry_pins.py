"""Pins what the method registry must not change: every bundled preset's card and YAML, every CLI flag (name,
default, help, choices), `method_config` of every named method, the bench's methods and the vLLM export of every
bundled preset (`tests/data/registry_pins.json`, written by `tests/registry_snapshot.py` before the registry)."""

import json
import re
from pathlib import Path

import pytest
import yaml

from hf_speculators.config import SpeculativeConfig
from hf_speculators.config.presets import bundled_presets, card_results, card_text

from registry_snapshot import snapshot

PINS = json.loads((Path(__file__).parent / "data" / "registry_pins.json").read_text(encoding="utf-8"))
NOW = snapshot()
# flags added since the pins (command -> flags): every command with drafter settings offers all the specs' settings,
# suffix decoding's max_spec_offset among them
NEW_FLAGS = {"generate": {"--prefer", "--max-spec-offset", "--compile", "--cpu-linear"},
             "bench": {"--cpu-linear", "--min-ngram-size", "--max-spec-offset", "--compile", "--baseline-k", "--compare-floor",
                       "--compare-eager", "--presets"},
             "sweep": {"--cpu-linear", "--confidence-threshold", "--draft-vocab", "--draft-vocab-size", "--max-tree-depth",
                       "--max-cached-requests", "--max-spec-factor", "--max-spec-offset", "--min-token-prob",
                       "--window-size", "--ngram-size", "--verification-set-size", "--prefer", "--max-ngram-size",
                       "--min-ngram-size"},
             "export": {"--check", "--vllm-python", "--prompts"}}
# flags whose help lists the named methods: the list is compared as a set (the registry orders variants by method)
METHOD_LISTS = re.compile(r"[\w.-]+(?:, ?[\w.-]+){5,}")


def _method_list_free(text):
    return METHOD_LISTS.sub(lambda found: ",".join(sorted(re.split(r", ?", found.group()))), text or "")


def _commands(tree, prefix=()):
    yield " ".join(prefix), tree["flags"]
    for name, sub in tree["commands"].items():
        yield from _commands(sub, (*prefix, name))


@pytest.mark.parametrize("name", sorted(bundled_presets()))
def test_bundled_preset_round_trips_byte_for_byte(name):
    config = SpeculativeConfig.from_pretrained(name)
    card = bundled_presets()[name] / "README.md"
    text = card.read_text(encoding="utf-8")
    assert card_text(config, name=name, results=card_results(card)) == text
    block = yaml.safe_load(text.split("---")[1])["speculative_decoding"]
    assert config.to_dict() == block and list(config.to_dict()) == list(block)
    assert SpeculativeConfig.from_dict(config.to_dict()) == config


def test_every_cli_flag_keeps_its_name_default_help_and_choices():
    now = dict(_commands(NOW["cli"]))
    for command, flags in _commands(PINS["cli"]):
        added = set(now[command]) - set(flags)
        assert added == NEW_FLAGS.get(command, set()), command
        for flag, pinned in flags.items():
            current = dict(now[command][flag])
            assert _method_list_free(current.pop("help")) == _method_list_free(pinned["help"]), (command, flag)
            assert current == {key: value for key, value in pinned.items() if key != "help"}, (command, flag)


def test_method_config_of_every_named_method():
    assert NOW["method_config"] == PINS["method_config"]


def test_bench_methods_and_their_configs():
    assert sorted(NOW["bench_methods"]) == sorted(PINS["bench_methods"])
    assert NOW["bench_configs"] == PINS["bench_configs"]


def test_vllm_export_of_every_bundled_preset():
    assert NOW["vllm"] == PINS["vllm"]
