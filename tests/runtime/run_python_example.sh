#!/usr/bin/env bash
# Runs a Python example under mpirun. Skips (exit 77, shown as "Skipped" by CTest) when the
# interpreter lacks a module the example needs, and says which.
# Usage: run_python_example.sh <python> <module> <nprocs> <script> <mpiexec> [mpiexec flags...]
#                              [-- script arguments...]
set -uo pipefail
python=$1 module=$2 np=$3 script=$4 mpiexec=$5
shift 5
if ! "$python" -c "import $module" 2>/dev/null; then
  echo "SKIPPED: '$python' cannot import $module"
  exit 77
fi
flags=() args=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do flags+=("$1"); shift; done
[ $# -gt 0 ] && shift && args=("$@")
exec "$mpiexec" -n "$np" "${flags[@]}" -x MOONEP_LIBRARY -x MOONEP_NUM_THREADS "$python" "$script" \
  "${args[@]}"
