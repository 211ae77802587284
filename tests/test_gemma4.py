"""Gemma4AssistantDrafter: a Gemma 4 assistant (transformers' `Gemma4AssistantForCausalLM`) in our loop, on a tiny
Gemma 4 target: greedy output equal to plain `generate` (batches and schedules too), lossless sampling with a
broken-verifier control, drafts equal to transformers' `SinglePositionMultiTokenCandidateGenerator`'s, the errors
raised before any forward, and the method in the config, the CLI and the bench beside transformers' own. On a
transformers that cannot build the assistant (5.23) the method fails naming the version, and the rest skips."""

import pytest
import torch
from native_models import build_gemma4
from speculative_helpers import PROMPTS, plain_generate, prompt_ids, speculative_generate
from test_batch_heads import check_rows_alone, eos_settings, recording, sampled_ratios
from tiny_models import build_target
from transformers import DynamicCache, GenerationConfig

import hf_speculators as hs
import hf_speculators.decoding as decoding_module
import hf_speculators.drafters.gemma4_assistant as gemma4_module
import hf_speculators.verifiers.rejection as rejection_module
from hf_speculators.tools.bench import BenchSettings, named_methods, run_benchmark
from hf_speculators.tools.cli import main
from hf_speculators.training.native import distill_gemma4_assistant

UNSUPPORTED = gemma4_module.gemma4_assistant_unsupported()
needs_gemma4 = pytest.mark.skipif(UNSUPPORTED is not None, reason=str(UNSUPPORTED))
NARROW_WINDOW = 8  # shorter than the test sequences: the sliding layers see only the last 7 cached tokens


@pytest.fixture(scope="module")
def gemma4():
    """`(target, assistant)`, the assistant distilled briefly on the target's greedy continuations of two prompts
    (its drafts there are often accepted); the target's sliding window covers every test sequence."""
    target, assistant = build_gemma4()
    sequences = [plain_generate(target, prompt_ids(name), max_new_tokens=40) for name in ("random", "repetitive")]
    return target, distill_gemma4_assistant(assistant, target, sequences)


@pytest.fixture
def full_attention_caches(monkeypatch):
    """Every speculative call runs with a fresh cache of full-attention layers (what passing `cache=DynamicCache()`
    gives), which batches need: a Gemma 4 target's own cache has sliding-window layers. Exact here: the window covers
    every slot."""
    prepare_cache = decoding_module.prepare_cache
    monkeypatch.setattr(decoding_module, "prepare_cache",
                        lambda cache, config, *args: prepare_cache(DynamicCache(), config, *args))


@needs_gemma4
@pytest.mark.parametrize("window", [None, NARROW_WINDOW], ids=["wide", "narrow"])
@pytest.mark.parametrize("num_draft_tokens", [1, 4])
def test_greedy_output_equals_plain_generate(gemma4, window, num_draft_tokens):
    target, assistant = gemma4
    if window is not None:
        target = build_gemma4(sliding_window=window)[0]  # the same weights
    accepted = 0
    for name in PROMPTS:
        out = speculative_generate(target, prompt_ids(name), hs.Gemma4AssistantDrafter(assistant, num_draft_tokens),
                                   return_dict_in_generate=True, max_new_tokens=30)
        assert out.sequences.tolist() == plain_generate(target, prompt_ids(name), max_new_tokens=30).tolist(), name
        accepted += out.speculative_stats.num_accepted_tokens
    assert accepted > 0


@needs_gemma4
@pytest.mark.parametrize("schedule", ["goodput", "heuristic"])
def test_draft_length_schedules_keep_the_output(gemma4, schedule):
    target, assistant = gemma4
    for name in PROMPTS:
        out = speculative_generate(target, prompt_ids(name), hs.Gemma4AssistantDrafter(assistant),
                                   num_draft_tokens_schedule=schedule)
        assert out.tolist() == plain_generate(target, prompt_ids(name)).tolist(), name


def transformers_draft(target, assistant, input_ids: torch.LongTensor) -> list[int]:
    """The draft of transformers' `SinglePositionMultiTokenCandidateGenerator` after `input_ids` `(1, length)`, from
    the target's forward over every token but the last (its first draft after a prefill)."""
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

    generator = SinglePositionMultiTokenCandidateGenerator(assistant, target.get_input_embeddings(),
                                                           GenerationConfig(max_length=1000))
    with torch.no_grad():
        outputs = target(input_ids[:, :-1], output_hidden_states=True, return_shared_kv_states=True)
    candidates, _ = generator.get_candidates(input_ids, model_kwargs={}, model_outputs=outputs,
                                             is_first_iteration=False, n_last_matches=0)
    return candidates[0, input_ids.shape[1]:].tolist()


