#!/usr/bin/env bash
# One call on the GPU machine: lay out the package, install the carried wheels (.whl/, see
# benchmarks/make_device_bundle.sh), then run the stages named in STAGES (default: tests bench):
#   tests     the GPU tests (TEST_FILES: groups of files separated by ';', a process each; TEST_FILTER;
#             TEST_WORKERS: pytest-xdist processes per group, for groups whose time is Triton's compiles)
#             -> $OUT/gpu_tests.txt
#   sweep     bench_logp.py --suites sweep: launch variants of the fused kernels -> $OUT/${GPU}_sweep.json
#   ab        the tree's cluster forward against another source of it (AB_BASE, default ab_base.cu: a file
#             the call carries, e.g. `git show HEAD~1:kernels/cluster_row_stats.cu > ab_base.cu`), or with
#             AB_PATCH (e.g. docs/experiments/X.patch) the tree's package against the tree with the patch
#             applied (kernels, launches, package: side `patch`), the sweep's default launch in AB_ROUNDS (3)
#             rounds of a process each, the side timed first alternating from round to round
#             -> $OUT/${GPU}_sweep_ab.jsonl; with AB_ROLLOUT_ROWS also the rollout-size calls at those rows on each
#             side -> $OUT/${GPU}_calls_ab_<side>_<round>.json
#   calls     bench_logp.py --suites rollout overhead tp (CALLS_SUITES, more arguments in CALLS_ARGS): rollout-size
#             calls, host time, TP agreement cost -> $OUT/${GPU}_calls.json
#   bench     bench_logp.py --suites main: every provider at 8192 and 32768 rows -> $OUT/${GPU}_bench.json
#   verl      bench_verl_step.py --suites fsdp compile (VERL_SUITES) -> $OUT/${GPU}_verl_step.json
#   megatron  bench_verl_step.py --suites megatron: verl's Megatron engine step -> $OUT/${GPU}_megatron_step.json
#   rollout   bench_rollout.py (ROLLOUT_ARGS) against each carried vLLM (ROLLOUT_VERSIONS)
#             -> $OUT/${GPU}_rollout_<version>.json
#   profile   profile_rollout_step.py for vLLM 0.24.0's V1 step at 8 rows, raw and processed (PROFILE_ARGS):
#             each function's host time per step, patched minus unpatched -> $OUT/${GPU}_profile_v1_<mode>.txt
#   ncu       Nsight Compute on one call per case (benchmarks/ncu_cases.py; NCU_CASES: t1 t07 t1_entropy t07_entropy,
#             a forward + backward of rl_logp.logprobs; kept_k50 kept_p09 kept_k50_p09, the kept set at one row;
#             NCU_ARGS to the script) -> $OUT/ncu_<case>.ncu-rep and .txt
#   vllm_tests tests/test_vllm_adapter.py's GPU tests (VLLM_TEST_FILTER, default "cuda") against each carried vLLM
#             (ROLLOUT_VERSIONS) -> $OUT/gpu_vllm_tests_<version>.txt
#   check     the TP=2 agreement check with each carried vLLM as the rollout side
#   linear    (issue 27) tests/test_linear.py, then bench_linear.py: rl-logp's fused lm_head + logp beside
#             verl's fused heads and the unfused path -> $OUT/gpu_linear_tests.txt, $OUT/${GPU}_linear.json
# ${GPU} in the names above: the GPU the files were measured on (h100, h200; gpu for another).
# RL_LOGP_FUSED_CONFIG, when set, reaches every stage. Usage (on the GPU machine, from the repo root):
#   STAGES="tests sweep" bash benchmarks/device_run.sh
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${STAGES:-tests bench}
source scripts/vllm_latest.sh
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
VLLM_VERSIONS=()
for version in 0.24.0 "${VLLM_LATEST}"; do
  if [ -f ".whl/vllm-src-${version}.tar.xz" ]; then
    mkdir -p "/tmp/vllm-${version}" && tar -C "/tmp/vllm-${version}" -xJf ".whl/vllm-src-${version}.tar.xz"
    VLLM_VERSIONS+=("${version}")
  fi
