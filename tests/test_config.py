"""Tests of SpeculativeConfig without models: validation, model cards, speculators-format configs, vLLM export."""

import json
import re
from dataclasses import fields

import pytest

from hf_speculators import SpeculativeConfig
from hf_speculators.config import presets as presets_module
from hf_speculators.loading import DEMO_DRAFT

# between them these set every field (one method cannot take them all)
FULL_CONFIGS = [
    SpeculativeConfig(
        method="prompt-lookup", num_draft_tokens=10, max_ngram_size=4, min_ngram_size=2, num_candidates=3,
        prefer="earliest", verification="typical", typical_epsilon=0.09, typical_delta=0.3, target_model="org/target", source="a paper",
        notes="line one\nline two",
    ),
    SpeculativeConfig(
        method="draft-model", num_draft_tokens=4, draft_model="org/draft", draft_revision="v1",
        draft_quantization="nf4", verification="top_k", top_k=3, accept_tolerance=1.5, target_model="org/target",
    ),
    SpeculativeConfig(method="layer-skip", exit_layer=4, confidence_threshold=0.4, draft_vocab="org/ranking.json",
                      draft_vocab_size=32768, verification="exact", source="LayerSkip",
                      num_draft_tokens_schedule="goodput"),
    SpeculativeConfig(method="tree", draft_model="org/draft", tree={"paths": [[0], [0, 0], [1]]}),
    SpeculativeConfig(method="eagle3", num_draft_tokens=3, draft_model="org/speculator", draft_revision="main"),
    SpeculativeConfig(method="suffix", num_draft_tokens=12, max_tree_depth=32, max_cached_requests=0,
                      max_spec_factor=1.5, max_spec_offset=1.0, min_token_prob=0.2, use_tree_spec=True),
    SpeculativeConfig(method="lookahead", window_size=3, ngram_size=4, verification_set_size=2),
    SpeculativeConfig(method="hybrid", model_method="eagle3", draft_model="org/speculator", num_draft_tokens=3,
                      max_tree_depth=16),
]


def eagle3_config_json(**proposal) -> dict:
    """A speculators-format config.json shaped like the released EAGLE-3 checkpoints (e.g. RedHatAI's)."""
    return {
        "architectures": ["Eagle3DraftModel"],
        "draft_vocab_size": 32000,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1, "accept_tolerance": 0.0,
                 **proposal}
            ],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "meta-llama/Llama-3.1-8B-Instruct"},
        },
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "transformer_layer_config": {"model_type": "llama", "hidden_size": 4096, "vocab_size": 128256},
    }


def write_json(folder, payload) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(payload), encoding="utf-8")
    return str(folder)


# ---------------------------------------------------------------- construction


