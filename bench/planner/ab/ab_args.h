// The A/B tools' integer arguments (ab_main.cc, phases_main.cc): SHAPE POLICY CHECK DECIDE
// BLOCKS ITERS, each a whole base-10 number in its range, or a message naming it and exit 2
// (atoi read "2x" as 2, and BLOCKS 0 indexed an empty vector).
#pragma once

#include <cerrno>
#include <cstdio>
#include <cstdlib>

struct AbArgs {
  int shape, policy, check, decide, blocks, iters;
};

// argv[0..5] are SHAPE POLICY CHECK DECIDE BLOCKS ITERS.
inline bool ParseAbArgs(char** argv, AbArgs* out) {
  struct Field {
    const char* name;
    long lo, hi;
    int* value;
  } fields[] = {{"SHAPE", 0, 2, &out->shape},     {"POLICY", 0, 5, &out->policy},
                {"CHECK", 0, 1, &out->check},     {"DECIDE", 0, 1, &out->decide},
                {"BLOCKS", 1, 1000000, &out->blocks}, {"ITERS", 1, 100000000, &out->iters}};
  for (int k = 0; k < 6; ++k) {
    const Field& f = fields[k];
    char* end = nullptr;
    errno = 0;
    const long v = std::strtol(argv[k], &end, 10);
    if (end == argv[k] || *end != '\0' || errno != 0 || v < f.lo || v > f.hi) {
      std::fprintf(stderr, "%s = '%s': expected a whole number in [%ld, %ld]\n", f.name, argv[k],
                   f.lo, f.hi);
      return false;
    }
    *f.value = static_cast<int>(v);
  }
  return true;
}
