#!/bin/bash
# GPU run, fifteenth session: ring-depth and co-scheduling probes.
export LD_LIBRARY_PATH=$PWD/.device/lib
O=$OUT; mkdir -p $O/dump
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv > $O/gpu.txt
P=.device/bin/moonep-gemm-probe; X=.device/exp/moonep-gemm-probe
rep() { local n=$1 r=$2; local s=$r; for ((i=1;i<n;i++)); do s=$s,$r; done; echo $s; }
for rows in 64 96 128; do
  for b in P X; do
    bin=${!b}
    MOONEP_TRACE_DUMP=$O/dump/$b-force-r$rows- $bin --sizes $(rep 33 $rows) --trace --force-swap --trace-default-only 2>&1 | head -30 > $O/ring-$b-r$rows.log
  done
done
# 8x512_zipf: default order and list order (group-major), raw records per group
MOONEP_TRACE_DUMP=$O/dump/def- $P --only 1 --trace --trace-default-only > $O/trace-8x512z-default.log 2>&1
MOONEP_TRACE_DUMP=$O/dump/list- $P --only 1 --trace --trace-default-only --sorted-waves 0 > $O/trace-8x512z-list.log 2>&1
$P --only 1 --flush --reps 20 --variants pers-list,pers-sorted1,pers-sorted2 > $O/probe-8x512z-order.log 2>&1
ls -la $O/dump | head -30