def test_defaults_are_prompt_lookup_with_the_drafters_own_defaults():
    config = SpeculativeConfig()
    assert config.to_dict() == {"method": "prompt-lookup"}
    assert [config.resolved(n) for n in ("num_draft_tokens", "max_ngram_size", "min_ngram_size")] == [8, 3, 1]
    assert SpeculativeConfig(method="draft-model", draft_model="x/y").resolved("num_draft_tokens") == 5
    assert SpeculativeConfig(method="layer-skip", exit_layer=2).resolved("num_draft_tokens") == 5


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"method": "medusa-7"}, "method must be one of"),
        ({"num_draft_tokens": 0}, "num_draft_tokens must be an integer >= 1, got 0"),
        ({"num_draft_tokens": "5"}, "num_draft_tokens must be an integer >= 1, got '5'"),
        ({"num_draft_tokens": True}, "num_draft_tokens must be an integer >= 1"),
        ({"max_ngram_size": -1}, "max_ngram_size must be an integer >= 1"),
        ({"max_ngram_size": 2, "min_ngram_size": 3}, "min_ngram_size (3) must not exceed max_ngram_size (2)"),
        ({"method": "layer-skip", "exit_layer": 0}, "exit_layer must be an integer >= 1"),
        ({"method": "layer-skip", "exit_layer": 1, "confidence_threshold": 1},
         "confidence_threshold must be a number >= 0 and < 1, got 1"),
        ({"confidence_threshold": 0.5}, "confidence_threshold does not apply to method='prompt-lookup'"),
        ({"num_candidates": 0}, "num_candidates must be an integer >= 1, got 0"),
        ({"method": "layer-skip", "exit_layer": 1, "draft_vocab_size": 512},
         "draft_vocab_size takes the first ids of a token ranking: set draft_vocab as well"),
        ({"method": "layer-skip", "exit_layer": 1, "draft_vocab": "r.json", "draft_vocab_size": 0},
         "draft_vocab_size must be an integer >= 1"),
        ({"draft_vocab": "r.json"}, "draft_vocab does not apply to method='prompt-lookup'"),
        ({"method": "draft-model", "draft_model": "a/b", "num_candidates": 2},
         "num_candidates does not apply to method='draft-model'"),
        ({"method": "draft-model", "draft_model": "a/b", "draft_quantization": "int3"},
         "draft_quantization must be one of"),
        ({"method": "draft-model", "draft_model": ""}, "draft_model must be a non-empty string"),
        ({"method": "draft-model"}, "draft_model is required for method='draft-model'"),
        ({"method": "layer-skip"}, "exit_layer is required for method='layer-skip'"),
        ({"draft_model": "a/b"}, "draft_model does not apply to method='prompt-lookup'"),
        ({"exit_layer": 3}, "exit_layer does not apply to method='prompt-lookup'"),
        ({"method": "tree", "draft_model": "a/b", "tree": [[0]]}, "tree must be a mapping"),
        ({"verification": "fuzzy"}, "verification must be one of"),
        ({"verification": "typical", "typical_epsilon": 0}, "typical_epsilon must be a number > 0 and <= 1, got 0"),
        ({"verification": "typical", "typical_epsilon": 1.5}, "typical_epsilon must be a number > 0 and <= 1"),
        ({"verification": "typical", "typical_delta": -0.1}, "typical_delta must be a number > 0"),
        ({"verification": "top_k", "top_k": 0}, "top_k must be an integer >= 1"),
        ({"verification": "top_k", "accept_tolerance": -1}, "accept_tolerance must be a number >= 0"),
        ({"verification": "exact", "top_k": 3}, "top_k applies to verification='top_k' only, not to 'exact'"),
        ({"typical_epsilon": 0.1}, "typical_epsilon applies to verification='typical' only, not to None"),
        ({"source": 3}, "source must be a non-empty string"),
        ({"prefer": "middle"}, "prefer must be one of ('latest', 'earliest'), got 'middle'"),
        ({"method": "layer-skip", "exit_layer": 2, "draft_quantization": "int8"},
         "draft_quantization does not apply to method='layer-skip'"),
        ({"num_draft_tokens_schedule": "adaptive"},
         "num_draft_tokens_schedule must be one of ['constant', 'goodput', 'heuristic'], got 'adaptive'"),
    ],
)
def test_out_of_range_and_inconsistent_values_raise_naming_the_field(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SpeculativeConfig(**settings)


def test_from_dict_warns_about_unknown_keys_and_keeps_the_rest():
    with pytest.warns(UserWarning, match=r"unknown speculative_decoding keys \['draft_tokens'\]"):
        config = SpeculativeConfig.from_dict({"method": "prompt-lookup", "draft_tokens": 4, "num_draft_tokens": 6})
    assert config.num_draft_tokens == 6
    with pytest.raises(ValueError, match="must be a mapping"):
        SpeculativeConfig.from_dict(["method", "prompt-lookup"])


def test_override_drops_what_only_the_replaced_method_or_verification_took():
    config = FULL_CONFIGS[1]
    switched = config.override(method="prompt-lookup", max_ngram_size=2)
    assert switched.to_dict() == {"method": "prompt-lookup", "max_ngram_size": 2, "verification": "top_k",
                                  "top_k": 3, "accept_tolerance": 1.5, "target_model": "org/target"}
    assert config.override(verification="rejection").top_k is None
    assert config.override(num_draft_tokens=7).draft_model == "org/draft"  # same method: everything kept
    assert config.num_draft_tokens == 4  # the original is unchanged


# ---------------------------------------------------------------- model cards


def test_the_full_configs_set_every_field():
    set_fields = {name for config in FULL_CONFIGS for name in config.to_dict()}
    assert set_fields == {f.name for f in fields(SpeculativeConfig)}


@pytest.mark.parametrize("config", FULL_CONFIGS, ids=lambda c: c.method)
def test_every_field_round_trips_through_save_pretrained(tmp_path, config):
    card = config.save_pretrained(tmp_path / "preset")
    assert card == tmp_path / "preset" / "README.md"
    assert SpeculativeConfig.from_pretrained(str(tmp_path / "preset")) == config
    assert SpeculativeConfig.from_pretrained(str(card)) == config


def test_the_card_documents_settings_defaults_source_and_vllm(tmp_path):
    config = SpeculativeConfig(num_draft_tokens=6, target_model="org/code-model", source="the PLD repository")
    text = config.save_pretrained(tmp_path / "my-preset").read_text()
    assert text.startswith("---\n") and "speculative_decoding:\n  method: prompt-lookup" in text
    assert "# Speculative decoding preset: my-preset" in text
    assert "| `num_draft_tokens` | `6` |" in text and "| `max_ngram_size` | `3` (drafter default) |" in text
    assert "## Source of the recommended settings\n\nthe PLD repository" in text
    assert "LLM(model='org/code-model', speculative_config={'method': 'ngram'" in text
    assert "hf-speculators generate --preset my-preset" in text


def test_a_card_for_a_method_without_vllm_equivalent_says_so(tmp_path):
    text = FULL_CONFIGS[2].save_pretrained(tmp_path / "ls").read_text()
    assert "Not exportable: method='layer-skip' has no vLLM equivalent" in text
    assert "cannot build" not in text


def test_malformed_yaml_raises_naming_the_file(tmp_path):
    (tmp_path / "README.md").write_text("---\nspeculative_decoding: [method, prompt-lookup\n---\nbody\n")
    with pytest.raises(ValueError, match=r"README.md: malformed YAML front matter"):
        SpeculativeConfig.from_pretrained(str(tmp_path))


def test_a_block_that_is_not_a_mapping_raises(tmp_path):
    (tmp_path / "README.md").write_text("---\nspeculative_decoding: prompt-lookup\n---\nbody\n")
    with pytest.raises(ValueError, match="speculative_decoding must be a mapping of settings"):
        SpeculativeConfig.from_pretrained(str(tmp_path))


def test_a_card_with_invalid_values_raises_naming_the_field(tmp_path):
    card = "---\nspeculative_decoding:\n  method: prompt-lookup\n  num_draft_tokens: -2\n---\n"
    (tmp_path / "README.md").write_text(card)
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 1, got -2"):
        SpeculativeConfig.from_pretrained(str(tmp_path))
    (tmp_path / "README.md").write_text("---\nspeculative_decoding:\n  method: jacobi\n---\n")
    with pytest.raises(ValueError, match="method must be one of .* got 'jacobi'"):
        SpeculativeConfig.from_pretrained(str(tmp_path))


def test_a_folder_without_settings_and_a_missing_path_raise(tmp_path):
    (tmp_path / "README.md").write_text("---\nlicense: mit\n---\nA model card without settings.\n")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="found neither a model card with a `speculative_decoding:` block"):
        SpeculativeConfig.from_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist.*demo-draft-model"):
        SpeculativeConfig.from_pretrained(str(tmp_path / "missing"))


