#!/usr/bin/env bash
# The CPU executor's benchmark on the GPU machine's 16-core host (a quiet machine), from a bundle
# made here with
#   /work/shared/tools/device-bundle.sh .device build/bin/moonep-bench-gemm
# and carried as .device. Prints the tables; docs/executor.md records them. About 4 minutes.
#   bench/gemm/run_host16.sh [binary]      (default .device/bin/moonep-bench-gemm)
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/lib:${LD_LIBRARY_PATH:-}
b=${1:-.device/bin/moonep-bench-gemm}
lscpu | grep -E "Model name|^CPU\(s\)"; uptime
export OPENBLAS_THREAD_TIMEOUT=4
[ -x "$b" ] || { echo "run_host16.sh: $b is not an executable (make the bundle first, above)" >&2; exit 2; }
# rc is the benchmark's (1: a result disagreed with the naive loop; 124: timed out), not grep's.
worst=0
run() {
  echo "\$ moonep-bench-gemm $*"
  timeout 120 "$b" "$@" | grep -v "^#"
  local rc=${PIPESTATUS[0]}
  echo "rc=$rc"
  [ "$rc" -eq 0 ] || worst=$rc
}
# The condition: every group >= 256 rows.
run --threads 16 --groups 8,16 --shapes 1024x512,2048x1024 --min-rows 256 --reps 3
run --threads 16 --groups 8 --shapes 4096x2048 --min-rows 256 --reps 3
run --threads 16 --dtype bf16 --groups 8 --shapes 1024x512 --min-rows 256 --reps 3
# The 2-core VM's configuration on quiet cores.
run --threads 2 --groups 8,16 --shapes 1024x512 --min-rows 256 --reps 3
exit $worst
