#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, then configures and builds examples/c against
# it with find_package(MoonEP), checks moonep.pc, the SONAME and that only moonep* symbols are
# exported, and runs the example on 2 ranks.
# Usage: install_test.sh <build dir> <source dir> <mpiexec> [mpiexec flags...]
set -euo pipefail
build=$1 src=$2 mpiexec=$3
shift 3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
lib=$(ls "$tmp"/prefix/lib*/libmoonep.so.*.*.* | head -1)
soname=$(objdump -p "$lib" | awk '/SONAME/ {print $2}')
[[ "$soname" == libmoonep.so.0 ]] || { echo "unexpected SONAME '$soname'"; exit 1; }
# Only the C API is exported.
leaked=$(nm -D --defined-only "$lib" | awk '$2 ~ /^[TDBRVW]$/ {print $3}' | grep -v '^moonep' || true)
[[ -z "$leaked" ]] || { echo "symbols exported beyond moonep*: $leaked" | head -5; exit 1; }
test -f "$tmp/prefix/include/moonep/moonep.h"
test -f "$tmp/prefix/include/moonep/moonep_runtime.h"
pc=$(ls "$tmp"/prefix/lib*/pkgconfig/moonep.pc)
grep -q -- "-lmoonep" "$pc"
if command -v pkg-config >/dev/null; then
  # Capture first: `cmd | grep -q` fails under pipefail when grep exits before cmd finishes writing.
  flags=$(PKG_CONFIG_PATH=$(dirname "$pc") pkg-config --cflags --libs moonep)
  [[ "$flags" == *-lmoonep* ]] || { echo "pkg-config gives '$flags'"; exit 1; }
else
  echo "SKIPPED the pkg-config check: pkg-config is not installed"
fi
cmake -S "$src/examples/c" -B "$tmp/example" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$tmp/example" >/dev/null
# The example must resolve libmoonep from the prefix (not the build tree) as docs/c-api.md runs
# it: nothing added to the environment (the caller's LD_LIBRARY_PATH, e.g. an MPI module's, stays),
# libmoonep from the path CMake recorded through find_package(MoonEP).
deps=$(ldd "$tmp/example/moonep_example_c")
[[ "$deps" == *"$tmp/prefix"* ]] || { echo "example does not load libmoonep from the prefix: $deps"; exit 1; }
[[ "$deps" != *"not found"* ]] || { echo "unresolved libraries: $deps"; exit 1; }
"$mpiexec" -n 2 "$@" "$tmp/example/moonep_example_c"
echo "install test: PASS (prefix $tmp/prefix, SONAME $soname)"
