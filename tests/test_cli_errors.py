"""Every subcommand given bad input ends in one clear line on stderr and exit status 2, never a traceback; an
interrupted bench keeps every record it measured, and --resume finishes it."""

import json

import huggingface_hub.constants
import pytest
import torch

torch.set_num_threads(1)

from tiny_models import build_draft, build_target, build_tokenizer  # noqa: E402

from hf_speculators.tools import cli  # noqa: E402
from hf_speculators.tools.bench import run as bench_run  # noqa: E402
from hf_speculators.loading import DEMO_DRAFT  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Tiny saved models, a folder that is not a model, a draft with corrupted weights, and input files."""
    root = tmp_path_factory.mktemp("cli_errors")
    paths = {name: root / name for name in ("target", "draft", "not-a-model", "corrupted")}
    for name, model in (("target", build_target("llama")), ("draft", build_draft("llama"))):
        model.save_pretrained(paths[name])
        build_tokenizer().save_pretrained(paths[name])
    paths["not-a-model"].mkdir()
    (paths["not-a-model"] / "notes.txt").write_text("hello")
    paths["corrupted"].mkdir()
    for file in (paths["draft"]).iterdir():
        (paths["corrupted"] / file.name).write_bytes(file.read_bytes())
    weights = paths["corrupted"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a download cut short
    files = {"prompts": ("prompts.txt", "abcab abcab\nxyzxy xyz\n"), "empty": ("empty.txt", "\n"),
             "bad": ("bad.jsonl", "{not json\n"), "records": ("records.jsonl", '{"a": 1}\n')}
    for name, (filename, text) in files.items():
        paths[name] = root / filename
        paths[name].write_text(text)
    return {name: str(path) for name, path in paths.items()} | {"missing": str(root / "missing.jsonl")}


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def run(argv: list[str], capsys) -> tuple[int, str]:
    """`hf-speculators ARGV` in this process: (exit status, stderr)."""
    capsys.readouterr()
    try:
        status = cli.main(argv)
    except SystemExit as exit:  # argparse's usage errors
        status = exit.code
    return status, capsys.readouterr().err


MODELS = ["--model", "{target}", "--draft", "{draft}", "--max-new-tokens", "4", "--threads", "1"]
BENCH = ["bench", "--prompts", "{prompts}", *MODELS, "--out", "{root}/bench.jsonl"]
# (command line, a part of the message); "{name}" is a path of the `files` fixture
BAD_INPUTS = [
    ([], "the following arguments are required: command"),
    (["generate"], "the following arguments are required: prompt"),
    (["generate", ""], "the prompt is empty"),
    (["generate", "   "], "the prompt is empty"),
    (["generate", "x", "--device", "cuda"], "device 'cuda' is not available"),
    (["generate", "x", "--device", "gpu"], "device 'gpu' is not a torch device"),
    (["generate", "x", "--device", "cuda:7"], "device 'cuda:7' is not available"),
    (["generate", "x", "--max-new-tokens", "0"], "--max-new-tokens: expected an integer >= 1, got '0'"),
    (["generate", "x", "--max-new-tokens", "many"], "--max-new-tokens: expected an integer >= 1, got 'many'"),
    (["generate", "x", "--num-draft-tokens", "-1"], "--num-draft-tokens: expected an integer >= 1"),
    (["generate", "x", "--temperature", "0"], "--temperature: expected a number > 0"),
    (["generate", "x", "--temperature", "nan"], "--temperature: expected a number > 0"),
    (["generate", "x", "--top-p", "1.5"], "--top-p: expected a number > 0 and <= 1"),
    (["generate", "x", "--top-k", "-2"], "--top-k: expected an integer >= 0"),
    (["generate", "x", "--seed", "-1"], "--seed: expected an integer >= 0"),
    (["generate", "x", "--threads", "0"], "--threads: expected an integer >= 1"),
    (["generate", "x", "--confidence-threshold", "1"], "--confidence-threshold: expected a number >= 0 and < 1"),
    (["generate", "x", "--dtype", "fp64"], "--dtype: invalid choice: 'fp64'"),
    (["generate", "x", "--method", "jacobi"], "--method: invalid choice: 'jacobi'"),
    (["generate", "x", "--verifier", "greedy"], "--verifier: invalid choice: 'greedy'"),
    (["generate", "x", "--quantization", "fp8"], "quantization='fp8' needs a CUDA GPU"),
    (["generate", "x", "--preset", "no-such-preset"], "No bundled preset 'no-such-preset'; bundled are demo-"),
    (["generate", "x", "--preset", "./missing-card"], "'./missing-card' does not exist"),
    (["generate", "x", "--model", "{not-a-model}"], "holds none of tokenizer.json, tokenizer_config.json"),
    (["generate", "x", "--model", "/no/such/folder"], "path '/no/such/folder' does not exist"),
    (["generate", "x", "--model", "nobody/no-such-model"], "cannot be fetched from the Hub"),
    (["generate", "x", "--preset", "demo-draft-model", "--draft", "{corrupted}"],
     "cannot be read, its files may be corrupted or incomplete"),
    (["generate", "x", "--eagle-head", DEMO_DRAFT], "--eagle-head names the head of a eagle3 or eagle method"),
    (["generate", "x", "--preset", "demo-prompt-lookup", "--method", "draft-model"],
     "draft_model is required for method='draft-model'"),
    (["generate", "x", "--method", "layer-skip"], "exit_layer is required for method='layer-skip'"),
    (["generate", "x", "--preset", "demo-prompt-lookup", "--min-ngram-size", "4", "--max-ngram-size", "2"],
     "must not exceed max_ngram_size"),
    (["generate", "x", "--draft-vocab", "{missing}", "--method", "layer-skip", "--exit-layer", "1"],
     "is not a file"),
    (["generate", "x", "--verifier", "typical", "--verification", "exact"], "disagree: pass --verifier only"),
    (["bench", "--prompts", "{missing}"], "Prompts file"),
    (["bench", "--prompts", "{empty}"], "has no prompts"),
    (["bench", "--prompts", "{bad}"], "not JSON"),
    (["bench", "--prompts", "{prompts}", "--methods", "plain,jacobi"], "Unknown benchmark methods ['jacobi']"),
    (["bench", "--prompts", "{prompts}", "--methods", "layer-skip"], "need an exit layer"),
    (["bench", "--prompts", "{prompts}", "--limit", "0"], "--limit: expected an integer >= 1"),
    (["bench", "--prompts", "{prompts}", "--compare-eager"], "pass --compile too"),
    (["bench", "--prompts", "{prompts}", "--batch-size", "0"], "--batch-size: expected an integer >= 1"),
    (["bench", "--prompts", "{prompts}", "--variants", "goodput:x"], "expected comma-separated K or SCHEDULE:K"),
    (["bench", "--prompts", "{prompts}", "--draft-vocab-size", "3"], "pass --draft-vocab as well"),
    (["bench", "--prompts", "{prompts}", "--verifier", "exact", "--do-sample"], "cannot sample"),
    (["bench", "--prompts", "{prompts}", "--model", "{not-a-model}"], "holds none of"),
    (["bench", "--prompts", "{prompts}", "--model", "{target}", "--draft", "{corrupted}", "--threads", "1"],
     "cannot be read"),
    (["bench", "--prompts", "{prompts}", "--draft-quantization", "int8", "--methods", "prompt-lookup"],
     "no method chosen uses one"),
    ([*BENCH, "--resume", "--methods", "prompt-lookup"], "written by another run"),
    (["sweep", "--prompts", "{missing}"], "Prompts file"),
    (["sweep", "--prompts", "{prompts}", "--typical-settings", "a,b"], "expected comma-separated EPSILON"),
    (["sweep", "--prompts", "{prompts}", "--top-k-settings", "2"], "expected comma-separated TOP_K:TOLERANCE"),
    (["sweep", "--prompts", "{prompts}", "--method", "hf-assisted"], "--method: invalid choice"),
    (["plot", "{missing}"], "Records file"),
    (["plot", "{records}"], "not a benchmark record"),
    (["plot", "{bad}"], "not JSON"),
    (["presets", "show", "no-such-preset"], "No bundled preset 'no-such-preset'"),
    (["presets", "--bogus"], "unrecognized arguments: --bogus"),
    (["export", "no-such-preset", "--to", "vllm"], "No bundled preset 'no-such-preset'"),
    (["export", "demo-prompt-lookup"], "the following arguments are required: --to"),
    (["export", "demo-prompt-lookup", "--to", "tgi"], "--to: invalid choice: 'tgi'"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUTS, ids=[" ".join(argv)[:60] for argv, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_status_2(files, offline, tmp_path, capsys, argv, message):
    if "written by another run" in message:  # a records file of another run to resume
        (tmp_path / "bench.jsonl").write_text(json.dumps({"provenance": {"run": {}}, "batch_index": 0}) + "\n")
    argv = [part.format(root=tmp_path, **files) for part in argv]
    status, err = run(argv, capsys)
    lines = err.strip().splitlines()
    assert status == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert message in lines[0], lines[0]
    assert lines[0].startswith("hf-speculators")


def test_verbose_adds_the_traceback(files, offline, capsys):
    status, err = run(["generate", "x", "--model", files["not-a-model"], "--verbose"], capsys)
    assert status == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("hf-speculators generate")


def test_a_failure_during_the_run_is_exit_status_1(files, monkeypatch, tmp_path, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("the kernel crashed")

    monkeypatch.setattr(bench_run, "timed_generate", broken)
    status, err = run([part.format(root=tmp_path, **files) for part in BENCH], capsys)
    assert status == 1 and err.strip() == ("hf-speculators bench: failed: RuntimeError: the kernel crashed "
                                           "(--verbose shows the traceback)")


def test_the_deprecated_verification_flag_warns_and_works(files, capsys):
    args = cli.build_parser().parse_args(["generate", "x", "--verification", "typical"])
    assert cli._verifier(args) == "typical"
    assert "--verification is deprecated, use --verifier" in capsys.readouterr().err


def test_an_interrupted_bench_keeps_its_records_and_resume_finishes_it(files, monkeypatch, tmp_path, capsys):
    argv = [part.format(root=tmp_path, **files) for part in BENCH] + ["--methods", "prompt-lookup,draft-model"]
    out = tmp_path / "bench.jsonl"
    timed, calls = bench_run.timed_generate, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3 + 3 + 2:  # warm-up (3 methods), the first prompt (3), then Ctrl-C on the second
            raise KeyboardInterrupt
        return timed(*args, **kwargs)

    monkeypatch.setattr(bench_run, "timed_generate", interrupted)
    status, err = run(argv, capsys)
    assert status == 130 and "rerun the same command with --resume" in err and "Traceback" not in err
    kept = [json.loads(line) for line in out.read_text().splitlines()]  # every line is a whole record
    assert [(r["prompt_index"], r["method"]) for r in kept] == [
        (0, "plain"), (0, "prompt-lookup"), (0, "draft-model"), (1, "plain")]

    monkeypatch.setattr(bench_run, "timed_generate", timed)
    out.write_text(out.read_text() + '{"question_id": null, "prom')  # and a line cut by a killed process
    status, _ = run(argv + ["--resume"], capsys)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert status == 0
    assert [(r["prompt_index"], r["method"]) for r in records] == [
        (i, m) for i in range(2) for m in ("plain", "prompt-lookup", "draft-model")]
    assert records[:3] == kept[:3]  # the complete first prompt was kept, not measured again
