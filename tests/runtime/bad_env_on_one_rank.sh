#!/bin/sh
# Runs "$@" with MOONEP_DEBUG=LOUD (not a log level) on rank MOONEP_TEST_BAD_RANK only (Open MPI's
# OMPI_COMM_WORLD_RANK): a variable that differs between ranks.
if [ "${OMPI_COMM_WORLD_RANK:-0}" = "$MOONEP_TEST_BAD_RANK" ]; then
  export MOONEP_DEBUG=LOUD
fi
exec "$@"
