#!/usr/bin/env bash
# Runs the CUDA backend's tests, sanitizers and benchmarks on the GPU machine in one go, from a
# bundle made here with
#   /work/shared/tools/device-bundle.sh .device build-cuda/bin/cuda_test build-cuda/bin/moonep-bench-gemm-cuda
# and carried as .device. Logs go to $OUT (or ./gpu-out); the last lines printed are the tables.
#   bench/gemm_cuda/run_gpu.sh [tests|sanitize|bench]...   (default: all three)
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.device/lib:${LD_LIBRARY_PATH:-}
bin=.device/bin
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
steps=${*:-tests sanitize bench}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/card.txt"
for step in $steps; do
  case $step in
    tests)
      $bin/cuda_test 2>&1 | tee "$out/cuda_test.log" | grep -E "^\[ CUDA EXEC|FAILED|PASSED|SKIPPED|Failure|error" | tail -60
      ;;
    sanitize)
      # memcheck over everything but the random shapes (covered by the plain run), racecheck on
      # the kernels and a few executor cases (cuBLAS under racecheck is slow).
      timeout 300 "$san" --tool memcheck --error-exitcode 9 $bin/cuda_test --gtest_filter='-*random*' \
        >"$out/memcheck.log" 2>&1; echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$out/memcheck.log" | tail -4
      timeout 200 "$san" --tool racecheck --error-exitcode 9 $bin/cuda_test \
        --gtest_filter='PackRows*:CombineRows*:SwiGlu*:ZeroRows*:*fp32_skewed_H13_I7*:*bf16_H256_I128*:CudaExecutor.*' \
        >"$out/racecheck.log" 2>&1; echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|PASSED|FAILED" "$out/racecheck.log" | tail -4
      ;;
    bench)
      $bin/moonep-bench-gemm-cuda --reps 20 --out "$out/ours.csv" --shapes-out "$out/shapes.txt" 2>&1 | tee "$out/bench.log"
      PYTHONUNBUFFERED=1 python3 bench/torch_grouped_mm.py --shapes "$out/shapes.txt" --ours "$out/ours.csv" \
        --out "$out/torch.csv" 2>&1 | tee "$out/torch.log"
      ;;
  esac
done
