#!/bin/bash
# Same-process A/B and instruction counts for two planner versions (docs/planner.md#benchmark).
#
#   bench/planner/ab/ab.sh OLD NEW ab SHAPE POLICY CHECK DECIDE [BLOCKS ITERS]
#   bench/planner/ab/ab.sh OLD NEW cg SHAPE POLICY CHECK DECIDE
#   bench/planner/ab/ab.sh OLD NEW phases SHAPE POLICY CHECK DECIDE [BLOCKS ITERS]
#
# OLD, NEW: a commit (its planner/ via git archive) or `worktree` (the working tree's planner/).
# SHAPE: 0 = EP64 (R=64, E=256), 1 = R=128, E=896, 2 = R=1024, E=8192 (moonep-bench-planner's
# shapes and counts); POLICY: 0 none, 1 moonep, 2 moonep-greedy; CHECK: moonep_check_greedy;
# DECIDE: 1 = Decide on totals, 0 = MakePlan.
# ab: both builds as shared objects in one process (ab_main.cc), alternating BLOCKS (default 100)
#     blocks of ITERS plans (default 20) pinned to core 1; prints the median new/old block ratio.
# cg: instructions per plan of each build (callgrind, 800 plans minus 400 plans).
# phases: NEW alone (phases_main.cc), BLOCKS blocks of ITERS plans pinned to core 1 with two
#     fixed workloads timed between blocks; prints the blocks grouped by plan time.
# Needs the build directory (BUILD, default build) for libmoonep_core.a; scratch in OUT
# (default /tmp/moonep-ab).
set -e
root=$(git rev-parse --show-toplevel)
build=${BUILD:-$root/build}
out=${OUT:-/tmp/moonep-ab}
old=$1 new=$2 mode=$3 shape=$4 policy=$5 check=$6 decide=$7 blocks=${8:-100} iters=${9:-20}
absl="-labsl_statusor -labsl_status -labsl_strings -labsl_str_format_internal -labsl_cord
  -labsl_cord_internal -labsl_cordz_info -labsl_raw_logging_internal -labsl_throw_delegate -labsl_int128"
mkdir -p "$out"
mk() {  # mk COMMIT|worktree NAME: $out/NAME.so
  local src=$out/src-$2 objs=""
  rm -rf "$src"
  mkdir -p "$src"
  if [ "$1" = worktree ]; then cp -r "$root/planner" "$src/"; else git -C "$root" archive "$1" planner | tar -x -C "$src"; fi
  for f in "$src"/planner/*.cc "$root/bench/planner/ab/ab_lib.cc"; do
    local o=$src/$(basename "$f" .cc).o
    g++ -O3 -DNDEBUG -fPIC -fvisibility=hidden -std=c++17 -I"$src" -I"$root" -I"$root/moonep/include" \
      -c "$f" -o "$o" &
    objs="$objs $o"
  done
  wait
  g++ -shared -Wl,-Bsymbolic -o "$out/$2.so" $objs "$build/lib/libmoonep_core.a" $absl
}
if [ "$mode" = phases ]; then
  mk "$new" new
  g++ -O2 -std=c++17 -o "$out/phases_main" "$root/bench/planner/ab/phases_main.cc" -ldl
  taskset -c 1 "$out/phases_main" "$out/new.so" "$shape" "$policy" "$check" "$decide" "$blocks" "$iters"
  exit 0
fi
mk "$old" old
mk "$new" new
g++ -O2 -std=c++17 -o "$out/ab_main" "$root/bench/planner/ab/ab_main.cc" -ldl
if [ "$mode" = ab ]; then
  taskset -c 1 "$out/ab_main" "$out/old.so" "$out/new.so" "$shape" "$policy" "$check" "$decide" "$blocks" "$iters"
else
  for v in old new; do
    for n in 400 800; do
      N=$n valgrind --tool=callgrind --callgrind-out-file="$out/cg.$v.$n" "$out/ab_main" "$out/$v.so" \
        "$out/$v.so" "$shape" "$policy" "$check" "$decide" 1 1 > /dev/null 2>&1
    done
    a=$(callgrind_annotate "$out/cg.$v.400" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
    b=$(callgrind_annotate "$out/cg.$v.800" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
    echo "$v ($( [ $v = old ] && echo "$old" || echo "$new" )): $(( (b - a) / 400 )) instructions per plan"
  done
fi
