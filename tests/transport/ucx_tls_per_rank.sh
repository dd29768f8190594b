#!/bin/sh
# Runs "$@" with UCX_TLS by rank (Open MPI's OMPI_COMM_WORLD_RANK) so that some ranks cannot reach
# others: rank 0 tcp,self, rank 1 tcp,sm,self (reaches both), rank 2 sm,self. Ranks 0 and 2 fail
# to make an endpoint to each other while rank 1 makes all of its own.
case "${OMPI_COMM_WORLD_RANK:-0}" in
  0) export UCX_TLS=tcp,self ;;
  1) export UCX_TLS=tcp,sm,self ;;
  *) export UCX_TLS=sm,self ;;
esac
export MOONEP_TEST_UCX_TLS_PER_RANK=1
exec "$@"
