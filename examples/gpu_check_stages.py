"""The stages of the GPU check, one per process (`examples/gpu_check.py` runs them, each within its budget):

- `tests`: `tests/test_device.py` on the device (`pytest --device`), its report in `tests.xml`;
- `compiled`: our compiled decoding (`hf-speculators bench --compile --compare-eager`: the default job, then the
  draft model, prompt lookup and the EAGLE-3 head, after one eager run of them all before anything is compiled)
  beside transformers' compiled plain decoding, the dynamo graphs each run compiled, the first calls' seconds (the
  compile time per call), then transformers' compiled plain and static-cache assisted decoding against its eager
  output;
- `bench`: the demo family through `hf-speculators bench`, eager: greedy at batch 1 and 8, sampling at batch 1;
- `curve`: the verify cost curve and the loop's efficiency on a 1B target (`gpu_check_costs.py`);
- `curve-compiled`: the loop's efficiency on the 1B target with plain decoding and ours both compiled;
- `quant`: an FP8 target and an int4 draft (torchao), each method against the same quantized model's plain output;
- `train`: the demo EAGLE-3 head, Medusa heads and draft model trained for a fixed time; their files in a tarball
  each.

Each stage appends its records (each with `stage`) to `OUT/records.jsonl`; a bench run writes its records to
`OUT/partial.jsonl` as it measures them and moves them there when it ends, so a run stopped at the stage's budget
leaves what it measured. With `--smoke` the sizes are tiny, and the compiled runs use dynamo's `"eager"` backend
(graphs captured and guarded as under inductor, no code generated) so that the smoke stays within seconds.
"""

import argparse
import email
import json
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path
from xml.etree import ElementTree

import pytest
import torch
import transformers
from torch._dynamo.utils import counters
from gpu_check_costs import clock, loop_efficiency, target_1b, verify_cost_curve

import hf_speculators as hs
from hf_speculators.config.build import build_drafter
from hf_speculators.loading import DEMO_DRAFT, DEMO_TARGET, load_model, load_tokenizer
from hf_speculators.tools.bench import read_records
from hf_speculators.tools.bench import run as bench_run
from hf_speculators.tools.bench.engines import compiled_kwargs
from hf_speculators.tools.cli import main as cli

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [  # the demo family's domains: verse, grade-school arithmetic, Python
    ("verse", "First Citizen:\nBefore we proceed any further, hear me speak."),
    ("verse", "ROMEO:\nBut soft, what light through yonder window breaks?"),
    ("math", "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
             "How many clips did Natalia sell altogether in April and May?"),
    ("math", "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
             "How much did she earn?"),
    ("code", "def read_config(path):\n    "),
    ("code", "class LRUCache:\n    def __init__(self, capacity):\n        "),
    ("code", "import json\n\n\ndef load(path):\n    "),
    ("code", "for line in open(path):\n    "),
]
BENCH_METHODS = "plain,hf-prompt-lookup,hf-assisted,prompt-lookup,suffix,draft-model,eagle3,eagle3-tree,hybrid"
SAMPLING_METHODS = "plain,prompt-lookup,draft-model,hybrid"  # at temperature 0.7, seeded
# our compiled runs, the default job (`hf-speculators generate`'s preset) first; EAGLE-3's target steps compile (its
# features through `output_hidden_states`), its head runs eagerly
COMPILED_RUNS = ("hybrid", "draft-model,prompt-lookup,eagle3")
DEFAULT_PRESET = "demo-hybrid"
FIRST_CALLS = 3  # calls of one prompt timed one by one: the first compiles
COMPILED_PROMPTS = 4  # each prompt length compiles anew (the static cache's length follows it)
COMPILE_SECONDS = 30  # what one prompt's compilations may take
QUANTIZED_RUNS = {  # name -> bench flags; each method is compared with the same quantized target's plain output
    "fp8-target": (["--quantization", "fp8", "--dtype", "bfloat16"], "plain,prompt-lookup,draft-model"),
    "int4-draft": (["--draft-quantization", "int4"], "plain,draft-model"),
}
SMOKE_QUANTIZED_RUNS = {"int8-draft": (["--draft-quantization", "int8"], "plain,draft-model")}
NOT_RUN = {"nf4-draft": "bitsandbytes' wheel (43 MB) does not fit in what travels to the GPU machine"}
TRAININGS = {  # name -> `hf-speculators train` arguments after the name
    "eagle3": ["eagle3", "--init", "hf_speculators/demo-eagle3", "--draft-vocab-size", "1024"],
    "medusa": ["medusa", "--init", "hf_speculators/demo-medusa"],
    "draft": ["draft", "--draft", "hf_speculators/demo-draft"],
}


