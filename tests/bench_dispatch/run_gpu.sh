#!/usr/bin/env bash
# moonep-bench-dispatch --backend=nccl on the GPU machine, from a bundle made here with
#   /work/shared/tools/device-bundle.sh .device build-gpu/bin/moonep-bench-dispatch
# and carried as .device. One rank per GPU: every step runs with one rank; "multi" runs with as
# many ranks as GPUs (skipped with one GPU). Logs and JSON go to $OUT/logs.tgz (or ./gpu-out); the
# tables are printed.
#   tests/bench_dispatch/run_gpu.sh [smoke|small|large|memcheck|multi]...
#   (default: smoke small large memcheck multi)
set -uo pipefail
final=${OUT:-gpu-out}
out=$(mktemp -d)
mkdir -p "$final"
trap 'tar czf "$final/logs.tgz" -C "$out" .' EXIT
export LD_LIBRARY_PATH=$PWD/.device/lib:${LD_LIBRARY_PATH:-}
bench=.device/bin/moonep-bench-dispatch
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/card.txt"
root=$([ "$(id -u)" = 0 ] && echo --allow-run-as-root)
mpi="mpirun $root --oversubscribe --bind-to none"
export MOONEP_TIMEOUT_MS=${MOONEP_TIMEOUT_MS:-30000}
smoke_flags="--tokens=64 --hidden=128 --intermediate=64 --experts=8 --maxvio=0,2 --warmup=1 --iters=3"
run() {  # name, ranks, flags...
  local name=$1 np=$2; shift 2
  timeout 500 $mpi -np "$np" $bench "$@" --json="$out/$name.json" >"$out/$name.log" 2>&1
  echo "== $name (np $np) rc=$?"
  grep -vE "^# (command|started|load|time|algbw|t/none)" "$out/$name.log" | tail -60
}
for step in ${*:-smoke small large memcheck multi}; do
  case $step in
    smoke)  # what CTest's bench_dispatch_nccl_smoke_* run, plus the corrupt self-test (must be rc=1)
      run smoke 1 --backend=nccl $smoke_flags
      run corrupt 1 --backend=nccl $smoke_flags --layer=false --corrupt=combine
      ;;
    small)  # the small preset on nccl and on mpi (host) in the same run
      run small 1 --backend=nccl,mpi --layer=false --iters=50
      ;;
    large)  # DeepSeek-V3 and Qwen3 shapes, bf16, one rank: pack, plan, kernels and D2H around NCCL
      # (T=4096 K=8 H=7168: each check recomputes 32768 rows of 7168 values; 10 iterations keep it short)
      run deepseek 1 --backend=nccl --preset=deepseek-v3 --maxvio=2 --intermediate=256 --warmup=2 --iters=10
      run qwen3 1 --backend=nccl --preset=qwen3-30b-a3b --maxvio=0,2 --iters=20
      ;;
    memcheck)  # the bench's device path under compute-sanitizer (MPI singleton, one rank)
      san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
      timeout 400 "$san" --tool memcheck --error-exitcode 9 $bench --backend=nccl $smoke_flags \
        --maxvio=2 >"$out/memcheck.log" 2>&1
      echo "== memcheck rc=$?"; grep -E "ERROR SUMMARY|#wrong total" "$out/memcheck.log" | tail -3
      ;;
    multi)  # one rank per GPU
      if [ "$gpus" -ge 2 ]; then
        run multi "$gpus" --backend=nccl,mpi --maxvio=0,2 --layer=false --iters=50
      else
        echo "== multi: skipped ($gpus GPU)"
      fi
      ;;
  esac
done