def test_push_to_hub_creates_the_repo_and_uploads_the_card(monkeypatch):
    calls = []

    class FakeHfApi:
        def __init__(self, token=None):
            calls.append(("init", token))

        def create_repo(self, repo_id, private=None, exist_ok=False):
            calls.append(("create_repo", repo_id, private, exist_ok))

        def upload_file(self, path_or_fileobj, path_in_repo, repo_id, commit_message):
            calls.append(("upload_file", path_in_repo, repo_id, commit_message))
            return path_or_fileobj.decode()

    monkeypatch.setattr(presets_module, "HfApi", FakeHfApi)
    config = SpeculativeConfig(num_draft_tokens=4)
    uploaded = config.push_to_hub("me/my-preset", token="hf_x", private=True)
    assert calls == [("init", "hf_x"), ("create_repo", "me/my-preset", True, True),
                     ("upload_file", "README.md", "me/my-preset", "Upload speculative decoding preset")]
    assert "from_pretrained('me/my-preset')" in uploaded and "num_draft_tokens: 4" in uploaded


def test_a_hub_repo_is_read_through_hf_hub_download(monkeypatch, tmp_path):
    """The Hub path with a stand-in download: a card without settings falls back to the speculators config.json."""

    class Missing(Exception):
        pass

    (tmp_path / "README.md").write_text("---\nlicense: apache-2.0\n---\nAn EAGLE-3 speculator.\n")
    write_json(tmp_path, eagle3_config_json())
    requested = []

    def fake_download(repo_id, filename, revision=None, token=None):
        requested.append((repo_id, filename, revision, token))
        return str(tmp_path / filename)

    monkeypatch.setattr(presets_module, "hf_hub_download", fake_download)
    config = SpeculativeConfig.from_pretrained("org/speculator.eagle3", revision="v2", token="hf_x")
    assert requested == [("org/speculator.eagle3", name, "v2", "hf_x") for name in ("README.md", "config.json")]
    assert (config.method, config.draft_model) == ("eagle3", "org/speculator.eagle3")

    def no_files(repo_id, filename, revision=None, token=None):
        raise Missing(filename)

    monkeypatch.setattr(presets_module, "RemoteEntryNotFoundError", Missing)
    monkeypatch.setattr(presets_module, "hf_hub_download", no_files)
    with pytest.raises(ValueError, match="org/empty: found neither"):
        SpeculativeConfig.from_pretrained("org/empty")


