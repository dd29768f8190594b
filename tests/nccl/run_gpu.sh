#!/usr/bin/env bash
# Runs the NCCL transport's tests on the GPU machine, from a bundle made here with
#   /work/shared/tools/device-bundle.sh .device build-nccl/bin/nccl_transport_test \
#       build-nccl/bin/nccl_suite_test build-nccl/bin/nccl_tables_test
# and carried as .device. One rank per GPU: np1 on one H200; np2/np4/np8 when that many GPUs are
# lent (they skip otherwise). Logs go to $OUT/nccl-logs.tgz (or ./gpu-out).
#   tests/nccl/run_gpu.sh [np...]        (default: every np up to the number of GPUs)
set -uo pipefail
final=${OUT:-gpu-out}
out=$(mktemp -d)
mkdir -p "$final"
trap 'tar czf "$final/nccl-logs.tgz" -C "$out" .' EXIT
export LD_LIBRARY_PATH=$PWD/.device/lib:${LD_LIBRARY_PATH:-}
bin=.device/bin
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/card.txt"
root=$([ "$(id -u)" = 0 ] && echo --allow-run-as-root)
$bin/nccl_tables_test >"$out/tables.log" 2>&1; echo "nccl_tables_test rc=$?"
nps=${*:-$(for n in 1 2 4 8; do [ "$n" -le "$gpus" ] && echo $n; done)}
for np in $nps; do
  for t in nccl_transport_test nccl_suite_test; do
    MOONEP_TIMEOUT_MS=20000 timeout 300 mpirun -np "$np" $root --oversubscribe --bind-to none \
      $bin/$t >"$out/$t.np$np.log" 2>&1
    echo "$t np$np rc=$?"; grep -E "PASSED|FAILED|SKIPPED \]" "$out/$t.np$np.log" | head -8
  done
done
# The transport's kernels under memcheck: one rank, MPI started as a singleton.
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
MOONEP_TIMEOUT_MS=60000 timeout 180 "$san" --tool memcheck --report-api-errors no --error-exitcode 9 \
  $bin/nccl_transport_test --gtest_filter='Plans/*' >"$out/memcheck.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$out/memcheck.log" | tail -4
