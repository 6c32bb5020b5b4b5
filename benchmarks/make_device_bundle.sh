#!/usr/bin/env bash
# Build .whl/ (git-ignored) for a device run of benchmarks/device_run.sh: the cp312 wheels the GPU image
# lacks, vLLM 0.24.0 and the latest release as Python sources only (the official wheels' compiled
# libraries are hundreds of MB and a call carries 64 MiB), verl 0.9.1 and what its step imports, Liger,
# megatron-core 0.18.0 (verl's Megatron engine step), and flash-attn's Triton cross entropy (the one file
# verl's logprobs_from_logits imports).
# Usage: FLASH_ATTN_SRC=/path/to/flash-attention bash benchmarks/make_device_bundle.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/vllm_latest.sh
mkdir -p .whl && cd .whl
fetch() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d . "$@"
}
# What vLLM's sampler modules import that the image does not hold (pins as in scripts/setup.sh).
fetch pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0 cachetools==8.0.2 cbor2==6.3.0 msgspec==0.23.0 openai==3.57.0 \
  openai-harmony==0.0.8 pybase64==1.5.1 pyzmq==27.3.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 \
  httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
# What verl 0.9.1's torch_functional and FSDP engine modules import that the image lacks
# (benchmarks/bench_verl_step.py stubs ray, datasets, PIL and pandas, which the step never calls).
fetch verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 cloudpickle==3.1.3 omegaconf==2.3.1 peft==0.21.2 \
  accelerate==1.16.0 psutil==7.2.2 codetiming==1.4.0 orjson==3.13.0 liger-kernel==0.8.5 \
  transformers==5.10.4 tokenizers==0.22.2  # verl 0.9.1 excludes the image's transformers 5.17
# megatron-core 0.18.0 (the `megatron` extra; the image has torch, numpy and packaging it needs).
fetch megatron-core==0.18.0
python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w .  # an sdist only upstream
for version in 0.24.0 "${VLLM_LATEST}"; do
  [ -f "vllm-src-${version}.tar.xz" ] && continue
  python3 -m pip download -q --no-deps vllm=="${version}" -d /tmp/vllm-wheel-"${version}"
  rm -rf /tmp/vllm-src
  python3 ../scripts/unpack_vllm_sources.py /tmp/vllm-wheel-"${version}"/vllm-*.whl /tmp/vllm-src --for-cuda
  tar -C /tmp/vllm-src -cJf "vllm-src-${version}.tar.xz" .
  rm -rf /tmp/vllm-wheel-"${version}" /tmp/vllm-src
done
if [ -n "${FLASH_ATTN_SRC:-}" ]; then
  mkdir -p fa/flash_attn/ops/triton
  git -C "${FLASH_ATTN_SRC}" show HEAD:flash_attn/ops/triton/cross_entropy.py > fa/flash_attn/ops/triton/cross_entropy.py
  touch fa/flash_attn/__init__.py fa/flash_attn/ops/__init__.py fa/flash_attn/ops/triton/__init__.py
fi
du -sh .
