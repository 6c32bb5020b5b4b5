#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the whole test suite: ruff, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -W ignore::DeprecationWarning
