#!/bin/bash
# Builds the planner fuzzer with clang + libFuzzer and runs it for a bounded time.
# Usage: run_fuzz.sh <repo source dir> <build dir> <seconds>. Exits 77 (CTest: skipped) when clang
# or libFuzzer is unavailable.
set -u
SRC=$1 BUILD=$2 SECONDS_TO_RUN=${3:-20}
CXX=$(command -v clang++ || command -v clang++-14 || true)
if [ -z "$CXX" ]; then echo "SKIPPED: clang++ not found"; exit 77; fi
probe=$(mktemp -d)
printf '#include <cstdint>\n#include <cstddef>\nextern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n' > $probe/p.cc
if ! $CXX -fsanitize=fuzzer $probe/p.cc -o $probe/p >/dev/null 2>&1; then
  echo "SKIPPED: $CXX cannot link -fsanitize=fuzzer (libclang-rt dev package missing?)"; rm -rf $probe; exit 77
fi
rm -rf $probe
cmake -S $SRC/tests/planner/fuzz -B $BUILD -G Ninja -DCMAKE_CXX_COMPILER=$CXX -DMOONEP_SOURCE_DIR=$SRC \
  -DCMAKE_BUILD_TYPE= > $BUILD.cmake.log 2>&1 || { cat $BUILD.cmake.log; exit 1; }
cmake --build $BUILD -j2 > $BUILD.build.log 2>&1 || { tail -50 $BUILD.build.log; exit 1; }
mkdir -p $BUILD/corpus
cd $BUILD && ./planner_fuzz -error_exitcode=1 -max_total_time=$SECONDS_TO_RUN -max_len=4096 -seed=1 -print_final_stats=1 corpus $SRC/tests/planner/fuzz/seeds
