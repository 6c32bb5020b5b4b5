#!/usr/bin/env bash
# Install (scripts/setup.sh, scripts/setup_vllm_engine.sh) and run the whole test suite: ruff, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_vllm_engine.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -W ignore::DeprecationWarning
# The vLLM adapter tests again, against the latest vLLM release's sources (see scripts/vllm_latest.sh).
source scripts/vllm_latest.sh
PYTHONPATH="${VLLM_LATEST_DIR}" .venv/bin/python -m pytest -q -W ignore::DeprecationWarning tests/test_vllm_adapter.py
