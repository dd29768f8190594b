#!/usr/bin/env bash
# The dispatch benchmark on the GPU machine's 16 CPU cores (host memory: MPI and UCX backends),
# 8 and 16 ranks, one rank per core. From a bundle made here with
#   /work/shared/tools/device-bundle.sh .device build-gpu/bin/moonep-bench-dispatch
# carried as .device. Prints the tables; every log and JSON goes to $OUT/host16.tgz.
#   bench/dispatch/run_host16.sh [small|backends|dsv3|policies]...   (default: all four)
set -uo pipefail
for step in ${*:-small backends dsv3 policies}; do
  case $step in small|backends|dsv3|policies) ;;
    *) echo "run_host16.sh: unknown step '$step' (small, backends, dsv3, policies)" >&2; exit 2 ;;
  esac
done
final=${OUT:-gpu-out}
out=$(mktemp -d)
mkdir -p "$final"
trap 'tar czf "$final/host16.tgz" -C "$out" .' EXIT
export LD_LIBRARY_PATH=$PWD/.device/lib:${LD_LIBRARY_PATH:-}
export UCX_MODULE_DIR=$PWD/.device/lib/ucx
bench=.device/bin/moonep-bench-dispatch
root=$([ "$(id -u)" = 0 ] && echo --allow-run-as-root)
mpi="mpirun $root --bind-to core --map-by core -x LD_LIBRARY_PATH -x UCX_MODULE_DIR"
nproc | sed 's/^/# cores: /'; uptime
run() {  # name, ranks, limit (s), flags...
  local name=$1 np=$2 limit=$3; shift 3
  timeout "$limit" $mpi -np "$np" $bench "$@" --json="$out/$name.json" >"$out/$name.log" 2>&1
  echo "== $name (np $np) rc=$?"
  tar czf "$final/host16.tgz" -C "$out" .  # after every step: a run cut short still brings these
  grep -E "^# \[|=>|#wrong total|load average" "$out/$name.log" | head -40
}
for step in ${*:-small backends dsv3 policies}; do
  case $step in
    small)  # every operation and the layer step (1 executor thread per rank), skew sweep
      run small-np8 8 120 --maxvio=0,2,4 --iters=50 --threads=2
      run small-np16 16 120 --maxvio=0,2,4 --iters=50 --threads=1
      ;;
    backends)  # mpi and ucx side by side (transport operations only)
      run backends-np8 8 100 --maxvio=0,2 --backend=mpi,ucx --layer=false --iters=50
      run backends-np16 16 100 --maxvio=0,2 --backend=mpi,ucx --layer=false --iters=50
      ;;
    dsv3)  # DeepSeek-V3 layer shape, bf16, 1024 tokens per rank, transport operations only
      run dsv3-np16 16 150 --preset=deepseek-v3 --tokens=1024 --layer=false --warmup=2 --iters=10
      ;;
    policies)
      run policies-np16 16 90 --maxvio=2 --policy=moonep,moonep-greedy,eplb,fastermoe-shadow --layer=false --iters=30
      ;;
  esac
done
uptime
