"""DFlashDrafter: a DFlash block drafter (transformers' `MuseGlimmerAssistantModel`) in our loop, on a tiny Llama
target: greedy output equal to plain `generate` (chains, trees, batches), lossless sampling, drafts equal to
transformers' `DFlashTokenCandidateGenerator`'s, and the errors raised before any forward."""

import pytest
from native_models import build_dflash, check_drafts_match_transformers
from speculative_helpers import PROMPTS, plain_generate, prompt_ids, speculative_generate
from test_batch_heads import check_rows_alone, eos_settings, sampled_ratios
from test_mtp import counting_forwards
from tiny_models import build_model
from transformers.generation import candidate_generator

import hf_speculators as hs
import hf_speculators.verifiers.rejection as rejection_module
from hf_speculators.tools.bench import BenchSettings, named_methods, run_benchmark
from hf_speculators.training.native import distill_dflash

TREE = hs.DynamicTree(depth=3, top_k=2, num_nodes=6)


@pytest.fixture(scope="module")
def dflash():
    """`(target, drafter model)`: a 2-layer Llama and a DFlash drafter of block size 4 reading the outputs of both
    its layers (the last one: the final norm's output), distilled briefly on the target's greedy continuation of the
    "random" prompt."""
    target = build_model("llama", num_layers=2, seed=1)
    sequences = [plain_generate(target, prompt_ids("random"), max_new_tokens=40)]
    return target, distill_dflash(build_dflash(target), target, sequences)


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("num_draft_tokens", [1, 3])
def test_greedy_output_equals_plain_generate(dflash, num_draft_tokens, tree):
    target, model = dflash
    accepted = 0
    for name in PROMPTS:
        drafter = hs.DFlashDrafter(model, num_draft_tokens=num_draft_tokens, tree=tree)
        out = speculative_generate(target, prompt_ids(name), drafter, return_dict_in_generate=True)
        assert out.sequences.tolist() == plain_generate(target, prompt_ids(name)).tolist(), name
        accepted += out.speculative_stats.num_accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_batch_rows_match_their_own_output_and_drafts(dflash, tree):
    target, model = dflash
    drafts = check_rows_alone(target, lambda: hs.DFlashDrafter(model, tree=tree), eos_settings(target))
    assert any(tokens for row_drafts in drafts.values() for tokens, _ in row_drafts.values())


def test_sampled_chains_are_lossless_per_row(dflash):
    target, model = dflash
    ratios, accepted = sampled_ratios(target, hs.DFlashDrafter(model))
    assert accepted > 0
    assert all(ratio < 1 for ratio in ratios.values()), ratios


def test_the_sampling_test_catches_a_broken_verifier(dflash, monkeypatch):
    monkeypatch.setattr(rejection_module, "residual_distribution", lambda target_probs, draft_probs: target_probs)
    target, model = dflash
    ratios, _ = sampled_ratios(target, hs.DFlashDrafter(model), verifier=hs.RejectionVerifier())
    assert any(ratio > 3 for ratio in ratios.values()), ratios


def test_drafts_equal_transformers_dflash_candidate_generator(dflash, monkeypatch):
    target, model = dflash
    check_drafts_match_transformers(target, candidate_generator.DFlashTokenCandidateGenerator,
                                    lambda: hs.DFlashDrafter(model), monkeypatch, assistant_model=model,
                                    speculation_type="dflash")


def test_a_drafter_made_for_another_target_is_refused_before_any_forward(dflash):
    _, model = dflash
    for other, message in ((build_model("llama", num_layers=1, seed=2), "reads target layers"),
                           (build_model("llama", hidden_size=32, num_layers=2, seed=2), "hidden_size=48"),
                           (build_model("llama", num_layers=2, seed=2, vocab_size=64), "another tokenizer")):
        calls = counting_forwards(other)
        with pytest.raises(ValueError, match=message):
            speculative_generate(other, prompt_ids("random"), hs.DFlashDrafter(model))
        assert not calls


def test_num_draft_tokens_beyond_the_block_is_refused(dflash):
    with pytest.raises(ValueError, match=r"num_draft_tokens must be an integer in 1..3"):
        hs.DFlashDrafter(dflash[1], num_draft_tokens=4)


def test_a_saved_drafter_loads_and_runs_in_the_bench_beside_transformers(dflash, tokenizer, tmp_path):
    """A DFlash checkpoint (safetensors) loads by `SpeculativeConfig(method="dflash")`; `hf-dflash` (transformers'
    `speculation_type="dflash"`), `dflash` and `dflash-tree` run side by side in `run_benchmark`, all reproducing
    plain greedy decoding."""
    target, model = dflash
    model.save_pretrained(tmp_path)
    drafter = hs.SpeculativeConfig(method="dflash", draft_model=str(tmp_path)).build(target)[0]
    assert isinstance(drafter, hs.DFlashDrafter) and drafter.num_draft_tokens == 3
    methods = named_methods(["hf-dflash", "dflash", "dflash-tree"], dflash_model=str(tmp_path))
    result = run_benchmark(target, tokenizer, ["to be or not", "the king"], methods, BenchSettings(max_new_tokens=12))
    assert result.ok and not result.skipped


def test_a_speculators_format_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"speculators_model_type": "dflash", "speculators_config": {}}')
    with pytest.raises(ValueError, match="vllm-project/speculators checkpoint .*vLLM runs it"):
        hs.DFlashDrafter.from_pretrained(str(tmp_path))


def test_the_goodput_schedule_keeps_the_output(dflash):
    target, model = dflash
    for name in PROMPTS:
        out = speculative_generate(target, prompt_ids(name), hs.DFlashDrafter(model),
                                   num_draft_tokens_schedule="goodput")
        assert out.tolist() == plain_generate(target, prompt_ids(name)).tolist(), name
