"""examples/gpu_check.py, the GPU check: its smoke mode runs every stage on the CPU at tiny sizes, so the command
cannot rot between GPU runs; its pack and its budgets."""

import importlib.util
import json
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import transformers
from packaging import version

from hf_speculators.tools.cli import build_parser

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    sys.path.insert(0, str(EXAMPLES))  # the stages import their sibling module
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = load_example("gpu_check")


def records_by_stage(out: Path) -> dict[str, list[dict]]:
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    return {stage: [r for r in records if r["stage"] == stage] for stage in gpu_check.BUDGETS}


def test_smoke_runs_every_stage(tmp_path):
    code = gpu_check.main(["run", "--smoke", "--out", str(tmp_path), "--stages", ",".join(gpu_check.BUDGETS)])
    assert code == 0, (tmp_path / "log.txt").read_text()[-4000:]  # a failed stage's traceback
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {stage: result["status"] for stage, result in summary.items()} == dict.fromkeys(gpu_check.BUDGETS, "ok")
    records = records_by_stage(tmp_path)
    [tests] = records["tests"]
    assert tests["tests"] > 0 and tests["failures"] == tests["errors"] == 0
    benched = [r for r in records["bench"] if "identical_to_plain" in r]
    assert {(r["method"], r.get("temperature")) for r in benched} == {
        ("plain", None), ("prompt-lookup", None), ("eagle3-tree", None), ("plain", 0.7), ("hybrid", 0.7)}
    assert all(r["identical_to_plain"] for r in benched if r.get("temperature") is None)
    ours = {r["method"]: r for r in records["compiled"] if "identical_to_plain" in r and not r.get("eager_first")}
    assert set(ours) == {"plain", "plain-compiled", "hybrid", "hybrid[eager]"}
    assert all(r["identical_to_plain"] for r in ours.values())
    eager_first = [r for r in records["compiled"] if "identical_to_plain" in r and r.get("eager_first")]
    assert {r["method"] for r in eager_first} == {"plain", "hybrid"}
    assert all(r["identical_to_plain"] for r in eager_first)
    eager_run, run = [r for r in records["compiled"] if "bench_flags" in r]
    assert eager_run["eager_first"] and eager_run["dynamo"] == {}  # nothing compiled before it
    assert run["exit_code"] == 0 and run["dynamo"]["unique_graphs"] >= 2  # plain-compiled's graph and our step's
    first = [(r["method"], r["first_call"]) for r in records["compiled"] if "first_call" in r]
    assert first == [(m, c) for m in ("plain-compiled", "demo-hybrid") for c in range(3)]
    assert not (tmp_path / "partial.jsonl").exists()  # moved into records.jsonl
    compiled = {r["method"]: r for r in records["compiled"] if r.get("method", "").startswith("hf-compiled")}
    assert compiled["hf-compiled-plain"]["identical_to_eager"]
    if version.parse(transformers.__version__) >= version.parse("5.24"):
        assert compiled["hf-compiled-assisted"]["identical_to_eager"]
    else:  # static caches came to assisted decoding in 5.24: the check records the refusal and goes on
        assert "not supported with Static cache" in compiled["hf-compiled-assisted"]["error"]
    costs = load_example("gpu_check_costs")
    curve = [r for r in records["curve"] if r["measure"] == "verify_cost"]
    assert [r["query_tokens"] for r in curve] == list(costs.QUERY_SIZES)
    for stage in ("curve", "curve-compiled"):
        loop = [r for r in records[stage] if r["measure"] == "loop_efficiency" and "accepted" in r]
        assert [r["accepted"] for r in loop] == list(range(costs.NUM_DRAFT_TOKENS + 1))
        assert all(r["identical"] for r in loop)
    assert {r["mode"] for r in records["curve-compiled"]} == {"compiled"}
    assert {r.get("run") for r in records["quant"]} == {"nf4-draft", "int8-draft"}
    with tarfile.open(tmp_path / "draft.tar") as tarball:
        assert "model.safetensors" in tarball.getnames()
    assert len(list(tmp_path.iterdir())) <= 8  # what comes back from the GPU machine


def test_default_stages_fit_one_call():
    assert sum(gpu_check.BUDGETS[stage] for stage in gpu_check.DEFAULT_STAGES) <= 7.5 * 60
    assert gpu_check.parse(["run", "--out", "x"]).stages == list(gpu_check.DEFAULT_STAGES)


def test_training_commands_parse(tmp_path):
    stages = load_example("gpu_check_stages")
    for arguments in stages.TRAININGS.values():
        build_parser().parse_args(stages.training_command(arguments, "data", tmp_path, 1.0, []))


def test_unknown_stage_is_refused(capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["run", "--out", "x", "--stages", "tests,benchmarks"])
    assert "stages are compiled, bench, tests, curve, curve-compiled, quant, train" in capsys.readouterr().err


def test_pack_keeps_the_model_families_the_check_uses(tmp_path):
    with zipfile.ZipFile(tmp_path / "transformers-0-py3-none-any.whl", "w") as wheel:
        for family in ("llama", "bert", "auto"):
            wheel.writestr(f"transformers/models/{family}/__init__.py", "")
        wheel.writestr("transformers/__init__.py", "")
    assert gpu_check.main(["pack", str(tmp_path)]) == 0  # the tracked files and the tarball fit the travel limit
    with tarfile.open(tmp_path / "gpu_check.tar.xz") as tarball:
        names = set(tarball.getnames())
    assert "transformers/models/llama/__init__.py" in names and "transformers/models/auto/__init__.py" in names
    assert not any("bert" in name for name in names)
