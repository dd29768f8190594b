# Runs a program (BENCH: moonep-bench-dispatch, moonep-demo, moonep-bench-gemm, ...) under mpirun
# (MPIEXEC, NPFLAG, NP; directly when MPIEXEC is not given) with flags it
# must refuse (FLAGS, |-separated) and checks that it exits with EXPECT_RC (default 2: bad flags,
# every rank the same verdict) and says why (EXPECT, a regular expression on stderr), instead of
# crashing on an overflowed size or running with a misread value.
if(NOT DEFINED EXPECT_RC)
  set(EXPECT_RC 2)
endif()
string(REPLACE "|" ";" mpiexec_flags "${MPIEXEC_FLAGS}")
string(REPLACE "|" ";" flags "${FLAGS}")
execute_process(
  COMMAND ${MPIEXEC} ${NPFLAG} ${NP} ${mpiexec_flags} ${BENCH} ${flags}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 50)
message("${out}\n--- stderr ---\n${err}")
if(NOT rc EQUAL EXPECT_RC)
  get_filename_component(program "${BENCH}" NAME)
  message(FATAL_ERROR "${program} ${flags} exited with ${rc}, expected ${EXPECT_RC}")
endif()
if(NOT err MATCHES "${EXPECT}")
  message(FATAL_ERROR "stderr does not say '${EXPECT}'")
endif()
