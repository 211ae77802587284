#!/usr/bin/env bash
# A separate virtual environment holding vllm-project/speculators 0.9 (kept out of hf_speculators' dependencies),
# for tests/test_training_exports.py::test_speculators_loads_our_eagle3_head. speculators 0.9 pins transformers<=5.19
# and datasets<=5.1; it is installed without its dependencies on top of this environment's packages (transformers
# 5.23 here: its save/load path works), plus the few it imports at load time.
# Usage: tests/make_speculators_env.sh [/tmp/specvenv]
set -euo pipefail
VENV="${1:-/tmp/specvenv}"
python -m venv --system-site-packages "$VENV"
"$VENV/bin/pip" install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
"$VENV/bin/pip" install -q loguru pydantic pydantic-settings typer rich click psutil openai httpx aiohttp
"$VENV/bin/python" -c "from speculators.models.eagle3 import Eagle3DraftModel"
echo "$VENV/bin/python"