class Stage:
    """Where a stage writes (`out`), on which device, within how many seconds, at which sizes."""

    def __init__(self, name: str, out: Path, device: str, budget: float, smoke: bool):
        self.name, self.out, self.device, self.budget, self.smoke = name, out, device, budget, smoke
        self.start = time.perf_counter()

    def left(self) -> float:
        """Seconds left of the stage's budget."""
        return self.budget - (time.perf_counter() - self.start)

    def record(self, **fields) -> None:
        """Appends one record, `fields` and the stage's name, to `OUT/records.jsonl`."""
        with open(self.out / "records.jsonl", "a", encoding="utf-8") as file:
            file.write(json.dumps({"stage": self.name, **fields}) + "\n")

    def bench(self, flags: list[str], methods: str, **fields) -> int:
        """`hf-speculators bench` of `methods` on the check's prompts with `flags`; its records appended with
        `fields`. When the run fails, each method it left without a record runs again alone, so that one broken
        method does not lose the others' figures."""
        code, measured = self._bench([*flags, "--methods", methods], fields)
        if code:
            for method in methods.split(","):
                if method not in measured and method != "plain":
                    code = max(code, self._bench([*flags, "--methods", f"plain,{method}"], fields)[0])
        return code

    def _bench(self, flags: list[str], fields: dict) -> tuple[int, set[str]]:
        """One `hf-speculators bench` run, its records written to `OUT/partial.jsonl` as they are measured and moved
        to `OUT/records.jsonl` (with `fields`) when it ends; its exit status and the methods it recorded."""
        records = self.out / "partial.jsonl"
        records.unlink(missing_ok=True)
        with tempfile.TemporaryDirectory() as folder:
            prompts = Path(folder) / "prompts.jsonl"
            lines = [json.dumps({"category": c, "prompt": p}) for c, p in PROMPTS[: 1 if self.smoke else None]]
            prompts.write_text("\n".join(lines) + "\n", encoding="utf-8")
            start = time.perf_counter()
            code = cli(["bench", "--prompts", str(prompts), "--device", self.device, "--out", str(records),
                        "--max-new-tokens", "4" if self.smoke else "64", *flags])
        written = read_records(records) if records.exists() and records.stat().st_size else []
        for record in written:
            self.record(**fields, **record)
        records.unlink(missing_ok=True)
        self.record(**fields, bench_flags=flags, exit_code=code, wall_seconds=round(time.perf_counter() - start, 1),
                    dynamo=dict(counters["stats"]))
        return code, {record.get("method") for record in written}


def tests(stage: Stage) -> int:
    """`tests/test_device.py` on the device (two of its tests in a smoke run); the counts and bf16 near-ties."""
    report = stage.out / "tests.xml"
    selection = ["-k", "rejection_identity or fp32_tree_masks"] if stage.smoke else []
    code = pytest.main([str(REPO / "tests" / "test_device.py"), "--device", stage.device, "-q", "-p",
                        "no:cacheprovider", f"--junitxml={report}", "-o", "junit_family=xunit1", *selection])
    suite = ElementTree.parse(report).getroot().find("testsuite")
    near_ties = sum(int(p.get("value")) for p in suite.iter("property") if p.get("name") == "near_ties")
    counts = {name: int(suite.get(name)) for name in ("tests", "failures", "errors", "skipped")}
    stage.record(**versions(stage.device), **counts, bf16_near_ties=near_ties)
    return int(code)


