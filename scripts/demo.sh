#!/usr/bin/env bash
# The main job: installs dependencies, builds, and runs the MoonEP demo on the CPU backend.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
np=${MOONEP_DEMO_RANKS:-4}
root_flag=""
[ "$(id -u)" = "0" ] && root_flag="--allow-run-as-root"
if [ -x build/bin/moonep-demo ]; then
  exec mpirun -np "$np" --oversubscribe --bind-to none $root_flag build/bin/moonep-demo "$@"
fi
exec build/bin/moonep-selfcheck
