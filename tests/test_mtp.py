"""MTPDrafter: the target's own multi-token-prediction layers (transformers' `MtpModel`) in our loop, on tiny
DeepSeek-V3 and GLM-4.5 MoE targets: greedy output equal to plain `generate` (chains, trees, batches), lossless
sampling, drafts equal to transformers' `MTPCandidateGenerator`'s, and the errors raised before any forward."""

import pytest
from native_models import (
    MTP_ARCHS,
    build_mtp_target,
    check_drafts_match_transformers,
    save_mellum_with_mtp,
)
from speculative_helpers import PROMPTS, plain_generate, prompt_ids, speculative_generate
from test_batch_heads import check_rows_alone, eos_settings, sampled_ratios
from test_compiled import compile_config
from tiny_models import build_target
from transformers.generation import candidate_generator
from transformers.modeling_layers import MtpModel

import hf_speculators as hs
import hf_speculators.verifiers.rejection as rejection_module
from hf_speculators.tools.bench import BenchSettings, named_methods, run_benchmark
from hf_speculators.training.native import distill_mtp

NUM_MTP_LAYERS = (1, 2)


@pytest.fixture(scope="module")
def mtp_targets():
    """`(target, mtp_model)` per (arch, number of MTP layers), the MTP layers distilled briefly on the target's
    greedy continuation of the "random" prompt (drafts there are mostly accepted, elsewhere mostly rejected)."""
    made = {}
    for arch in MTP_ARCHS:
        for num_layers in NUM_MTP_LAYERS:
            target, mtp_model = build_mtp_target(arch, num_layers)
            sequences = [plain_generate(target, prompt_ids("random"), max_new_tokens=40)]
            made[arch, num_layers] = target, distill_mtp(mtp_model, target, sequences)
    return made


TREE = hs.DynamicTree(depth=2, top_k=2, num_nodes=4)


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("num_layers", NUM_MTP_LAYERS)
@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_greedy_output_equals_plain_generate(mtp_targets, arch, num_layers, tree):
    target, mtp_model = mtp_targets[arch, num_layers]
    accepted = 0
    for name in PROMPTS:
        out = speculative_generate(target, prompt_ids(name), hs.MTPDrafter(mtp_model, tree=tree),
                                   return_dict_in_generate=True)
        assert out.sequences.tolist() == plain_generate(target, prompt_ids(name)).tolist(), name
        accepted += out.speculative_stats.num_accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_compiled_steps_keep_the_output(mtp_targets, arch):
    """The target's compiled step forward (static cache, `compile_config`) hands the MTP layers the hidden states
    they read through `output_hidden_states`: plain greedy output, drafts accepted."""
    target, mtp_model = mtp_targets[arch, 2]
    out = speculative_generate(target, prompt_ids("random"), hs.MTPDrafter(mtp_model), return_dict_in_generate=True,
                               plain_floor=False, cache_implementation="static", compile_config=compile_config("eager"))
    assert out.sequences.tolist() == plain_generate(target, prompt_ids("random")).tolist()
    assert out.speculative_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_batch_rows_match_their_own_output_and_drafts(mtp_targets, arch, tree):
    target, mtp_model = mtp_targets[arch, 2]
    drafts = check_rows_alone(target, lambda: hs.MTPDrafter(mtp_model, tree=tree), eos_settings(target))
    assert any(tokens for row_drafts in drafts.values() for tokens, _ in row_drafts.values())
    if tree is not None:
        assert any(parents != list(range(-1, len(parents) - 1))
                   for row_drafts in drafts.values() for _, parents in row_drafts.values())


def test_sampled_chains_are_lossless_per_row(mtp_targets):
    target, mtp_model = mtp_targets["deepseek_v3", 2]
    ratios, accepted = sampled_ratios(target, hs.MTPDrafter(mtp_model))
    assert accepted > 0
    assert all(ratio < 1 for ratio in ratios.values()), ratios


def test_the_sampling_test_catches_a_broken_verifier(mtp_targets, monkeypatch):
    monkeypatch.setattr(rejection_module, "residual_distribution", lambda target_probs, draft_probs: target_probs)
    target, mtp_model = mtp_targets["deepseek_v3", 2]
    ratios, _ = sampled_ratios(target, hs.MTPDrafter(mtp_model), verifier=hs.RejectionVerifier())
    assert any(ratio > 3 for ratio in ratios.values()), ratios


