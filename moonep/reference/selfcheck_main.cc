// moonep-selfcheck: checks the fp64 reference MoE layer (the oracle of every MoonEP test) against
// central finite differences and prints a readable verdict. Takes no arguments.
#include <cstdio>
#include <cstring>

#include "moonep/reference/gradient_check.h"

int main(int argc, char** argv) {
  using namespace moonep::reference;
  if (argc > 1) {
    const bool help = std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0;
    std::fprintf(help ? stdout : stderr,
                 "%susage: moonep-selfcheck   (no arguments: checks the fp64 reference layer's "
                 "gradients against finite differences; exit 0 when they agree)\n",
                 help ? "" : "moonep-selfcheck takes no arguments; ");
    return help ? 0 : 2;
  }
  std::printf("MoonEP self-check: fp64 reference MoE layer (SwiGLU experts, top-k routing)\n");
  std::printf("Every analytic gradient is compared with a central finite difference.\n\n");
  std::printf("%-28s %-14s %8s %14s  %s\n", "shape (E K H I T)", "gradient", "entries",
              "max rel error", "verdict");
  bool all_ok = true;
  const GradientCheckCase cases[] = {{{8, 2, 6, 4}, 10, 1, 0.2}, {{4, 4, 5, 3}, 6, 2, 0.3}};
  for (const auto& c : cases) {
    std::vector<GradientCheckResult> results;
    absl::Status s = CheckGradients(c, &results);
    if (!s.ok()) {
      std::printf("error: %s\n", std::string(s.message()).c_str());
      return 1;
    }
    char shape[64];
    std::snprintf(shape, sizeof(shape), "%ld %ld %ld %ld %ld", static_cast<long>(c.shape.num_experts),
                  static_cast<long>(c.shape.top_k), static_cast<long>(c.shape.hidden),
                  static_cast<long>(c.shape.intermediate), static_cast<long>(c.tokens));
    for (const auto& r : results) {
      bool ok = r.max_rel_error < 1e-6;
      all_ok = all_ok && ok;
      std::printf("%-28s %-14s %8ld %14.2e  %s\n", shape, r.tensor.c_str(),
                  static_cast<long>(r.checked), r.max_rel_error, ok ? "ok" : "MISMATCH");
    }
  }
  std::printf("\n%s\n", all_ok ? "PASS: the reference layer's gradients agree with finite differences (< 1e-6)."
                               : "FAIL: a gradient disagrees with finite differences.");
  return all_ok ? 0 : 1;
}
