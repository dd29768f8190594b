#!/usr/bin/env bash
# Runs the CUDA backend's tests, sanitizers and benchmarks on the GPU machine in one go, from a
# bundle made here with
#   /work/shared/tools/device-bundle.sh .device build-cuda/bin/cuda_test build-cuda/bin/moonep-bench-gemm-cuda
# and carried as .device. Logs go to $OUT/gemm-logs.tgz (or ./gpu-out); the last lines printed are the tables.
#   bench/gemm_cuda/run_gpu.sh [tests|sanitize|streams8|bench|probe]...   (default: tests sanitize bench)
set -uo pipefail
final=${OUT:-gpu-out}
out=$(mktemp -d)  # every log; packed into $final/gemm-logs.tgz at the end (8 files come back at most)
mkdir -p "$final"
trap 'tar czf "$final/gemm-logs.tgz" -C "$out" . ; cp "$out"/bench.log "$out"/torch.log "$out"/ours.csv "$out"/torch.csv "$final"/ 2>/dev/null' EXIT
export LD_LIBRARY_PATH=$PWD/.device/lib:${LD_LIBRARY_PATH:-}
bin=.device/bin
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
steps=${*:-tests sanitize bench}  # also: streams8 (tests and GEMM table with 8 streams)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/card.txt"
for step in $steps; do
  case $step in
    tests)
      $bin/cuda_test 2>&1 | tee "$out/cuda_test.log" | grep -E "FAILED|PASSED|Failure|Which is|actual" | tail -20
      ;;
    sanitize)
      # memcheck over everything but the random shapes (covered by the plain run), racecheck on
      # the kernels and a few executor cases (cuBLAS under racecheck is slow).
      timeout 300 "$san" --tool memcheck --error-exitcode 9 $bin/cuda_test --gtest_filter='-*random*' \
        >"$out/memcheck.log" 2>&1; echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$out/memcheck.log" | tail -4
      timeout 200 "$san" --tool racecheck --error-exitcode 9 $bin/cuda_test \
        --gtest_filter='PackRows*:CombineRows*:SwiGlu*:ZeroRows*:*fp32_skewed_H13_I7*:*bf16_H256_I128*:CudaExecutor.*:PersistentGemm*:*PersistentVsCublas.EveryPath/B_bf16' \
        >"$out/racecheck.log" 2>&1; echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|PASSED|FAILED" "$out/racecheck.log" | tail -4
      ;;
    bench)
      $bin/moonep-bench-gemm-cuda --reps 20 --out "$out/ours.csv" --shapes-out "$out/shapes.txt" 2>&1 | tee "$out/bench.log"
      PYTHONUNBUFFERED=1 python3 bench/torch_grouped_mm.py --shapes "$out/shapes.txt" --ours "$out/ours.csv" \
        --out "$out/torch.csv" 2>&1 | tee "$out/torch.log"
      ;;
    probe)  # candidate schedules against the dense GEMM (needs moonep-gemm-probe in the bundle)
      $bin/moonep-gemm-probe --reps 20 2>&1 | tee "$out/probe.log"
      ;;
    streams8)
      MOONEP_CUDA_GEMM_STREAMS=8 $bin/cuda_test --gtest_filter='*streams*:CudaExecutor.*' >"$out/cuda_test8.log" 2>&1
      echo "cuda_test with 8 streams rc=$?"; grep -E "PASSED|FAILED" "$out/cuda_test8.log" | tail -3
      MOONEP_CUDA_GEMM_STREAMS=8 $bin/moonep-bench-gemm-cuda --reps 20 --out "$out/ours8.csv" >"$out/bench8.log" 2>&1
      sed -n '/grouped GEMM/,/^$/p' "$out/bench8.log"
      ;;
  esac
done
