#!/usr/bin/env bash
# Create .venv and install rl-logp with its pinned test and verl dependencies (CPU torch 2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,verl,megatron]"
# megatron-core 0.18.0 (the `megatron` extra) declares Python >= 3.12; on an older Python it is built from
# its sdist (pure Python plus an optional C++ dataset helper) without that check: its sources run there.
if ! .venv/bin/python -c "import sys; sys.exit(sys.version_info < (3, 12))"; then
  .venv/bin/python -m pip install -q --ignore-requires-python --no-binary megatron-core "megatron-core==0.18.0"
fi
# vLLM 0.24.0 (the version verl 0.9.1 pins) pins torch 2.11 and CUDA packages: install it without its
# dependencies, plus the few pure-Python ones its V1 sampler imports, so it runs on this CPU torch.
.venv/bin/python -m pip install -q --no-deps "vllm==0.24.0"
.venv/bin/python -m pip install -q cachetools==8.0.2 cbor2==6.3.0 msgspec==0.23.0 openai==3.57.0 \
  openai-harmony==0.0.8 py-cpuinfo==9.0.0 pybase64==1.5.1 pyzmq==27.3.0 uvloop==0.23.0
# The latest vLLM release (no V1 sampler; V2 GPU and CPU workers): its official wheel's Python sources
# and dist-info under .vllm-<version>/, put ahead of 0.24.0 by PYTHONPATH in scripts/test.sh.
source scripts/vllm_latest.sh
if [ ! -f "${VLLM_LATEST_DIR}/vllm/_version.py" ]; then
  rm -rf "${VLLM_LATEST_DIR}" .cache/vllm-wheel
  .venv/bin/python -m pip download -q --no-deps "vllm==${VLLM_LATEST}" -d .cache/vllm-wheel
  .venv/bin/python scripts/unpack_vllm_sources.py .cache/vllm-wheel/vllm-"${VLLM_LATEST}"-*.whl "${VLLM_LATEST_DIR}"
  rm -rf .cache/vllm-wheel
fi
