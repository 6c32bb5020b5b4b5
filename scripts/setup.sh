#!/usr/bin/env bash
# Create .venv and install rl-logp with its pinned test and verl dependencies (CPU torch 2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,verl]"