done
# Lay the package of the tree at $1 out as pyproject.toml maps it (kernels/ and integrations/ inside rl_logp/)
# under $2; the tree's own under /tmp/pkg.
lay_out() {
  rm -rf "$2" && mkdir -p "$2" && cp -r "$1/rl_logp" "$2/" && cp -r "$1/kernels" "$2/rl_logp/kernels" \
    && cp -r "$1/integrations" "$2/rl_logp/integrations"
}
lay_out . /tmp/pkg
BASE="/tmp/pkg:/tmp/site:${PWD}/.whl/fa"
export PYTHONPATH="${BASE}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/gpu.txt"
# The files' prefix names the GPU they were measured on (h100, h200; "gpu" for another).
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h100|h200' | head -1 | tr 'A-Z' 'a-z')
GPU=${GPU:-gpu}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
quiet() { grep -vE '^(INFO|WARNING|DEBUG)|Failed to import from vllm'; }
for stage in ${STAGES}; do
  case "${stage}" in
    tests)
      # Groups of files separated by ';', each in a pytest process of its own (TEST_TIMEOUT each), so that a
      # kernel fault in one (a poisoned CUDA context) cannot fail the others: the driver launches first,
      # the cluster forward last. At the limit pytest gets SIGINT, so it still lists what passed, failed and
      # was skipped, and the slowest tests.
      : > "$OUT/gpu_tests.txt"
      default_tests="tests/test_launcher.py; tests/test_fused_kernel.py tests/test_invariance.py tests/test_compile.py
        tests/test_tp_agreement.py tests/test_entropy.py tests/test_api_and_config.py tests/test_reference_accuracy.py
        tests/test_rollout_calls.py tests/test_temperature_kernel.py; tests/test_rollout_kernels.py tests/test_sampling_mask.py
        tests/test_rollout_scores.py; tests/test_cluster_forward.py"
      IFS=';' read -ra TEST_GROUPS <<< "$(echo ${TEST_FILES:-${default_tests}})"
      for group in "${TEST_GROUPS[@]}"; do
        # shellcheck disable=SC2086
        timeout -s INT -k 30 "${TEST_TIMEOUT:-240}" python3 -P -m pytest -q ${group} -k "${TEST_FILTER:-not cpu and not world}" ${TEST_WORKERS:+-n ${TEST_WORKERS}} \
          -p no:cacheprovider -rA -v --durations=15 2>&1 | quiet >> "$OUT/gpu_tests.txt"
      done
      grep -E "^(FAILED|ERROR)|passed|failed|Error" "$OUT/gpu_tests.txt" | tail -25 ;;
    sweep)
      timeout "${SWEEP_TIMEOUT:-300}" python3 -P benchmarks/bench_logp.py --suites sweep --rows 32768 \
        --reps "${REPS:-5}" --out "$OUT/${GPU}_sweep.json" 2>&1 | grep -v '^{' | tail -30 ;;
    ab)
      kernel=/tmp/pkg/rl_logp/kernels/cluster_row_stats.cu
      other=base
      if [ -n "${AB_PATCH:-}" ]; then
        # A second package laid out as the first, from a copy of the tree with the patch applied.
        other=patch
        rm -rf /tmp/ab_src && mkdir -p /tmp/ab_src && cp -r rl_logp kernels integrations /tmp/ab_src/
        patch_file=$(realpath "${AB_PATCH}")
        (cd /tmp/ab_src && git apply --include='rl_logp/*' --include='kernels/*' --include='integrations/*' \
          "${patch_file}") || { echo "ab: ${AB_PATCH} does not apply to the tree; stage skipped"; continue; }
        lay_out /tmp/ab_src /tmp/pkg_patch
      elif [ ! -f "${AB_BASE:-ab_base.cu}" ]; then
        echo "ab: ${AB_BASE:-ab_base.cu} is not in the tree (write it with git show REV:kernels/cluster_row_stats.cu and carry it); stage skipped"
        continue
      fi
      cp "${kernel}" /tmp/ab_tree.cu
      for round in $(seq "${AB_ROUNDS:-3}"); do
        # Each side goes first in every other round, so that neither is always the one timed first.
        sides="tree ${other}"
        if [ $((round % 2)) -eq 0 ]; then sides="${other} tree"; fi
        for side in ${sides}; do
          path="${BASE}"
          if [ "${side}" = patch ]; then path="/tmp/pkg_patch:${BASE#/tmp/pkg:}"; fi
          if [ "${side}" = tree ]; then cp /tmp/ab_tree.cu "${kernel}"; elif [ "${side}" = base ]; then cp "${AB_BASE:-ab_base.cu}" "${kernel}"; fi
          PYTHONPATH="${path}" timeout "${AB_TIMEOUT:-120}" python3 -P benchmarks/bench_logp.py --suites sweep --rows 32768 \
            --reps "${REPS:-5}" --variants '[{}]' --out /tmp/ab.json 2>&1 | grep -A1 "^sweep variant" | tail -1 | sed "s/^default/${side} ${round}/"
          python3 -c "import json, sys; d = json.load(open('/tmp/ab.json')); d.update(side=sys.argv[1], round=int(sys.argv[2]), \
            base=sys.argv[3]); print(json.dumps(d))" "${side}" "${round}" "${AB_PATCH:-${AB_BASE:-ab_base.cu}}" >> "$OUT/${GPU}_sweep_ab.jsonl"
          if [ -n "${AB_ROLLOUT_ROWS:-}" ]; then
            # shellcheck disable=SC2086
            PYTHONPATH="${path}" timeout "${AB_TIMEOUT:-120}" python3 -P benchmarks/bench_logp.py --suites rollout \
              --rollout-rows ${AB_ROLLOUT_ROWS} --out "$OUT/${GPU}_calls_ab_${side}_${round}.json" 2>&1 \
              | grep -E "^(rl_logp|flash_attn CE) " | grep -v "column\|full" | sed "s/^/${side} ${round}: /"
          fi
        done
      done
      cp /tmp/ab_tree.cu "${kernel}" ;;
    calls)
      timeout "${CALLS_TIMEOUT:-150}" python3 -P benchmarks/bench_logp.py --suites ${CALLS_SUITES:-rollout overhead tp} \
        ${CALLS_ARGS:-} --out "$OUT/${GPU}_calls.json" 2>&1 | grep -v '^{' | tail -40 ;;
    bench)
      timeout "${BENCH_TIMEOUT:-330}" python3 -P benchmarks/bench_logp.py --suites main \
        --reps "${REPS:-10}" --out "$OUT/${GPU}_bench.json" 2>&1 | grep -v '^{' | tee "$OUT/bench.txt" | tail -60 ;;
    verl)
      timeout "${VERL_TIMEOUT:-480}" python3 -P benchmarks/bench_verl_step.py --suites ${VERL_SUITES:-fsdp compile} \
        --reps "${REPS:-10}" --out "$OUT/${GPU}_verl_step.json" 2>&1 | quiet | tee "$OUT/verl_step.txt" | tail -30 ;;
    megatron)
      timeout "${MEGATRON_TIMEOUT:-300}" python3 -P benchmarks/bench_verl_step.py --suites megatron \
        --reps "${REPS:-10}" --out "$OUT/${GPU}_megatron_step.json" 2>&1 | quiet | tee "$OUT/megatron_step.txt" | tail -30 ;;
    rollout)
      for version in ${ROLLOUT_VERSIONS:-${VLLM_VERSIONS[@]}}; do
        PYTHONPATH="${BASE}:/tmp/vllm-${version}" timeout "${ROLLOUT_TIMEOUT:-240}" python3 -P benchmarks/bench_rollout.py \
          --reps "${REPS:-20}" ${ROLLOUT_ARGS:-} --out "$OUT/${GPU}_rollout_${version}.json" 2>&1 | quiet | tee "$OUT/rollout_${version}.txt" | tail -42
      done ;;
    profile)
      for mode in raw_logprobs processed_logprobs; do
        PYTHONPATH="${BASE}:/tmp/vllm-0.24.0" timeout "${PROFILE_TIMEOUT:-120}" python3 -P benchmarks/profile_rollout_step.py \
          --path v1_sampler --mode "${mode}" --batch 8 ${PROFILE_ARGS:-} 2>&1 | quiet | tee "$OUT/${GPU}_profile_v1_${mode}.txt" | head -30
      done ;;
    ncu)
      # Nsight Compute on one call per case (benchmarks/ncu_cases.py), clocks left alone:
      # speed of light, occupancy, warp stalls, memory, per-instruction counts; a report per case, its
      # details as text and its SASS with each instruction's counts as CSV.
      for case in ${NCU_CASES:-t1 t07 t1_entropy}; do
        timeout "${NCU_TIMEOUT:-150}" ncu --clock-control none --nvtx --nvtx-include measure/ \
          --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
          --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats \
          --section SourceCounters -f -o "$OUT/ncu_${case}" \
          python3 -P benchmarks/ncu_cases.py --case "${case}" ${NCU_ARGS:-} 2>&1 | tail -3
        ncu --import "$OUT/ncu_${case}.ncu-rep" --page details > "$OUT/ncu_${case}.txt" 2>&1
        # Each SASS instruction's executed count and stalls (SourceCounters), to find where the issue slots go.
        ncu --import "$OUT/ncu_${case}.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_${case}_sass.csv" 2>&1
        grep -E "grad_kernel|row_stats_kernel|cluster_row_stats|kept_set|Duration|Registers Per|Achieved Occupancy|Memory Throughput|DRAM Throughput|Compute \(SM\)" \
          "$OUT/ncu_${case}.txt" | head -24
      done ;;
    vllm_tests)
      # The vLLM adapter's GPU tests (names with "cuda", VLLM_TEST_FILTER) against each carried vLLM.
      for version in ${ROLLOUT_VERSIONS:-${VLLM_VERSIONS[@]}}; do
        PYTHONPATH="${BASE}:/tmp/vllm-${version}" timeout -s INT -k 30 "${TEST_TIMEOUT:-240}" python3 -P -m pytest -q \
          tests/test_vllm_adapter.py -k "${VLLM_TEST_FILTER:-cuda}" -p no:cacheprovider -rA -v --durations=10 2>&1 \
          | quiet > "$OUT/gpu_vllm_tests_${version}.txt"
        grep -E "^(FAILED|ERROR)|passed|failed|Error" "$OUT/gpu_vllm_tests_${version}.txt" | tail -15
      done ;;
    check)
      for version in "${VLLM_VERSIONS[@]}"; do
        PYTHONPATH="${BASE}:/tmp/vllm-${version}" timeout "${CHECK_TIMEOUT:-200}" python3 -P -m rl_logp.check --world 2 \
          --rows 4096 --vocab 151936 --backends auto chunked torch flash_attn --json "$OUT/check_gpu_tp2_vllm_${version}.json" \
          2>&1 | quiet | tee "$OUT/check_gpu_${version}.txt" | tail -12
      done ;;
    # --- issue 27: the invariant fused linear + logp head ---
    linear)
      timeout "${LINEAR_TEST_TIMEOUT:-150}" python3 -P -m pytest -q tests/test_linear.py -p no:cacheprovider -rA -v \
        2>&1 | quiet > "$OUT/gpu_linear_tests.txt"
      grep -E "^(FAILED|ERROR)|passed|failed|Error" "$OUT/gpu_linear_tests.txt" | tail -25
      timeout "${LINEAR_TIMEOUT:-240}" python3 -P benchmarks/bench_linear.py --reps "${REPS:-3}" \
        --out "$OUT/${GPU}_linear.json" 2>&1 | quiet | tee "$OUT/linear.txt" | tail -40 ;;
    *) echo "unknown stage ${stage}" ;;
  esac
done
