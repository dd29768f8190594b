#!/usr/bin/env bash
# Issue #12 on a machine with several GPUs (one rank per GPU), from a bundle made here with
#   /work/shared/tools/device-bundle.sh .device build-gpu/bin/{nccl_transport_test,nccl_suite_test,\
#     runtime_layer_cuda_test,moonep-bench-dispatch} build-gpu/lib/libmoonep.so.0.1.0
# carried as .device. NVLink multicast stays off (NCCL_NVLS_ENABLE=0). Logs: $OUT/multi.tgz.
#   tests/nccl/run_multi_gpu.sh [tests|bench|torch]...   (default: all three)
set -uo pipefail
final=${OUT:-gpu-out}
out=$(mktemp -d)
mkdir -p "$final"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=$PWD/.device/lib:${LD_LIBRARY_PATH:-}
export MOONEP_LIBRARY=$(ls $PWD/.device/lib/libmoonep.so* 2>/dev/null | head -1)
np=$(nvidia-smi -L | wc -l)
nvidia-smi -L | tee "$out/card.txt"; nvidia-smi topo -m >>"$out/card.txt" 2>&1
root=$([ "$(id -u)" = 0 ] && echo --allow-run-as-root)
mpi="mpirun $root --oversubscribe --bind-to none -np $np -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH -x MOONEP_LIBRARY"
pack() { tar czf "$final/multi.tgz" -C "$out" .; }
for step in ${*:-tests bench torch}; do
  case $step in
    tests)
      for t in nccl_transport_test nccl_suite_test runtime_layer_cuda_test; do
        MOONEP_TIMEOUT_MS=30000 timeout 150 $mpi -x MOONEP_TIMEOUT_MS .device/bin/$t >"$out/$t.np$np.log" 2>&1
        echo "== $t np$np rc=$?"; grep -E "^cuda |PASSED|FAILED|SKIPPED \]" "$out/$t.np$np.log" | head -12
        pack
      done
      PYTHONUNBUFFERED=1 timeout 120 $mpi python3 examples/torch/moe_torch.py --device cuda \
        >"$out/torch_cuda.log" 2>&1
      echo "== torch example cuda np$np rc=$?"; grep -E "PASS|FAIL" "$out/torch_cuda.log"
      pack
      ;;
    bench)  # DeepSeek-V3-like: E=256 K=8 H=7168 bf16, 4096 tokens per rank, maxvio 0..4, with the
            # layer step on device memory; 16 replica slots per rank keep two H200s' memory enough
      MOONEP_TIMEOUT_MS=60000 timeout 200 $mpi -x MOONEP_TIMEOUT_MS .device/bin/moonep-bench-dispatch \
        --backend=nccl --preset=deepseek-v3 --tokens=4096 --maxvio=0,2,4 --slots=16 --warmup=1 \
        --iters=5 --check_tokens=1 --json="$out/dsv3.json" >"$out/dsv3.log" 2>&1
      echo "== bench dsv3 np$np rc=$?"; grep -E "^# \[|=>|#wrong total|^ +(counts|plan|dispatch|combine|prefetch|reduce|layer)" "$out/dsv3.log" | head -80
      pack
      ;;
    torch)  # PyTorch all_to_all_single of the same bytes
      PYTHONUNBUFFERED=1 timeout 120 $mpi -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29511 \
        python3 bench/torch_all_to_all.py --tokens 4096 --hidden 7168 --top-k 8 --experts 256 \
        --zipf 0,0.6,1.2 >"$out/torch_a2a.log" 2>&1
      echo "== torch all_to_all_single np$np rc=$?"; cat "$out/torch_a2a.log" | tail -6
      pack
      ;;
  esac
done
