#!/usr/bin/env bash
# Session 38, on the GPU machine's host (16 cores): moonep-bench-speeds with ranks slowed by
# running their executor on 1 thread where the others use 2. Run from the repository root with
# the bundle in .device/b.tgz (docs/results/2026-12-03/README-s38.md says how it was made);
# writes $OUT/speeds-*-s38.log.
set -u
mkdir -p .device/x && tar xzf .device/b.tgz -C .device/x
export LD_LIBRARY_PATH=$PWD/.device/x/lib UCX_MODULE_DIR=$PWD/.device/x/lib/ucx
B=.device/x/bin/moonep-bench-speeds
M="mpirun --allow-run-as-root --oversubscribe --bind-to none -x LD_LIBRARY_PATH -x UCX_MODULE_DIR"
S="--hidden 512 --inter 512 --tokens 1024 --experts-per-rank 4 --topk 4 --threads 2 --slow-threads 1 --warmup 2 --iters 15"
nproc; lscpu | grep -i 'model name'
run() { local name=$1; shift; echo "== $name: $*"; $M "$@" 2>&1 | tee "$OUT/speeds-$name-s38.log"; }
run one-slow-zipf   -np 8 $B $S --slow-ranks 3 --zipf 1.2
run one-slow-flat   -np 8 $B $S --slow-ranks 3 --zipf 0
run half-slow-zipf  -np 8 $B $S --slow-ranks 4,5,6,7 --zipf 1.2
run one-slow-greedy -np 8 $B $S --slow-ranks 3 --zipf 1.2 --policy moonep-greedy
run none-slow-zipf  -np 8 $B $S --slow-ranks none --zipf 1.2
run one-slow-given  -np 8 $B $S --slow-ranks 3 --zipf 1.2 --speeds 1,1,1,0.5,1,1,1,1
