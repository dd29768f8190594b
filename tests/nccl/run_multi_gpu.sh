#!/usr/bin/env bash
# Issue #12 on a machine with several GPUs (one rank per GPU), from a bundle made here with
#   /work/shared/tools/device-bundle.sh .device build-gpu/bin/{nccl_transport_test,nccl_suite_test,\
#     runtime_layer_cuda_test,moonep-bench-dispatch} build-gpu/lib/libmoonep.so.0.3.0
# carried as .device (optionally with NVIDIA nccl-tests' alltoall_perf, built here from its public
# source, copied into .device/bin: not part of this repository). NVLink multicast stays off
# (NCCL_NVLS_ENABLE=0). Logs: $OUT/multi.tgz.
#   tests/nccl/run_multi_gpu.sh [tests|bench|torch|nccltests|layer-skew|sweep|sweep-896|torch-sweep|
#     counts-ab]...
#   (default: tests bench torch)
# layer-skew: the Mixtral-8x7B preset (E=8, K=2: on two ranks the routing skew reaches the ranks'
#   loads, 1.00 -> 1.63 of the mean at maxvio 3) with the layer step, moonep against none;
# sweep / sweep-896: the transport phases over maxvio 0..4 for E=256 K=8 and E=896 K=16 (H=7168,
#   T=4096; I=256 for E=896 so that its epn + slots experts' weights and fp32 gradients fit);
#   Both check every row of the first (warm-up) iteration only (--check_iters=1): checking all
#   470-940 MB per operation on the host takes over 100 s per skew level.
# torch-sweep: torch all_to_all_single of the same bytes at the Zipf exponents those maxvio map to.
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
sweep() {  # name, timeout, flags...: moonep-bench-dispatch on every GPU, table lines printed
  local name=$1 limit=$2; shift 2
  MOONEP_TIMEOUT_MS=60000 timeout "$limit" $mpi -x MOONEP_TIMEOUT_MS .device/bin/moonep-bench-dispatch \
    --backend=nccl "$@" --json="$out/$name.json" >"$out/$name.log" 2>&1
  echo "== $name np$np rc=$?"
  grep -E "^# \[|skew maxvio|=>|#wrong total|^ +(counts|plan|dispatch|combine|prefetch|reduce|layer)" "$out/$name.log" | head -150
  pack
}
for step in ${*:-tests bench torch}; do
  case $step in
    tests)
      for t in nccl_transport_test nccl_suite_test runtime_layer_cuda_test; do
        MOONEP_TIMEOUT_MS=30000 timeout 150 $mpi -x MOONEP_TIMEOUT_MS .device/bin/$t >"$out/$t.np$np.log" 2>&1
        echo "== $t np$np rc=$?"; grep -E "^cuda |PASSED|FAILED|SKIPPED \]" "$out/$t.np$np.log" | head -12
        pack
      done
      # A malformed MOONEP_DEBUG on rank 1 only: creation fails on every rank at once.
      MOONEP_TEST_BAD_RANK=1 MOONEP_TIMEOUT_MS=2000 timeout 60 $mpi -x MOONEP_TEST_BAD_RANK \
        -x MOONEP_TIMEOUT_MS tests/runtime/bad_env_on_one_rank.sh .device/bin/nccl_transport_test \
        --gtest_filter='*BadEnvironmentOnOneRank*' >"$out/nccl_env_one_rank.np$np.log" 2>&1
      echo "== nccl_env_one_rank np$np rc=$?"; grep -E "PASSED|FAILED|SKIPPED \]" "$out/nccl_env_one_rank.np$np.log" | head -4
      PYTHONUNBUFFERED=1 timeout 120 $mpi python3 examples/torch/moe_torch.py --device cuda \
        >"$out/torch_cuda.log" 2>&1
      echo "== torch example cuda np$np rc=$?"; grep -E "PASS|FAIL" "$out/torch_cuda.log"
      pack
      ;;
    bench)  # DeepSeek-V3-like: E=256 K=8 H=7168 bf16, 4096 tokens per rank, maxvio 0..4, with the
            # layer step on device memory; 16 replica slots per rank keep two H200s' memory enough;
            # rows checked in the first iteration only (checking all of them took over 100 s a level)
      sweep dsv3 300 --preset=deepseek-v3 --tokens=4096 --maxvio=0,2,4 --slots=16 --warmup=1 \
        --iters=5 --check_tokens=1 --check_iters=1
      ;;
    torch)  # PyTorch all_to_all_single of the same bytes
      PYTHONUNBUFFERED=1 timeout 120 $mpi -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29511 \
        python3 bench/torch_all_to_all.py --tokens 4096 --hidden 7168 --top-k 8 --experts 256 \
        --zipf 0,0.6,1.2 >"$out/torch_a2a.log" 2>&1
      echo "== torch all_to_all_single np$np rc=$?"; cat "$out/torch_a2a.log" | tail -6
      pack
      ;;
    nccltests)  # NVIDIA nccl-tests' alltoall_perf, one process driving every GPU
      if [ -x .device/bin/alltoall_perf ]; then
        timeout 120 .device/bin/alltoall_perf -b 1M -e 1G -f 2 -g "$np" -w 5 -n 20 >"$out/alltoall_perf.log" 2>&1
        echo "== alltoall_perf -g $np rc=$?"; grep -vE "^#  Rank|^$" "$out/alltoall_perf.log" | tail -22
      else
        echo "== alltoall_perf: not in the bundle, skipped"
      fi
      pack
      ;;
    layer-skew)
      sweep mixtral 240 --preset=mixtral-8x7b --tokens=4096 --maxvio=0,1,2,3 --warmup=1 --iters=3 \
        --check_tokens=1
      ;;
    counts-ab)  # this build's count exchange against another commit's moonep-bench-dispatch,
                # copied into the bundle by hand as .device/bin/bench-old; alternately, three times
      if [ -x .device/bin/bench-old ]; then
        for i in 1 2 3; do
          for b in bench-old moonep-bench-dispatch; do
            timeout 120 $mpi .device/bin/$b --backend=nccl --preset=mixtral-8x7b --tokens=4096 \
              --maxvio=0,2 --layer=false --warmup=3 --iters=20 --check_iters=1 \
              >>"$out/counts-ab.log" 2>&1
            echo "== $b run $i rc=$?"
          done
        done
        grep -E "command:|^ +counts|#wrong total" "$out/counts-ab.log"
      else
        echo "== counts-ab: no .device/bin/bench-old in the bundle, skipped"
      fi
      pack
      ;;
    sweep)
      sweep dsv3-sweep 260 --preset=deepseek-v3 --tokens=4096 --maxvio=0,1,2,3,4 --slots=16 \
        --layer=false --warmup=1 --iters=8 --check_iters=1
      ;;
    sweep-896)
      sweep e896-sweep 300 --preset=deepseek-v3 --experts=896 --topk=16 --intermediate=256 \
        --tokens=4096 --maxvio=0,1,2,3,4 --slots=16 --layer=false --warmup=1 --iters=8 \
        --check_iters=1
      ;;
    torch-sweep)  # the Zipf exponents moonep-bench-dispatch calibrates for maxvio 0..4
      for shape in "256 8 0,0.154,0.248,0.316,0.370" "896 16 0,0.121,0.193,0.245,0.286"; do
        set -- $shape
        PYTHONUNBUFFERED=1 timeout 120 $mpi -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29511 \
          python3 bench/torch_all_to_all.py --tokens 4096 --hidden 7168 --top-k $2 --experts $1 \
          --zipf $3 >"$out/torch_a2a_e$1.log" 2>&1
        echo "== torch all_to_all_single E=$1 K=$2 np$np rc=$?"; tail -7 "$out/torch_a2a_e$1.log"
      done
      pack
      ;;
  esac
done
