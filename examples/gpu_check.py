"""The GPU check: one command that, on a GPU machine without network, installs the carried wheels, benchmarks our
compiled decoding against transformers' compiled plain decoding and the demo family's methods eagerly on CUDA, runs
the test suite's device core, measures the verify cost curve and the loop's efficiency on a 1B target, and on
request runs the quantized paths and trains the demo heads and draft, each stage within its time budget.

Here, with network, once per release of what travels (the wheels the GPU image lacks; the package itself runs
from the tree):

    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl \\
        transformers==5.24.0 torchao==0.18.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
    python examples/gpu_check.py pack .whl        # writes .whl/gpu_check.tar.xz, prints what travels

There, in the repository's root, with `.whl/gpu_check.tar.xz` carried beside the tracked files:

    python3 examples/gpu_check.py run --pack .whl/gpu_check.tar.xz --out $OUT [--stages compiled,bench]

Everything lands in `--out`: `log.txt`, `records.jsonl` (one record per measurement, each with its `stage`),
`summary.json` (each stage's status and seconds), `tests.xml`, `partial.jsonl` (a bench run stopped at its stage's
budget: what it measured) and, with the `train` stage, the trained weights (`eagle3.tar`, `medusa.tar`,
`draft.tar`). `run --smoke` runs every stage at tiny sizes on the CPU in seconds (the suite's
`tests/test_gpu_check.py` does), so the command cannot rot between GPU runs.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAGE_SCRIPT = Path(__file__).resolve().parent / "gpu_check_stages.py"
# stage -> seconds it may run on the GPU machine
BUDGETS = {"compiled": 270, "bench": 90, "tests": 50, "curve": 40, "curve-compiled": 150, "quant": 65, "train": 80}
# what `run` runs unless told: together at most 7.5 minutes, so that one call of at most 9 minutes holds them with the
# install. quant and train measured what they are for in the first check (docs/benchmarks/gpu.md), curve-compiled
# (two compilations of a 1B model) takes longer than the defaults leave: by name only
DEFAULT_STAGES = ("compiled", "bench", "tests", "curve")
SMOKE_BUDGET = 120  # seconds per stage on a CPU at smoke sizes (a stuck stage fails the smoke test)
TRAVEL_LIMIT = 64 * 2**20  # what may travel to the GPU machine: tracked files and carried paths together
# transformers' model families the check uses (the tests' tiny models, the demo family, the 1B target, and the
# encoder-decoder config that AutoTokenizer imports):
# `pack` drops the others, which would travel as most of transformers' size
KEEP_MODELS = ("auto", "encoder_decoder", "llama", "qwen2", "qwen3", "mistral", "gpt_neox", "gpt2")
SITE = Path(tempfile.gettempdir()) / "gpu_check_site"


def pack(wheels: Path, out: Path) -> int:
    """Unpacks every wheel in `wheels` into one xz tarball `out`, transformers without the model families outside
    `KEEP_MODELS`, and prints the tracked tree's size, the tarball's and their sum against the travel limit."""
    with tempfile.TemporaryDirectory() as folder:
        for wheel in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(folder)
        models = Path(folder) / "transformers" / "models"
        for family in models.iterdir() if models.is_dir() else ():
            if family.is_dir() and family.name not in KEEP_MODELS:
                shutil.rmtree(family)
        with tarfile.open(out, "w:xz", preset=9) as tarball:
            for child in sorted(Path(folder).iterdir()):
                tarball.add(child, child.name)
    tracked = tracked_bytes()
    total = tracked + out.stat().st_size
    print(f"tracked files {tracked / 2**20:.2f} MiB + {out.name} {out.stat().st_size / 2**20:.2f} MiB = "
          f"{total / 2**20:.2f} MiB of {TRAVEL_LIMIT / 2**20:.0f} MiB")
    return 0 if total <= TRAVEL_LIMIT else 1


def tracked_bytes() -> int:
    """The size of the repository's tracked files as they are in the working tree."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return sum((REPO / name).stat().st_size for name in names.decode().split("\0") if (REPO / name).is_file())


def install(pack_file: Path | None) -> dict:
    """The stages' environment: `pack_file` unpacked into `SITE` ahead of the installed packages, and the
    repository's own package from the tree."""
    paths = [str(REPO)]
    if pack_file is not None:
        with tarfile.open(pack_file) as tarball:
            tarball.extractall(SITE, filter="data")
        paths.insert(0, str(SITE))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def run_stage(stage: str, args, env: dict, log) -> dict:
    """Runs one stage in its own process within its budget; returns its status (`ok`, `failed` or `timeout`)."""
    budget = SMOKE_BUDGET if args.smoke else BUDGETS[stage]
    command = [sys.executable, str(STAGE_SCRIPT), stage, "--out", str(args.out), "--device", args.device,
               "--budget", str(budget)] + (["--smoke"] if args.smoke else [])
    print(f"== {stage} (budget {budget} s)", file=log, flush=True)
    start = time.perf_counter()
    try:
        code = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=budget).returncode
        status = "ok" if code == 0 else "failed"
    except subprocess.TimeoutExpired:
        status = "timeout"
    seconds = round(time.perf_counter() - start, 1)
    print(f"== {stage}: {status} after {seconds} s", file=log, flush=True)
    return {"status": status, "seconds": seconds, "budget": budget}


def run(args) -> int:
    """Installs the pack, runs the chosen stages in order and writes `summary.json`; 0 when every stage passed."""
    args.out.mkdir(parents=True, exist_ok=True)
    env = install(args.pack)
    with open(args.out / "log.txt", "a", encoding="utf-8") as log:
        summary = {stage: run_stage(stage, args, env, log) for stage in args.stages}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(summary))
    return 0 if all(result["status"] == "ok" for result in summary.values()) else 1


def stage_list(text: str) -> list[str]:
    """`--stages`: comma-separated names of `BUDGETS`, run in the order given."""
    stages = [name for name in text.split(",") if name]
    unknown = sorted(set(stages) - set(BUDGETS))
    if unknown or not stages:
        raise argparse.ArgumentTypeError(f"stages are {', '.join(BUDGETS)}; got {text!r}")
    return stages


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line: `pack WHEELS [--out FILE]` or `run --out DIR [--pack FILE] [--stages ...] [--smoke]`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    packer = commands.add_parser("pack", help="the wheels of a folder as one tarball that travels")
    packer.add_argument("wheels", type=Path, help="the folder of the downloaded wheels")
    packer.add_argument("--out", type=Path, default=None, help="default: WHEELS/gpu_check.tar.xz")
    runner = commands.add_parser("run", help="run the check's stages")
    runner.add_argument("--out", type=Path, required=True, help="the folder that receives everything")
    runner.add_argument("--pack", type=Path, default=None,
                        help="the tarball `pack` wrote (default: none, what is installed)")
    runner.add_argument("--stages", type=stage_list, default=list(DEFAULT_STAGES),
                        help=f"comma-separated, of {','.join(BUDGETS)} (default: {','.join(DEFAULT_STAGES)})")
    runner.add_argument("--device", default="cuda", help="cuda (default), or cpu")
    runner.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, in seconds")
    args = parser.parse_args(argv)
    if args.command == "run" and args.smoke:
        args.device = "cpu"
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs `pack` or `run`; returns the exit status (0: fits the travel limit / every stage passed, else 1)."""
    args = parse(argv)
    if args.command == "pack":
        return pack(args.wheels, args.out or args.wheels / "gpu_check.tar.xz")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
