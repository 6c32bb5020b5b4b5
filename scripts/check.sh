#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the main job: the provider-agreement check, TP=1 and a spawned
# TP=2 gloo world on the embedded seeded batch. Extra arguments go to `python -m rl_logp.check`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m rl_logp.check "$@"
