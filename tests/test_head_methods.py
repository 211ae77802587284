"""Learned draft heads through the one drafter factory: presets, generate(speculative_config=...), bench methods,
the command line and vLLM export."""

import json

import pytest
from eagle_heads import random_eagle3, save_in_format
from speculative_helpers import assert_same_tokens, plain_generate, prompt_ids
from tiny_models import build_model, build_tokenizer

import hf_speculators as hs
from hf_speculators.tools import cli
from hf_speculators.tools.bench import BenchSettings, named_methods, run_benchmark
from hf_speculators.heads.medusa import MedusaHeads
from hf_speculators.heads.medusa_formats import save_medusa_heads
from hf_speculators.config.methods import make_drafter, method_config, named_head_methods


@pytest.fixture(scope="module")
def target():
    """A 4-layer Llama (the test EAGLE-3 head reads the inputs of layers 0, 2 and 3)."""
    return build_model("llama", num_layers=4, seed=1)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    eagle = save_in_format(random_eagle3(1, draft_vocab_size=64), root / "eagle3", "speculators-eagle3")
    medusa = save_medusa_heads(MedusaHeads(48, 3, 1, None), root / "medusa")
    return {"eagle_head": str(eagle), "medusa_head": str(medusa)}


@pytest.mark.parametrize(
    ("settings", "drafter_class"),
    [
        ({"method": "eagle3", "num_draft_tokens": 3}, hs.EagleDrafter),
        ({"method": "eagle", "tree": {"depth": 3, "top_k": 2, "num_nodes": 5}}, hs.EagleDrafter),
        ({"method": "medusa", "num_draft_tokens": 2}, hs.MedusaDrafter),
        ({"method": "medusa", "tree": {"paths": [[0], [1], [0, 0]]}}, hs.MedusaDrafter),
    ],
)
def test_a_head_preset_builds_and_generates_the_targets_output(target, heads, settings, drafter_class):
    head = heads["medusa_head" if settings["method"] == "medusa" else "eagle_head"]
    config = hs.SpeculativeConfig(draft_model=head, **settings)
    drafter, verifier = config.build(target)
    assert isinstance(drafter, drafter_class) and verifier is None
    expected = plain_generate(target, prompt_ids("random"))
    out = target.generate(prompt_ids("random"), custom_generate=hs.generate, speculative_config=config,
                          do_sample=False, max_new_tokens=24)
    assert_same_tokens(out, expected)


def test_a_checkpoint_folder_is_a_preset(target, heads):
    config = hs.SpeculativeConfig.from_pretrained(heads["medusa_head"])
    assert (config.method, config.draft_model) == ("medusa", heads["medusa_head"])
    drafter, _ = config.build(target)
    assert isinstance(drafter, hs.MedusaDrafter) and drafter.num_draft_tokens == 3


def test_the_bench_runs_every_head_method_exactly(target, heads, tmp_path):
    out_path = tmp_path / "bench.jsonl"
    methods = named_methods(list(named_head_methods()), num_draft_tokens=2, tree_top_k=2, tree_nodes=4, **heads)
    settings = BenchSettings(max_new_tokens=8, out_path=out_path, verbose=False)
    result = run_benchmark(target, build_tokenizer(), ["abcabc", "x=1"], methods, settings)
    assert result.ok and not result.mismatches
    records = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert {r["method"] for r in records} == {"plain", *named_head_methods()}
    assert {r["provenance"]["run"]["methods"]["eagle3"]["draft_model"] for r in records} == {heads["eagle_head"]}


def test_the_bench_times_the_heads_as_draft_time(target, heads):
    from hf_speculators.tools.bench.timing import timed_modules

    eagle = make_drafter("eagle3", **heads)
    medusa = make_drafter("medusa", **heads)
    assert any(module is eagle.head for module in timed_modules(target, {"candidate_generator": eagle}))
    assert any(module is medusa.heads for module in timed_modules(target, {"candidate_generator": medusa}))


def test_make_drafter_builds_head_methods(heads):
    assert isinstance(make_drafter("eagle3-tree", tree_top_k=2, num_draft_tokens=2, **heads), hs.EagleDrafter)
    with pytest.raises(ValueError, match="draft_model is required for method='medusa'"):
        make_drafter("medusa")


def test_the_cli_bench_takes_head_checkpoints(target, heads, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "load_model", lambda *args, **kwargs: target)
    monkeypatch.setattr(cli, "load_tokenizer", lambda *args, **kwargs: build_tokenizer())
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("abcabc\n")
    code = cli.main(["bench", "--prompts", str(prompts), "--methods", "eagle3,medusa-tree", "--max-new-tokens", "6",
                     "--num-draft-tokens", "2", "--eagle-head", heads["eagle_head"], "--medusa-head",
                     heads["medusa_head"], "--out", str(tmp_path / "bench.jsonl")])
    assert code == 0 and "medusa-tree" in capsys.readouterr().out


def test_head_presets_export_to_vllm_where_vllm_reads_the_checkpoint(heads):
    eagle = hs.SpeculativeConfig(method="eagle3", draft_model="org/speculator", num_draft_tokens=3)
    assert eagle.to_vllm() == {"method": "eagle3", "model": "org/speculator", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match=r"tree=\{'depth': 4\} has no vLLM equivalent"):
        hs.SpeculativeConfig(method="eagle3", draft_model="org/speculator", tree={"depth": 4}).to_vllm()
    with pytest.raises(ValueError, match="vLLM reads Medusa heads in its own layout"):
        hs.SpeculativeConfig(method="medusa", draft_model="org/medusa").to_vllm()


@pytest.mark.parametrize("method", ["draft-model-tree", "eagle3-tree", "medusa-tree"])
def test_tree_methods_draft_a_tree_without_tree_options(method):
    config = method_config(method, draft_model="org/draft", eagle_head="org/eagle", medusa_head="org/medusa")
    assert config.tree == {}  # DynamicTree's defaults, never a chain


@pytest.mark.parametrize("schedule", ["heuristic", "goodput"])
@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_head_drafters_stay_exact_under_adaptive_draft_lengths(target, heads, method, schedule):
    """Steps without a draft call no propose: the heads must still see every committed token's features."""
    head = heads["medusa_head" if method == "medusa" else "eagle_head"]
    config = hs.SpeculativeConfig(method=method, draft_model=head, num_draft_tokens=3,
                                  num_draft_tokens_schedule=schedule)
    expected = plain_generate(target, prompt_ids("random"), max_new_tokens=40)
    out = target.generate(prompt_ids("random"), custom_generate=hs.generate, speculative_config=config,
                          do_sample=False, max_new_tokens=40, return_dict_in_generate=True)
    assert_same_tokens(out.sequences, expected)
    if schedule == "goodput":  # random heads are rejected: the schedule falls back to plain steps
        assert out.speculative_stats.num_steps_without_draft > 0
