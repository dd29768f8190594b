# --check_iters: the same run twice under mpirun, every iteration checked and then only the first
# one. Both must exit 0 with "#wrong total: 0 OK" and the same operations in their JSON; for the
# fully checked operations (dispatch, combine, combine-bwd, dispatch-bwd and the all-to-all
# baseline) the second run's `checked` must be exactly the first one's divided by the iterations
# (warm-up included), since every iteration checks the same rows. Bad values are refused with exit 2.
string(REPLACE "|" ";" mpiexec_flags "${MPIEXEC_FLAGS}")
string(REPLACE "|" ";" flags "${FLAGS}")
set(total_iters 4)  # FLAGS has --warmup=1 --iters=3
foreach(run all first)
  set(extra)
  if(run STREQUAL "first")
    set(extra --check_iters=1)
  endif()
  execute_process(
    COMMAND ${MPIEXEC} ${NPFLAG} ${NP} ${mpiexec_flags} ${BENCH} ${flags} ${extra} --layer=false
            --json=${OUT}.${run}.json
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 50)
  file(WRITE ${OUT}.${run}.txt "${out}\n--- stderr ---\n${err}")
  if(NOT rc EQUAL 0 OR NOT out MATCHES "#wrong total: 0 OK")
    message(FATAL_ERROR "${run}: exit ${rc}, output:\n${out}\n${err}")
  endif()
  file(READ ${OUT}.${run}.json doc_${run})
endforeach()

set(compared 0)
string(JSON nres LENGTH "${doc_all}" results)
math(EXPR last_res "${nres} - 1")
foreach(i RANGE ${last_res})
  string(JSON nops LENGTH "${doc_all}" results ${i} ops)
  math(EXPR last_op "${nops} - 1")
  foreach(j RANGE ${last_op})
    string(JSON op GET "${doc_all}" results ${i} ops ${j} op)
    string(JSON impl GET "${doc_all}" results ${i} ops ${j} impl)
    string(JSON op2 GET "${doc_first}" results ${i} ops ${j} op)
    string(JSON impl2 GET "${doc_first}" results ${i} ops ${j} impl)
    if(NOT op STREQUAL op2 OR NOT impl STREQUAL impl2)
      message(FATAL_ERROR "operation ${j}: ${op}/${impl} against ${op2}/${impl2}")
    endif()
    if(NOT op MATCHES "^(dispatch|combine|combine-bwd|dispatch-bwd)$")
      continue()
    endif()
    string(JSON all GET "${doc_all}" results ${i} ops ${j} checked)
    string(JSON first GET "${doc_first}" results ${i} ops ${j} checked)
    math(EXPR want "${first} * ${total_iters}")
    if(first EQUAL 0 OR NOT all EQUAL want)
      message(FATAL_ERROR "${op}/${impl}: checked ${all} in every iteration, ${first} in the first")
    endif()
    math(EXPR compared "${compared} + 1")
  endforeach()
endforeach()
if(compared EQUAL 0)
  message(FATAL_ERROR "no checked operation compared")
endif()

foreach(bad 0 -2)
  execute_process(
    COMMAND ${MPIEXEC} ${NPFLAG} ${NP} ${mpiexec_flags} ${BENCH} ${flags} --check_iters=${bad}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 50)
  if(NOT rc EQUAL 2 OR NOT err MATCHES "--check_iters must be -1")
    message(FATAL_ERROR "--check_iters=${bad}: exit ${rc}, stderr:\n${err}")
  endif()
endforeach()
message(STATUS "--check_iters=1 checked 1/${total_iters} of the rows on ${compared} operations")
