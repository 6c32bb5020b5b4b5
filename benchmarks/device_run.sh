#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU tests, then the benchmark.
# Usage (on the GPU machine, from the repo root): bash benchmarks/device_run.sh
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
# The image's python has no setuptools editable support we can rely on: lay the package out as
# pyproject.toml maps it (kernels/ and integrations/ inside rl_logp/) under /tmp/pkg.
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r rl_logp /tmp/pkg/ && cp -r kernels /tmp/pkg/rl_logp/kernels \
  && cp -r integrations /tmp/pkg/rl_logp/integrations
export PYTHONPATH="/tmp/pkg:/tmp/site:${PWD}/.whl/fa:${PWD}/.whl/vslim:${PYTHONPATH:-}"
python3 -P -c "import vllm.v1.sample.sampler, vllm.v1.worker.gpu.sample.logprob" 2>&1 | grep -vE "^(INFO|WARNING)" | tail -3
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
timeout "${TEST_TIMEOUT:-200}" python3 -P -m pytest -q -x tests/test_fused_kernel.py tests/test_invariance.py tests/test_reference_accuracy.py tests/test_vllm_adapter.py -k "cuda or gpu or int32 or allocates or second_gpu or quantisations" -p no:cacheprovider -s -rs 2>&1 | grep -vE '^(INFO|WARNING)' | tail -30 | tee "$OUT/gpu_tests.txt"
[ -n "${SKIP_BENCH:-}" ] || timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/bench_logp.py --out "$OUT/h200_bench.json" "$@" 2>&1 | tee "$OUT/bench.txt" | tail -40
if [ -n "${RUN_CHECK:-}" ]; then
  # TP=1 and a spawned TP=2 gloo world sharing this GPU, fused underneath, at the Qwen vocabulary.
  timeout 240 python3 -P -m rl_logp.check --world 2 --rows 4096 --vocab 151936 \
    --backends auto chunked torch flash_attn --json "$OUT/check_gpu_tp2.json" 2>&1 \
    | grep -vE '^(INFO|WARNING)' | tee "$OUT/check_gpu.txt" | tail -60
fi