def versions(device: str) -> dict:
    """What the stages ran with: torch, transformers (the carried release or the installed one) and the device."""
    name = torch.cuda.get_device_name() if device == "cuda" else device
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "transformers_from": str(Path(transformers.__file__).parent), "device_name": name}


def bench(stage: Stage) -> int:
    """The demo family's methods eagerly: greedy at batch 1, sampling at batch 1 (temperature 0.7, seeded), greedy
    at batch 8 (in a smoke run 3 methods greedy at batch 1 and 2 sampling)."""
    methods = "plain,prompt-lookup,eagle3-tree" if stage.smoke else BENCH_METHODS
    sampling = ["--do-sample", "--temperature", "0.7", "--seed", "0"]
    codes = [stage.bench(["--batch-size", "1"], methods, batch_size=1),
             stage.bench(["--batch-size", "1", *sampling], "plain,hybrid" if stage.smoke else SAMPLING_METHODS,
                         batch_size=1, temperature=0.7)]
    if not stage.smoke:
        codes.append(stage.bench(["--batch-size", "8"], methods, batch_size=8))
    return max(codes)


def compiled(stage: Stage) -> int:
    """Our compiled decoding against transformers' compiled plain decoding, each method also eagerly
    (`--compile --compare-eager`), each run from a fresh dynamo cache (`torch._dynamo.reset`: a run's graphs count
    towards dynamo's limit per code object, `recompile_limit`), after one eager run of the same methods (records with
    `eager_first`) before any compilation; then the first calls' seconds and transformers' compiled baselines while
    the budget lasts."""
    stage.record(**versions(stage.device))
    # the same methods eagerly before anything is compiled in this process: on CUDA our `[eager]` runs beside
    # compiled ones ran at 0.23-0.58x eager plain where a process without compilation ran 1.40x (third check)
    codes = [stage.bench([], ",".join(COMPILED_RUNS[:1] if stage.smoke else COMPILED_RUNS), eager_first=True)]
    for methods in COMPILED_RUNS[:1] if stage.smoke else COMPILED_RUNS:
        codes.append(compiled_run(stage, methods, "reduce-overhead"))
        if codes[-1] and not stage.smoke:  # say CUDA graphs broke it: inductor without them, for the figures
            compiled_run(stage, methods, "default")
    for measure in (first_calls, compiled_baselines):
        torch._dynamo.reset()
        try:
            measure(stage)
        except Exception as error:  # recorded, so that the stage's other figures still come back
            traceback.print_exc()
            stage.record(measure=measure.__name__, error=f"{type(error).__name__}: {error}")
            codes.append(1)
    return max(codes)


def compiled_run(stage: Stage, methods: str, mode: str) -> int:
    """`hf-speculators bench --compile --compare-eager --verbose` of `methods` (a failure's traceback in the log),
    compiled as `stage_compile_kwargs` says with `mode`, from a fresh dynamo cache; its exit status."""
    torch._dynamo.reset()
    counters.clear()
    bench_run.compiled_kwargs = lambda target: stage_compile_kwargs(stage, target, mode)
    try:
        return stage.bench(["--compile", "--compare-eager", "--verbose"], methods, compiled=True, compile_mode=mode)
    finally:
        bench_run.compiled_kwargs = compiled_kwargs