@needs_gemma4
def test_drafts_equal_transformers_single_position_generator(gemma4):
    """At batch size 1, greedy, every draft our loop asks for equals transformers' generator's on the same tokens.
    Ours reads the target's keys and values from the loop's cache, which holds the committed tokens only; transformers'
    assisted loop, after a partial rejection, also hands the assistant the first rejected draft token's slot (it
    keeps `new length` slots of the verification forward's states), so its drafts there differ from both."""
    target, assistant = gemma4
    for name in ("random", "repetitive"):
        drafter, ours = recording(hs.Gemma4AssistantDrafter(assistant))
        expected = plain_generate(target, prompt_ids(name))
        assert speculative_generate(target, prompt_ids(name), drafter).tolist() == expected.tolist()
        assert len(ours[0]) >= 5
        for length, (tokens, _) in ours[0].items():
            assert tokens == transformers_draft(target, assistant, expected[:, :length])[: len(tokens)], length


@needs_gemma4
def test_batch_rows_match_their_own_output_and_drafts(gemma4, full_attention_caches):
    target, assistant = gemma4
    drafts = check_rows_alone(target, lambda: hs.Gemma4AssistantDrafter(assistant), eos_settings(target))
    assert any(tokens for row_drafts in drafts.values() for tokens, _ in row_drafts.values())


@needs_gemma4
def test_sampled_chains_are_lossless_per_row(gemma4, full_attention_caches):
    ratios, accepted = sampled_ratios(gemma4[0], hs.Gemma4AssistantDrafter(gemma4[1]))
    assert accepted > 0
    assert all(ratio < 1 for ratio in ratios.values()), ratios


@needs_gemma4
def test_the_sampling_test_catches_a_broken_verifier(gemma4, full_attention_caches, monkeypatch):
    monkeypatch.setattr(rejection_module, "residual_distribution", lambda target_probs, draft_probs: target_probs)
    ratios, _ = sampled_ratios(gemma4[0], hs.Gemma4AssistantDrafter(gemma4[1]), verifier=hs.RejectionVerifier())
    assert any(ratio > 3 for ratio in ratios.values()), ratios


def counting_forwards(model) -> list:
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


@needs_gemma4
def test_a_target_it_was_not_made_for_is_refused_before_any_forward(gemma4):
    llama = build_target("llama")
    calls = counting_forwards(llama)
    with pytest.raises(ValueError, match="drafts for a Gemma 4 target; this target is a LlamaForCausalLM"):
        speculative_generate(llama, prompt_ids("random"), hs.Gemma4AssistantDrafter(gemma4[1]))
    other = build_gemma4()[1]
    other.config.backbone_hidden_size = 48
    calls += counting_forwards(gemma4[0])
    with pytest.raises(ValueError, match="made for a target of hidden size 48; the target's is 32"):
        speculative_generate(gemma4[0], prompt_ids("random"), hs.Gemma4AssistantDrafter(other))
    assert not calls


def test_without_transformers_support_the_method_fails_naming_the_version(tmp_path, monkeypatch):
    """Real on transformers 5.23; on a transformers that supports it, simulated by the support check's answer."""
    if UNSUPPORTED is None:
        monkeypatch.setattr(gemma4_module, "gemma4_assistant_unsupported",
                            lambda: "Gemma 4 assistants need transformers >= 5.24: simulated.")
    config = hs.SpeculativeConfig("gemma4-assistant", draft_model=str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="need transformers >= 5.24"):
        config.build(build_target("llama"))
    with pytest.raises(ValueError, match="need transformers >= 5.24"):
        hs.Gemma4AssistantDrafter(None)


@needs_gemma4
def test_a_saved_assistant_runs_from_the_config_the_cli_and_the_bench(gemma4, tokenizer, tmp_path, capsys):
    """A saved assistant loads by `SpeculativeConfig(method="gemma4-assistant")` (its `num_assistant_tokens` the
    default draft length); `hf-gemma4-assistant` (transformers' own, pinned to the same draft length) and ours run
    side by side in `run_benchmark`, both reproducing plain greedy decoding; the CLI's bench takes the method."""
    target, assistant = gemma4
    assistant.save_pretrained(tmp_path / "assistant")
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    folder = str(tmp_path / "assistant")
    drafter = hs.SpeculativeConfig(method="gemma4-assistant", draft_model=folder).build(target)[0]
    assert isinstance(drafter, hs.Gemma4AssistantDrafter) and drafter.num_draft_tokens == 4
    methods = named_methods(["hf-gemma4-assistant", "gemma4-assistant"], num_draft_tokens=3, gemma4_assistant=folder)
    result = run_benchmark(target, tokenizer, ["to be or not", "the king"], methods, BenchSettings(max_new_tokens=12))
    assert result.ok and not result.skipped
    assert result.summary["all"]["gemma4-assistant"]["mean_acceptance_length"] >= 1
    assert main(["bench", "--model", str(tmp_path / "target"), "--prompts", str(write_prompts(tmp_path)),
                 "--methods", "gemma4-assistant", "--gemma4-assistant", folder, "--max-new-tokens", "8",
                 "--out", str(tmp_path / "bench.jsonl")]) == 0
    assert "gemma4-assistant" in capsys.readouterr().out


def write_prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("to be or not\nthe king\n")
    return path
