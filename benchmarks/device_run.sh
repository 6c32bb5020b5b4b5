#!/usr/bin/env bash
# One device call: install the carried bundle (benchmarks/make_device_bundle.sh), run the GPU tests
# (the vLLM adapter's against vLLM 0.24.0 and the latest release), then the benchmark and the check.
# Usage (on the GPU machine, from the repo root): bash benchmarks/device_run.sh
# SKIP_BENCH=1 skips the benchmark; RUN_CHECK=1 runs the TP=2 agreement check with each vLLM as rollout.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source scripts/vllm_latest.sh
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
for version in 0.24.0 "${VLLM_LATEST}"; do
  mkdir -p "/tmp/vllm-${version}" && tar -C "/tmp/vllm-${version}" -xJf ".whl/vllm-src-${version}.tar.xz"
done
# The image's python has no setuptools editable support we can rely on: lay the package out as
# pyproject.toml maps it (kernels/ and integrations/ inside rl_logp/) under /tmp/pkg.
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r rl_logp /tmp/pkg/ && cp -r kernels /tmp/pkg/rl_logp/kernels \
  && cp -r integrations /tmp/pkg/rl_logp/integrations
BASE="/tmp/pkg:/tmp/site:${PWD}/.whl/fa"
export PYTHONPATH="${BASE}:/tmp/vllm-0.24.0"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
for version in 0.24.0 "${VLLM_LATEST}"; do  # what each vLLM finds here (it runs without its compiled libraries)
  PYTHONPATH="${BASE}:/tmp/vllm-${version}" python3 -P -c "import vllm, vllm.platforms.cuda
from vllm.platforms import current_platform
from vllm.triton_utils import HAS_TRITON
print('vllm', vllm.__version__, 'platform', type(current_platform).__name__, 'HAS_TRITON', HAS_TRITON)" 2>&1 | tail -4
done
quiet() { grep -vE '^(INFO|WARNING|DEBUG)|Failed to import from vllm'; }
TEST_FILES=${TEST_FILES:-tests/test_fused_kernel.py tests/test_invariance.py tests/test_reference_accuracy.py tests/test_vllm_adapter.py}
# shellcheck disable=SC2086
timeout "${TEST_TIMEOUT:-200}" python3 -P -m pytest -q $TEST_FILES -k "${TEST_FILTER:-cuda or gpu or int32 or allocates or second_gpu or quantisations}" \
  -p no:cacheprovider -s -rA 2>&1 | quiet > "$OUT/gpu_tests.txt"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|rows differ|logits differ|passed|failed" "$OUT/gpu_tests.txt" | tail -40
PYTHONPATH="${BASE}:/tmp/vllm-${VLLM_LATEST}" timeout "${LATEST_TIMEOUT:-150}" python3 -P -m pytest -q tests/test_vllm_adapter.py \
  -p no:cacheprovider -s -rA 2>&1 | quiet > "$OUT/gpu_tests_vllm_${VLLM_LATEST}.txt"
grep -E "^(PASSED|FAILED|ERROR)|rows differ|logits differ|passed|failed" "$OUT/gpu_tests_vllm_${VLLM_LATEST}.txt" | tail -40
[ -n "${SKIP_BENCH:-}" ] || timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/bench_logp.py --out "$OUT/h200_bench.json" "$@" 2>&1 | tee "$OUT/bench.txt" | tail -40
if [ -n "${RUN_CHECK:-}" ]; then
  # TP=1 and a spawned TP=2 gloo world sharing this GPU, fused underneath, at the Qwen vocabulary;
  # rank 0's rollout side is the vLLM sampler on CUDA (V1 for 0.24.0, the V2 GPU worker for the latest).
  for version in 0.24.0 "${VLLM_LATEST}"; do
    suffix=$([ "$version" = 0.24.0 ] && echo "" || echo "_vllm_${version}")
    PYTHONPATH="${BASE}:/tmp/vllm-${version}" timeout "${CHECK_TIMEOUT:-200}" python3 -P -m rl_logp.check --world 2 --rows 4096 \
      --vocab 151936 --backends auto chunked torch flash_attn --json "$OUT/check_gpu_tp2${suffix}.json" 2>&1 \
      | quiet | tee "$OUT/check_gpu${suffix}.txt" | tail -45
  done
fi