def stage_compile_kwargs(stage: Stage, target, mode: str = "reduce-overhead") -> dict:
    """The bench's compiled `generate` keywords (`engines.compiled_kwargs`) with torch.compile's `mode`
    (transformers' default `"reduce-overhead"`: CUDA graphs); in a smoke run with dynamo's `"eager"` backend
    instead (inductor takes minutes on a CPU: the graphs are captured and guarded, no code is generated)."""
    kwargs = compiled_kwargs(target)
    config = kwargs["compile_config"]
    config.backend, config.mode = ("eager", None) if stage.smoke else (config.backend, mode)
    return kwargs


def first_calls(stage: Stage) -> None:
    """The seconds of `FIRST_CALLS` calls, one after another, of the first prompt with transformers' compiled plain
    decoding and with our default job compiled (`DEFAULT_PRESET`'s drafter, its memory across calls cleared before
    each call so that none drafts from an earlier one's output), and the dynamo graphs after each: the first call's
    time less a later one's is the compile time per call."""
    target = hs.enable(load_model(DEMO_TARGET, "float32", stage.device))
    tokenizer, new_tokens = load_tokenizer(DEMO_TARGET), 4 if stage.smoke else 64
    compile_kwargs = stage_compile_kwargs(stage, target)
    drafter = build_drafter(hs.SpeculativeConfig.from_pretrained(DEFAULT_PRESET), target, tokenizer)
    runs = {"plain-compiled": {}, DEFAULT_PRESET: {"candidate_generator": drafter, "tokenizer": tokenizer}}
    input_ids = tokenizer(PROMPTS[1][1], return_tensors="pt").input_ids.to(stage.device)
    for method, kwargs in runs.items():
        for call in range(FIRST_CALLS):
            if stage.left() < COMPILE_SECONDS:
                stage.record(method=method, first_call=call, skipped="the stage's budget ran out")
                return
            drafter.clear_cache()
            seconds, output = timed(stage.device, lambda: target.generate(  # noqa: B023 (called at once)
                input_ids, do_sample=False, max_new_tokens=new_tokens, **compile_kwargs, **kwargs), repeats=1)
            stage.record(method=method, first_call=call, seconds=round(seconds, 4),
                         new_tokens=output.shape[1] - input_ids.shape[1], dynamo=dict(counters["stats"]))


def compiled_baselines(stage: Stage) -> None:
    """transformers' compiled decoding (a static cache; transformers compiles its forwards on CUDA, a CPU runs the
    same path uncompiled) against its eager greedy output: plain, and assisted by the demo draft (3 draft tokens)."""
    target, draft = (load_model(name, "auto", stage.device) for name in (DEMO_TARGET, DEMO_DRAFT))
    draft.generation_config.update(num_assistant_tokens=3, num_assistant_tokens_schedule="constant",
                                   assistant_confidence_threshold=0.0)
    tokenizer, new_tokens = load_tokenizer(DEMO_TARGET), 4 if stage.smoke else 64
    runs = {"hf-compiled-plain": {}, "hf-compiled-assisted": {"assistant_model": draft}}
    for category, prompt in PROMPTS[: 1 if stage.smoke else COMPILED_PROMPTS]:
        if stage.left() < COMPILE_SECONDS:  # a compilation may not finish: keep what the budget has measured
            stage.record(method="hf-compiled", skipped="the stage's budget ran out")
            return
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids.to(stage.device)
        eager = target.generate(input_ids, do_sample=False, max_new_tokens=new_tokens)
        for method, kwargs in runs.items():
            try:
                seconds, output = timed(stage.device, lambda: target.generate(  # noqa: B023 (called at once)
                    input_ids, do_sample=False, max_new_tokens=new_tokens, cache_implementation="static", **kwargs))
            except Exception as error:  # a release that cannot compile this path: say so, keep the others
                stage.record(method=method, category=category, error=f"{type(error).__name__}: {error}")
                continue
            stage.record(method=method, category=category, seconds=round(seconds, 4), identical_to_eager=bool(
                torch.equal(output, eager)), new_tokens=output.shape[1] - input_ids.shape[1])


