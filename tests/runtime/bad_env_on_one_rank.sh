#!/bin/sh
# Runs "$@" with a variable that differs between ranks: on rank MOONEP_TEST_BAD_RANK only (Open
# MPI's OMPI_COMM_WORLD_RANK), MOONEP_TEST_BAD_VAR (default MOONEP_DEBUG) is set to
# MOONEP_TEST_BAD_VALUE (default LOUD, not a log level).
if [ "${OMPI_COMM_WORLD_RANK:-0}" = "$MOONEP_TEST_BAD_RANK" ]; then
  export "${MOONEP_TEST_BAD_VAR:-MOONEP_DEBUG}=${MOONEP_TEST_BAD_VALUE:-LOUD}"
fi
exec "$@"
