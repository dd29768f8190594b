#!/usr/bin/env bash
# Runs the runtime's device path on the GPU machine, from a bundle made here with
#   /work/shared/tools/device-bundle.sh .device build-gpu/bin/runtime_layer_cuda_test \
#       build-gpu/lib/libmoonep.so*
# and carried as .device: the MoE layer on GPU memory against the fp64 reference (one rank per
# GPU), and the PyTorch example on CUDA tensors (policy moonep, and the test policy that routes
# through replica slots) and on CPU tensors at 2 ranks. Logs go to $OUT/runtime-logs.tgz.
set -uo pipefail
final=${OUT:-gpu-out}
out=$(mktemp -d)
mkdir -p "$final"
trap 'tar czf "$final/runtime-logs.tgz" -C "$out" .' EXIT
export LD_LIBRARY_PATH=$PWD/.device/lib:${LD_LIBRARY_PATH:-}
export MOONEP_LIBRARY=$(ls $PWD/.device/lib/libmoonep.so* | head -1)
root=$([ "$(id -u)" = 0 ] && echo --allow-run-as-root)
MOONEP_TIMEOUT_MS=30000 timeout 300 mpirun -np 1 $root --oversubscribe --bind-to none \
  .device/bin/runtime_layer_cuda_test >"$out/runtime_cuda.log" 2>&1
echo "runtime_layer_cuda_test np1 rc=$?"; grep -E "^cuda |PASSED|FAILED|Failure|Expected|Which is|actual|error" "$out/runtime_cuda.log" | head -30
for policy in moonep test-force-replicas; do
  PYTHONUNBUFFERED=1 MOONEP_TIMEOUT_MS=30000 timeout 200 mpirun -np 1 $root --oversubscribe \
    --bind-to none -x MOONEP_LIBRARY -x LD_LIBRARY_PATH python3 examples/torch/moe_torch.py \
    --device cuda --policy $policy >"$out/torch_cuda_$policy.log" 2>&1
  echo "torch example cuda $policy rc=$?"; tail -3 "$out/torch_cuda_$policy.log"
done
PYTHONUNBUFFERED=1 MOONEP_NUM_THREADS=1 timeout 200 mpirun -np 2 $root --oversubscribe --bind-to none \
  -x MOONEP_LIBRARY -x LD_LIBRARY_PATH -x MOONEP_NUM_THREADS python3 examples/torch/moe_torch.py \
  >"$out/torch_cpu.log" 2>&1
echo "torch example cpu np2 rc=$?"; tail -2 "$out/torch_cpu.log"
