# Runs moonep-bench-gemm (BENCH) with FLAGS (|-separated) and checks that it exits 0 and prints
# ROWS result rows (each checked against the naive loop inside the benchmark), or, with
# MODE=corrupt, that it exits 1 saying the results are wrong.
string(REPLACE "|" ";" flags "${FLAGS}")
if(MODE STREQUAL "corrupt")
  list(APPEND flags --corrupt)
endif()
execute_process(COMMAND ${BENCH} ${flags}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 100)
message("${out}\n--- stderr ---\n${err}")
if(MODE STREQUAL "corrupt")
  if(NOT rc EQUAL 1 OR NOT err MATCHES "wrong results, no figure")
    message(FATAL_ERROR "--corrupt: exit ${rc}, expected 1 and 'wrong results, no figure'")
  endif()
  return()
endif()
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "moonep-bench-gemm ${flags} exited with ${rc}")
endif()
string(REGEX MATCHALL "\n *[0-9]+ +(uniform|zipf1\\.2) [^\n]*" rows "\n${out}")
list(LENGTH rows n)
if(NOT n EQUAL ROWS)
  message(FATAL_ERROR "${n} result rows, expected ${ROWS}")
endif()
