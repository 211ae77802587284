"""The vLLM check's parts that need no vLLM: finding its environment, the export's folder, the comparisons, and
reading vLLM's counters. Serving itself is tests/test_vllm_serving.py (with the vLLM environment)."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_speculators import SpeculativeConfig
from hf_speculators.loading import load_model
from hf_speculators.metrics import SpeculativeStats
from hf_speculators.tools import cli
from hf_speculators.vllm_check import client
from hf_speculators.vllm_check.check import comparable
from hf_speculators.vllm_check.compare import NEAR_TIE, acceptance_gap, differences, vllm_acceptance


def _worker():
    spec = importlib.util.spec_from_file_location("vllm_worker", client.WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports nothing of vLLM until main() runs
    return module


@pytest.fixture
def no_vllm(monkeypatch, tmp_path):
    monkeypatch.delenv(client.PYTHON_VARIABLE, raising=False)
    monkeypatch.setattr(client, "DEFAULT_ENV", tmp_path / "no-env")


def test_export_check_without_a_vllm_environment_says_how_to_make_one(no_vllm, capsys):
    assert cli.main(["export", "demo-eagle3", "--to", "vllm", "--check"]) == 2
    err = capsys.readouterr().err
    assert "No vLLM environment found" in err and "tests/make_vllm_env.sh" in err and "--vllm-python" in err


def test_export_check_with_a_missing_vllm_python_names_it(no_vllm, tmp_path, capsys):
    missing = tmp_path / "nowhere" / "python"
    assert cli.main(["export", "demo-eagle3", "--to", "vllm", "--check", "--vllm-python", str(missing)]) == 2
    assert f"--vllm-python {missing}: no such file" in capsys.readouterr().err


def test_vllm_python_without_check_is_refused(capsys):
    assert cli.main(["export", "demo-eagle3", "--to", "vllm", "--vllm-python", "python"]) == 2
    assert "--vllm-python applies to --check" in capsys.readouterr().err


def test_the_environment_variable_and_the_default_folder_are_found(no_vllm, monkeypatch, tmp_path):
    assert client.find_vllm_python() is None
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    monkeypatch.setenv(client.PYTHON_VARIABLE, str(python))
    assert client.find_vllm_python() == python
    monkeypatch.delenv(client.PYTHON_VARIABLE)
    monkeypatch.setattr(client, "DEFAULT_ENV", tmp_path / "venv")
    assert client.find_vllm_python() == python


def test_medusa_export_writes_to_a_temporary_folder_not_the_working_directory(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["export", "demo-medusa", "--to", "vllm"]) == 0
    out = capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
    (note,) = [line for line in out.splitlines() if "temporary folder" in line]
    folder = Path(note.split("temporary folder ")[1].split(";")[0])
    assert (folder / "config.json").is_file() and f"'model': '{folder}'" in out


def test_suffix_export_says_that_vllm_needs_arctic_inference(capsys):
    assert cli.main(["export", "demo-suffix", "--to", "vllm"]) == 0
    assert "# note: vLLM's suffix method needs the arctic-inference package" in capsys.readouterr().out


def test_comparable_runs_a_fixed_length_and_exact_verification():
    draft = comparable(SpeculativeConfig.from_pretrained("demo-draft-model"))
    assert draft.num_draft_tokens_schedule == "constant" and draft.num_draft_tokens == 6
    medusa = comparable(SpeculativeConfig.from_pretrained("demo-medusa"))
    assert medusa.verification is None and medusa.typical_epsilon is None
    eagle = SpeculativeConfig.from_pretrained("demo-eagle3")
    assert comparable(eagle) is eagle


def test_differences_give_the_first_differing_position_and_the_margin_there():
    model = load_model("hf_speculators/demo-target")
    prompt, ours = [5, 6, 7], [10, 11, 12]
    assert differences(model, [prompt], [ours], [list(ours)]) == []
    (difference,) = differences(model, [prompt], [ours], [[10, 99, 12]])
    assert (difference.prompt, difference.position) == (0, 1) and difference.margin >= 0
    # one engine stopping sooner differs at its end
    (shorter,) = differences(model, [prompt], [ours], [[10, 11]])
    assert shorter.position == 2 and shorter.near_tie == (shorter.margin < NEAR_TIE)


def test_vllm_acceptance_and_the_gap_to_ours():
    stats = SpeculativeStats()
    for accepted in (3, 1, 0, 2):
        stats.record(3, accepted, accepted + 1)
    counters = {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6,
                "num_accepted_tokens_per_pos": [3, 2, 1]}
    assert vllm_acceptance(counters) == ([0.75, 0.5, 0.25], 2.5)
    assert acceptance_gap(stats, counters) == 0.0
    assert acceptance_gap(stats, {**counters, "num_accepted_tokens_per_pos": [3, 2, 0]}) == 0.25
    assert acceptance_gap(stats, {**counters, "num_accepted_tokens_per_pos": [3, 2]}) == float("inf")
    assert vllm_acceptance({"num_drafts": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": []}) == ([], 1.0)


def test_worker_sums_vllms_counters_over_engines():
    metrics = [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=4),
               SimpleNamespace(name="vllm:spec_decode_num_drafts", value=2),
               SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=5),
               SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[3, 2]),
               SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[1, 0, 1]),
               SimpleNamespace(name="vllm:prompt_tokens", value=100)]
    counters = _worker().read_counters(SimpleNamespace(get_metrics=lambda: metrics))
    assert counters == {"num_drafts": 6, "num_draft_tokens": 0, "num_accepted_tokens": 5,
                        "num_accepted_tokens_per_pos": [4, 2, 1]}


def test_mtp_export_reads_the_layers_from_the_target_and_drafts_one_token_per_layer(tmp_path):
    from transformers import Glm4MoeConfig

    from hf_speculators.config.vllm_export import to_vllm_with_notes

    Glm4MoeConfig(num_mtp_layers=2).save_pretrained(tmp_path)  # the export reads the target's config only
    exported, notes = to_vllm_with_notes(SpeculativeConfig(method="mtp", target_model=str(tmp_path)))
    assert exported == {"method": "mtp", "num_speculative_tokens": 2} and "not Mellum" in notes[0]
    config = SpeculativeConfig(method="mtp", target_model=str(tmp_path), num_draft_tokens=1)
    assert to_vllm_with_notes(config)[0] == {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ValueError, match="vLLM needs num_speculative_tokens"):
        SpeculativeConfig(method="mtp").to_vllm()


def _save_dflash(folder: Path, target_layer_ids: list[int]) -> None:
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    config = MuseGlimmerAssistantConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, block_size=5,
                                        mask_token_id=4095, target_layer_ids=target_layer_ids)
    MuseGlimmerAssistantModel(config).save_pretrained(folder)


def test_dflash_export_writes_the_config_that_vllm_reads(tmp_path):
    import json

    from hf_speculators.config.vllm_export import export

    _save_dflash(tmp_path / "drafter", [1, 3])
    config = SpeculativeConfig(method="dflash", draft_model=str(tmp_path / "drafter"),
                               target_model="hf_speculators/demo-target")
    with pytest.raises(ValueError, match="writes a copy with them"):
        config.to_vllm()
    exported, notes = export(config, tmp_path / "out")
    assert exported == {"method": "dflash", "model": str(tmp_path / "out"), "num_speculative_tokens": 4}
    assert notes == []
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["vocab_size"] == 4096 and written["target_layer_ids"] == [1, 3]
    assert written["dflash_config"] == {"target_layer_ids": [1, 3], "mask_token_id": 4095, "causal": False}
    weights = "model.safetensors"
    assert (tmp_path / "out" / weights).read_bytes() == (tmp_path / "drafter" / weights).read_bytes()


def test_dflash_export_notes_a_drafter_of_the_last_target_layer(tmp_path):
    from hf_speculators.config.vllm_export import export

    _save_dflash(tmp_path / "drafter", [1, 7])  # the demo target has 8 layers
    config = SpeculativeConfig(method="dflash", draft_model=str(tmp_path / "drafter"),
                               target_model="hf_speculators/demo-target", num_draft_tokens=2)
    exported, notes = export(config, tmp_path / "out")
    assert exported["num_speculative_tokens"] == 2
    assert len(notes) == 1 and "before the final norm" in notes[0]
    with pytest.raises(ValueError, match="set target_model"):
        export(SpeculativeConfig(method="dflash", draft_model=str(tmp_path / "drafter")), tmp_path / "out2")


def test_prompts_without_check_is_refused(capsys):
    assert cli.main(["export", "demo-eagle3", "--to", "vllm", "--prompts", "p.jsonl"]) == 2
    assert "--prompts applies to --check" in capsys.readouterr().err


def test_export_check_serves_the_users_prompts(monkeypatch, tmp_path, capsys):
    """`--prompts FILE` reaches the check (vLLM itself replaced: tests/test_vllm_serving.py serves)."""
    prompts = tmp_path / "mine.txt"
    prompts.write_text("one prompt\n")
    seen = {}

    def fake_check(config, exported, vllm_python=None, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(cli, "require_vllm_python", lambda python: None)
    monkeypatch.setattr(cli, "check_export", fake_check)
    assert cli.main(["export", "demo-eagle3", "--to", "vllm", "--check", "--prompts", str(prompts)]) == 1
    assert seen == {"prompts": str(prompts)} and "stop here" in capsys.readouterr().err


@pytest.mark.parametrize("compiled", [False, True])
def test_the_bench_compiles_both_engines_or_neither_and_times_the_passes_after_warm_up(monkeypatch, compiled):
    from hf_speculators.vllm_check import bench

    ours, sent = [], []
    monkeypatch.setattr(bench, "_ours", lambda model, prompts, **kwargs: ours.append(
        (len(prompts), kwargs["max_new_tokens"], kwargs["batch"], kwargs["compiled"])) or (2.0, 8))
    served = {"vllm_version": "x", "outputs": [[1] * 4, [2] * 4], "startup_seconds": 1.0,
              "counters": {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                           "num_accepted_tokens_per_pos": []}}
    monkeypatch.setattr(bench, "run_vllm", lambda request, python: sent.append(request) or {
        **served, "pass_seconds": [9.0] * (len(request["passes"]) - 2) + [3.0, 4.0]})
    record = bench.measure(None, None, [[5, 6], [7]], 4, 0, "target", compiled=compiled)
    warm_up = [(2, 4, False, True), (2, 4, True, True)] if compiled else [(1, 8, False, False)]
    assert ours == [*warm_up, (2, 4, False, compiled), (2, 4, True, compiled)]
    assert sent[0]["enforce_eager"] is not compiled
    assert sent[0]["passes"] == (["batch", "each", "each", "batch"] if compiled else ["batch", "each", "batch"])
    assert record["compiled"] is compiled
    assert record["vllm"]["batch1_seconds_per_prompt"] == 1.5 and record["vllm"]["batch8_tokens_per_second"] == 2.0