# ---------------------------------------------------------------- speculators format


def test_a_speculators_config_maps_onto_the_fields(tmp_path):
    folder = write_json(tmp_path / "speculator", eagle3_config_json())
    config = SpeculativeConfig.from_pretrained(folder)
    assert config.to_dict() == {
        "method": "eagle3", "num_draft_tokens": 3, "draft_model": folder,
        "target_model": "meta-llama/Llama-3.1-8B-Instruct",
        "source": f"speculators-format config.json of {folder} (speculators 0.3.0, proposal method 'greedy')",
    }
    assert SpeculativeConfig.from_pretrained(folder + "/config.json") == config


@pytest.mark.parametrize(("accept_k", "tolerance"), [(3, 0.0), (1, 2.5), (5, 1.0)])
def test_relaxed_speculators_acceptance_becomes_top_k_verification(tmp_path, accept_k, tolerance):
    payload = eagle3_config_json(verifier_accept_k=accept_k, accept_tolerance=tolerance)
    config = SpeculativeConfig.from_pretrained(write_json(tmp_path, payload))
    assert (config.verification, config.top_k, config.accept_tolerance) == ("top_k", accept_k, tolerance)


def test_the_default_proposal_method_is_the_one_read(tmp_path):
    payload = eagle3_config_json()
    payload["speculators_config"]["proposal_methods"].insert(0, {"proposal_type": "sample", "speculative_tokens": 7})
    assert SpeculativeConfig.from_pretrained(write_json(tmp_path, payload)).num_draft_tokens == 3
    payload["speculators_config"]["default_proposal_method"] = "sample"
    assert SpeculativeConfig.from_pretrained(write_json(tmp_path, payload)).num_draft_tokens == 7


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(speculators_model_type="medusa9"), "speculators_model_type='medusa9' is not a speculators"),
        (lambda c: c.pop("speculators_config"), "config.json has no speculators_config mapping"),
        (lambda c: c["speculators_config"].update(proposal_methods=[]), "speculators_config.proposal_methods must"),
        (lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=0),
         "num_draft_tokens must be an integer >= 1, got 0"),
    ],
)
def test_malformed_speculators_configs_raise_naming_the_field(tmp_path, change, message):
    payload = eagle3_config_json()
    change(payload)
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_pretrained(write_json(tmp_path, payload))


def test_malformed_json_raises(tmp_path):
    (tmp_path / "config.json").write_text('{"speculators_model_type": "eagle3",')
    with pytest.raises(ValueError, match="config.json: malformed JSON"):
        SpeculativeConfig.from_pretrained(str(tmp_path))


