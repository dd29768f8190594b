// The "--name value" command lines of the runtime's tools (moonep-demo, moonep-cost-probe,
// moonep-bench-speeds): whole numbers in stated ranges, and the tool's other flags through a
// callback; reductions over ranks; and their main() under MPI. Header-only.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <string>

#include "absl/types/span.h"
#include "moonep/core/env.h"

namespace moonep::runtime {

struct IntFlag {
  const char* name;
  int64_t lo, hi;
  int64_t* value;
};

// Reads argv[1..] as "--name value" pairs: a name of `ints` takes a base-10 whole number in its
// range; any other name goes to `other(name, value, error)`, which returns false with *error set
// for a bad value, and sets *error to "" and returns false for a name it does not know. False with
// *error set: "--help" / "-h" (*error == usage), a missing value, an unknown name, a bad value.
inline bool ParseToolArgs(
    int argc, char** argv, absl::Span<const IntFlag> ints, const char* usage,
    const std::function<bool(const std::string&, const std::string&, std::string*)>& other,
    std::string* error) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      *error = usage;
      return false;
    }
    if (i + 1 >= argc) {
      *error = "missing value after " + arg + "\n" + usage;
      return false;
    }
    const std::string v = argv[++i];
    const IntFlag* flag = nullptr;
    for (const IntFlag& f : ints) flag = arg == f.name ? &f : flag;
    if (flag != nullptr) {
      if (!env::ParseBase10InRange(v.c_str(), flag->lo, flag->hi, flag->value)) {
        *error = arg + " " + v + ": expected a whole number in [" + std::to_string(flag->lo) +
                 ", " + std::to_string(flag->hi) + "]";
        return false;
      }
    } else if (!other(arg, v, error)) {
      if (error->empty()) *error = "unknown option " + arg + "\n" + usage;
      return false;
    }
  }
  return true;
}

// The largest / the sum of `v` over the ranks of `comm` (the same on every rank).
inline double MaxOverRanks(double v, MPI_Comm comm) {
  double out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, comm);
  return out;
}
inline double SumOverRanks(double v, MPI_Comm comm) {
  double out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_SUM, comm);
  return out;
}

// main() of an MPI tool: MPI_Init_thread (serialized), run(argc, argv) on every process, and the
// worst exit code of all of them on every one (so mpirun's is the job's), then MPI_Finalize.
inline int RunToolUnderMpi(int argc, char** argv, int (*run)(int, char**)) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  int rc = run(argc, argv);
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}

}  // namespace moonep::runtime
