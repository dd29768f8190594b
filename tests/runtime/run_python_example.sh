#!/usr/bin/env bash
# Runs a Python example under mpirun. Skips (exit 77, shown as "Skipped" by CTest) when the
# interpreter lacks a module the example needs, and says which.
# Usage: run_python_example.sh <python> <module> <nprocs> <script> <mpiexec> [mpiexec flags...]
set -uo pipefail
python=$1 module=$2 np=$3 script=$4 mpiexec=$5
shift 5
if ! "$python" -c "import $module" 2>/dev/null; then
  echo "SKIPPED: '$python' cannot import $module"
  exit 77
fi
exec "$mpiexec" -n "$np" "$@" -x MOONEP_LIBRARY -x MOONEP_NUM_THREADS "$python" "$script"