# ---------------------------------------------------------------- vLLM export


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (SpeculativeConfig(), {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1,
                               "num_speculative_tokens": 8}),
        (SpeculativeConfig(num_draft_tokens=5, max_ngram_size=4, min_ngram_size=2, num_candidates=1,
                           verification="exact"),
         {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2, "num_speculative_tokens": 5}),
        (SpeculativeConfig(method="draft-model", draft_model="org/draft", verification="rejection"),
         {"method": "draft_model", "model": "org/draft", "num_speculative_tokens": 5}),
        (SpeculativeConfig(method="draft-model", draft_model="org/draft", draft_revision="v1",
                           draft_quantization="fp8", num_draft_tokens=3),
         {"method": "draft_model", "model": "org/draft", "revision": "v1", "quantization": "fp8",
          "num_speculative_tokens": 3}),
        (SpeculativeConfig(method="draft-model", draft_model="hf_speculators/demo-draft"),
         {"method": "draft_model", "model": DEMO_DRAFT, "num_speculative_tokens": 5}),
        (SpeculativeConfig(method="eagle3", draft_model="org/speculator", num_draft_tokens=3),
         {"method": "eagle3", "model": "org/speculator", "num_speculative_tokens": 3}),
        (SpeculativeConfig(method="peagle", draft_model="org/speculator"),
         {"method": "eagle3", "parallel_drafting": True, "model": "org/speculator"}),
    ],
)
def test_to_vllm_maps_each_method(config, expected):
    assert config.to_vllm() == expected


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (SpeculativeConfig(method="layer-skip", exit_layer=4), "method='layer-skip' has no vLLM equivalent"),
        (SpeculativeConfig(method="tree", draft_model="a/b", tree={"paths": [[0]]}), "method='tree' has no vLLM"),
        (SpeculativeConfig(num_candidates=4), "num_candidates=4 .* has no vLLM equivalent"),
        (SpeculativeConfig(verification="typical"), "verification='typical' is relaxed"),
        (SpeculativeConfig(verification="top_k", top_k=3), "verification='top_k' is relaxed"),
        (SpeculativeConfig(method="draft-model", draft_model="a/b", draft_quantization="nf4"),
         "draft_quantization='nf4' has no vLLM equivalent"),
        (SpeculativeConfig(method="draft-model", draft_quantization="fp8"),
         "A quantized copy of the target as its draft .* has no vLLM equivalent"),
    ],
)
def test_to_vllm_raises_for_what_vllm_cannot_run(config, message):
    with pytest.raises(ValueError, match=message):
        config.to_vllm()


# ---------------------------------------------------------------- other draft head checkpoints


@pytest.mark.parametrize(
    ("config_json", "expected"),
    [
        ({"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"},
         {"method": "medusa", "target_model": "lmsys/vicuna-7b-v1.3"}),
        ({"medusa_num_heads": 3, "version": "2"}, {"method": "medusa"}),
        ({"architectures": ["LlamaForCausalLM"], "draft_vocab_size": 32000, "hidden_size": 4096},
         {"method": "eagle3"}),
        ({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 4096}, {"method": "eagle3"}),
    ],
)
def test_medusa_and_safeailab_eagle3_checkpoints_load_as_presets(tmp_path, config_json, expected):
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    config = SpeculativeConfig.from_pretrained(str(tmp_path))
    assert config.draft_model == str(tmp_path) and config.source
    assert {key: getattr(config, key) for key in expected} == expected


def test_a_plain_model_config_is_not_a_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    with pytest.raises(ValueError, match="nor a draft checkpoint config.json"):
        SpeculativeConfig.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("method", ["eagle3", "eagle", "medusa"])
def test_head_methods_take_a_checkpoint_and_a_tree(method):
    config = SpeculativeConfig(method=method, draft_model="org/head", tree={"depth": 3}, draft_revision="v1")
    assert config.to_dict()["tree"] == {"depth": 3}
    with pytest.raises(ValueError, match=f"draft_model is required for method='{method}'"):
        SpeculativeConfig(method=method)


@pytest.mark.parametrize("schedule", ["heuristic", "goodput"])
def test_to_vllm_leaves_out_a_schedule_vllm_lacks_with_a_warning(schedule):
    config = SpeculativeConfig(method="draft-model", draft_model="org/draft", num_draft_tokens=6,
                               num_draft_tokens_schedule=schedule)
    with pytest.warns(UserWarning, match=f"num_draft_tokens_schedule='{schedule}' has no vLLM equivalent and is left "
                                         "out: vLLM drafts num_speculative_tokens=6 tokens every step"):
        exported = config.to_vllm()
    assert exported == {"method": "draft_model", "model": "org/draft", "num_speculative_tokens": 6}


def test_a_card_with_a_schedule_notes_what_vllm_runs_instead(tmp_path):
    config = SpeculativeConfig(num_draft_tokens=6, num_draft_tokens_schedule="goodput")
    card = config.save_pretrained(tmp_path).read_text(encoding="utf-8")
    assert "num_draft_tokens_schedule: goodput" in card
    assert "Note: num_draft_tokens_schedule='goodput' has no vLLM equivalent" in card
    assert SpeculativeConfig.from_pretrained(str(tmp_path)) == config