@pytest.mark.parametrize("num_layers", NUM_MTP_LAYERS)
@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_drafts_equal_transformers_mtp_candidate_generator(mtp_targets, arch, num_layers, monkeypatch):
    """transformers' `generate(use_mtp=True)`, its `MtpModel.from_pretrained` giving our MTP layers (the tiny
    checkpoints' layer numbers are not DeepSeek-V3's 61 its key pattern expects)."""
    target, mtp_model = mtp_targets[arch, num_layers]
    monkeypatch.setattr(MtpModel, "from_pretrained", classmethod(lambda cls, main_model, **kwargs: mtp_model))
    check_drafts_match_transformers(target, candidate_generator.MTPCandidateGenerator,
                                    lambda: hs.MTPDrafter(mtp_model), monkeypatch, use_mtp=True)


def counting_forwards(model) -> list:
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


def test_a_target_without_mtp_layers_is_refused_before_any_forward(mtp_targets):
    target = build_target("llama")
    calls = counting_forwards(target)
    with pytest.raises(ValueError, match="declares no multi-token-prediction layers"):
        speculative_generate(target, prompt_ids("random"), hs.MTPDrafter(mtp_targets["deepseek_v3", 1][1]))
    with pytest.raises(ValueError, match="declares no multi-token-prediction layers"):
        hs.MTPDrafter.from_target(target)
    assert not calls


def test_mtp_layers_of_another_target_are_refused_before_any_forward(mtp_targets):
    other, _ = build_mtp_target("deepseek_v3", 1, seed=3)
    calls = counting_forwards(other)
    with pytest.raises(ValueError, match="tied to another model"):
        speculative_generate(other, prompt_ids("random"), hs.MTPDrafter(mtp_targets["deepseek_v3", 1][1]))
    assert not calls


@pytest.fixture(scope="module")
def mellum(tmp_path_factory):
    """A tiny Mellum target saved with its (distilled) MTP layer beside its weights and loaded back."""
    target, mtp_model = build_mtp_target("mellum", 1)
    distill_mtp(mtp_model, target, [plain_generate(target, prompt_ids("random"), max_new_tokens=40)])
    return save_mellum_with_mtp(target, mtp_model, str(tmp_path_factory.mktemp("mellum")))


def test_mtp_weights_beside_a_checkpoint_load_as_transformers_loads_them(mellum, monkeypatch):
    """`MTPDrafter.from_target` reads the MTP layer stored beside a Mellum checkpoint (per-layer-type RoPE); its greedy output is plain generate's and its drafts those of transformers'
    `generate(use_mtp=True)`, which loads the same weights itself."""
    drafter = hs.MTPDrafter.from_target(mellum)
    for name in PROMPTS:
        expected = plain_generate(mellum, prompt_ids(name))
        assert speculative_generate(mellum, prompt_ids(name), drafter).tolist() == expected.tolist(), name
    check_drafts_match_transformers(mellum, candidate_generator.MTPCandidateGenerator,
                                    lambda: hs.MTPDrafter.from_target(mellum), monkeypatch, use_mtp=True)


def test_the_mtp_methods_run_in_the_bench_beside_transformers(mellum, tokenizer):
    """`hf-mtp` (transformers' `use_mtp=True`), `mtp` and `mtp-tree` side by side through `run_benchmark`: all
    reproduce plain greedy decoding, and ours report acceptance."""
    methods = named_methods(["hf-mtp", "mtp", "mtp-tree"], num_draft_tokens=1)
    result = run_benchmark(mellum, tokenizer, ["to be or not", "the king"], methods, BenchSettings(max_new_tokens=12))
    assert result.ok and not result.skipped
    assert result.summary["all"]["mtp"]["mean_acceptance_length"] >= 1
    assert hs.SpeculativeConfig(method="mtp").to_dict() == {"method": "mtp"}


@pytest.mark.parametrize("schedule", ["goodput", "heuristic"])
def test_draft_length_schedules_keep_the_output(mtp_targets, schedule):
    target, mtp_model = mtp_targets["glm4_moe", 2]
    for name in PROMPTS:
        out = speculative_generate(target, prompt_ids(name), hs.MTPDrafter(mtp_model),
                                   num_draft_tokens_schedule=schedule)
        assert out.tolist() == plain_generate(target, prompt_ids(name)).tolist(), name
