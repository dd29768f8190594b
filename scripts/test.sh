#!/usr/bin/env bash
# The whole test suite: installs dependencies, builds (Release), runs every test through CTest.
# Multi-rank tests run under mpirun with 1-8 ranks; GPU tests skip visibly without a GPU.
#   scripts/test.sh            # Release build in build/
#   scripts/test.sh --asan     # AddressSanitizer + UBSan build in build-asan/
#   scripts/test.sh --tsan     # ThreadSanitizer build in build-tsan/
set -euo pipefail
cd "$(dirname "$0")/.."
preset=release
case "${1:-}" in
  "") ;;
  --asan) preset=asan ;;
  --tsan) preset=tsan ;;
  *) echo "usage: scripts/test.sh [--asan|--tsan]" >&2; exit 2 ;;
esac
[ $# -le 1 ] || { echo "usage: scripts/test.sh [--asan|--tsan]" >&2; exit 2; }
scripts/install-deps.sh
dir=build
[ "$preset" != release ] && dir=build-$preset
if [ ! -f "$dir/CMakeCache.txt" ]; then
  cmake --preset "$preset" -G Ninja >/dev/null
fi
cmake --build "$dir" -j "$(nproc)"
export OMPI_MCA_rmaps_base_oversubscribe=1
ctest --test-dir "$dir" --output-on-failure -j "$(nproc)"
