#!/usr/bin/env bash
# Twenty-fourth session, on the GPU machine (one H200, 16 cores), from a bundle in .device with
# bin/{layout_drv_old,layout_drv_s24,bench-old,moonep-bench-dispatch}: the host layouts and tables
# of a DeepSeek-V3 dispatch with and without the host pool, and the NCCL dispatch at one rank,
# alternating the binary of e37e8e2 (bench-old) and this one (auto threads, and
# MOONEP_HOST_THREADS=1).
#   host-pool-ab-s24.sh layout|bench ROUND
set -u
part=${1:-layout}
export LD_LIBRARY_PATH=$PWD/.device/lib:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
out=${OUT:-gpu-out}
mkdir -p "$out"
b=.device/bin
root=$([ "$(id -u)" = 0 ] && echo --allow-run-as-root)
lscpu | grep -E "Model name|^CPU\(s\)" | tee "$out/layout-s24.log"
if [ "$part" = layout ]; then
for round in 1 2 3; do
  echo "round $round: old (e37e8e2: CheckPlan + layouts + tables into vectors)" | tee -a "$out/layout-s24.log"
  $b/layout_drv_old 2 400 | tee -a "$out/layout-s24.log"
  for t in 1 2 3 4 6 8; do $b/layout_drv_s24 2 400 $t | tee -a "$out/layout-s24.log"; done
done
exit 0
fi
args="--backend=nccl --preset=deepseek-v3 --layer=false --maxvio=0,2 --iters=50 --check_iters=1"
for round in ${2:-1}; do
  for v in old new new1; do
    case $v in
      old) bin=$b/bench-old; env= ;;
      new) bin=$b/moonep-bench-dispatch; env= ;;
      new1) bin=$b/moonep-bench-dispatch; env="MOONEP_HOST_THREADS=1" ;;
    esac
    echo "=== round $round $v" | tee -a "$out/bench-s24.log"
    env $env MOONEP_TIMEOUT_MS=60000 timeout 170 mpirun -np 1 $root --bind-to none $bin $args \
      >>"$out/bench-s24.log" 2>&1
    echo "rc=$?" | tee -a "$out/bench-s24.log"
  done
done
grep -E "===|dispatch|combine" "$out/bench-s24.log" | head -80