def timed(device: str, call, repeats: int = 2):
    """The seconds of the last of `repeats` calls of `call` (the first ones warm up and compile) and its result."""
    for _ in range(repeats):
        start = clock(device)
        result = call()
        seconds = clock(device) - start
    return seconds, result


def quant(stage: Stage) -> int:
    """The quantized runs (an int8 draft on the CPU in a smoke run); the modes that cannot run, with the reason."""
    for name, reason in NOT_RUN.items():
        if name.endswith("-draft"):
            stage.record(run=name, skipped=reason)
    runs = SMOKE_QUANTIZED_RUNS if stage.smoke else QUANTIZED_RUNS
    return max(stage.bench(flags, methods, run=name) for name, (flags, methods) in runs.items())


def train(stage: Stage) -> int:
    """Each training for an equal share of the budget (less loading); each output's top-level files tarred. A smoke
    run trains the draft alone (the suite's training tests cover the heads' trainers)."""
    data = str(Path(email.__file__).parent)  # the standard library's email package (28 files): Python code
    sizes = (["--max-steps", "1", "--max-prompts", "4", "--held-out", "1", "--max-new-tokens", "8", "--eval-tokens",
              "4"] if stage.smoke else ["--max-prompts", "256", "--held-out", "4", "--max-new-tokens", "64"])
    trainings = {"draft": TRAININGS["draft"]} if stage.smoke else TRAININGS
    codes = []
    for index, (name, arguments) in enumerate(trainings.items()):
        minutes = max(stage.left() / (len(trainings) - index) - 10, 5) / 60
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / name
            start = time.perf_counter()
            codes.append(cli(training_command(arguments, data, out, minutes, sizes)))
            files = sorted(path for path in out.glob("*") if path.is_file())
            with tarfile.open(stage.out / f"{name}.tar", "w") as tarball:
                for path in files:
                    tarball.add(path, path.name)
            stage.record(model=name, exit_code=codes[-1], seconds=round(time.perf_counter() - start, 1),
                         files=[path.name for path in files], bytes=(stage.out / f"{name}.tar").stat().st_size)
    return max(codes)


def training_command(arguments: list[str], data: str, out: Path, minutes: float, sizes: list[str]) -> list[str]:
    """`hf-speculators train` on `data` for the demo target, written to `out` after `minutes`."""
    return ["train", *arguments, "--target", "hf_speculators/demo-target", "--data", data, "--out", str(out),
            "--max-minutes", f"{minutes:.2f}", "--save-dtype", "float16", "--eval-every", "1000000", *sizes]


def curve(stage: Stage) -> int:
    """The verify cost curve and the loop's efficiency on one 1B target (`gpu_check_costs.py`)."""
    model = target_1b(stage.device, stage.smoke)
    loop_efficiency(stage, model, verify_cost_curve(stage, model))
    return 0


def curve_compiled(stage: Stage) -> int:
    """The loop's efficiency on the 1B target, plain decoding and ours both compiled (`stage_compile_kwargs`),
    against the upper-bound ideal of n + 1 tokens per step (`gpu_check_costs.loop_efficiency`)."""
    model = target_1b(stage.device, stage.smoke)
    loop_efficiency(stage, model, None, **stage_compile_kwargs(stage, model))
    return 0


STAGES = {"tests": tests, "compiled": compiled, "bench": bench, "curve": curve, "curve-compiled": curve_compiled,
          "quant": quant, "train": train}


def main(argv: list[str] | None = None) -> int:
    """Runs one stage (`STAGES`) with torch's seed 0; returns its exit status."""
    parser = argparse.ArgumentParser(description="one stage of examples/gpu_check.py")
    parser.add_argument("stage", choices=list(STAGES))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget", type=float, required=True, help="seconds")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    return STAGES[args.stage](Stage(args.stage, args.out, args.device, args.budget, args.smoke))


if __name__ == "__main__":
    sys.exit(main())
