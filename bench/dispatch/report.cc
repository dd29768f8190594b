#include "bench/dispatch/report.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "moonep/core/dtype.h"

namespace moonep::bench {
namespace {

std::string PolicyOf(const ConfigResult& r) { return planner::PolicyName(r.config.policy); }

bool Good(const OpResult* op) { return op != nullptr && op->wrong == 0 && !op->iter_us.empty(); }

double SumMedian(const ConfigResult& r, const std::vector<std::string>& ops,
                 const std::string& impl) {
  double sum = 0;
  for (const std::string& op : ops) {
    const OpResult* o = r.Find(op, impl);
    if (!Good(o)) return 0;
    sum += o->median_us;
  }
  return sum;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", static_cast<int>(c));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string JsonNumber(double v) {
  if (!std::isfinite(v)) return "null";
  return absl::StrFormat("%.6g", v);
}

std::string PlanStatsJson(const planner::PlanStats& s) {
  return absl::StrFormat(
      "{\"total_tokens\": %d, \"max_load_before\": %d, \"max_load_after\": %d, \"mean_load\": %s, "
      "\"imbalance_before\": %s, \"imbalance_after\": %s, \"replicas\": %d, \"rows_local\": %d, "
      "\"rows_travel\": %d}",
      s.total_tokens, s.max_load_before, s.max_load_after, JsonNumber(s.mean_load),
      JsonNumber(s.imbalance_before()), JsonNumber(s.imbalance_after()), s.replicas, s.rows_local,
      s.rows_travel_intra + s.rows_travel_inter);
}

}  // namespace

double Ratio(const ConfigResult& r, const std::string& op, const std::string& impl,
             const std::string& baseline) {
  const OpResult* a = r.Find(op, impl);
  const OpResult* b = r.Find(op, baseline);
  if (!Good(a) || !Good(b) || b->median_us <= 0) return 0;
  return a->median_us / b->median_us;
}

// The all-to-all baseline's impl: MPI_Alltoallv on the host backends, grouped
// ncclSend/ncclRecv of the same rows on nccl.
static std::string A2aImpl(const ConfigResult& r) {
  return r.config.backend == "nccl" ? "nccl-a2a" : "a2av";
}

void PrintRunHeader(const RunInfo& info, std::FILE* out) {
  std::fprintf(out, "# moonep-bench-dispatch: %d ranks on %d host(s), backends built: %s\n",
               info.num_ranks, info.num_hosts, absl::StrJoin(info.backends, ",").c_str());
  std::fprintf(out, "# command: %s\n", info.command.c_str());
  std::fprintf(out, "# started %s UTC, load average of rank 0's host: %s\n",
               info.started_utc.c_str(), info.load_start.c_str());
  std::fprintf(out,
               "# time: per iteration the slowest rank (all ranks start each operation at a "
               "barrier), then median and p99 over iterations\n"
               "# algbw = size / time; busbw = algbw * (R-1)/R for counts, dispatch, combine; "
               "busiest rank's bytes / time for prefetch, reduce (docs/benchmarks-dispatch.md)\n"
               "# t/none, t/a2av: median time over the same operation with policy none / "
               "MPI_Alltoallv of the same payload (nccl: nccl-a2a, grouped ncclSend/ncclRecv of "
               "it; prefetch, reduce: every replica's bytes sent from / to its home by "
               "MPI_Isend/Irecv, the home summing, as before the replica chains) (< 1: faster)\n");
}

void PrintConfig(const ConfigResult& r, int32_t index, int32_t total, std::FILE* out) {
  const BenchConfig& c = r.config;
  std::fprintf(out, "#\n# [%d/%d] backend=%s policy=%s dtype=%s E=%d K=%d H=%ld I=%ld T=%ld "
               "slots=%d pad=%d, %d+%d iterations\n",
               index, total, c.backend.c_str(), PolicyOf(r).c_str(), DTypeName(c.dtype),
               c.num_experts, c.top_k, static_cast<long>(c.hidden), static_cast<long>(c.intermediate),
               static_cast<long>(c.tokens), r.slots, c.pad_multiple, c.warmup, c.iters);
  std::fprintf(out,
               "#   skew %s -> Zipf s=%.3f, maxvio %.3f; slowest rank's load / mean %.2f -> %.2f, "
               "%d replicas; receive capacity %ld rows\n",
               c.skew.Label().c_str(), r.zipf_s, r.maxvio, r.plan_stats.imbalance_before(),
               r.plan_stats.imbalance_after(), r.plan_stats.replicas,
               static_cast<long>(r.recv_capacity_rows));
  if (!r.note.empty()) std::fprintf(out, "#   %s\n", r.note.c_str());
  std::fprintf(out, "#%11s %9s %12s %11s %8s %11s %11s %12s %12s %7s %7s %7s\n", "op", "impl",
               "size(B)", "count", "type", "time(us)", "p99(us)", "algbw(GB/s)", "busbw(GB/s)",
               "#wrong", "t/none", "t/a2av");
  const std::string pol = PolicyOf(r);
  const std::string a2a = A2aImpl(r);
  for (const OpResult& o : r.ops) {
    std::string time = "-", p99 = "-", alg = "-", bus = "-", vs_none = "-", vs_a2a = "-";
    if (o.wrong == 0) {  // a wrong result never prints as a figure
      time = absl::StrFormat("%.1f", o.median_us);
      p99 = absl::StrFormat("%.1f", o.p99_us);
      if (o.has_bandwidth) {
        alg = absl::StrFormat("%.3f", o.algbw_gbps);
        bus = absl::StrFormat("%.3f", o.busbw_gbps);
      }
      if (o.impl != "none" && o.impl != a2a) {
        const double rn = Ratio(r, o.op, o.impl, "none");
        if (rn > 0) vs_none = absl::StrFormat("%.2f", rn);
      }
      if (o.impl != a2a) {
        const double ra = Ratio(r, o.op, o.impl, a2a);
        if (ra > 0) vs_a2a = absl::StrFormat("%.2f", ra);
      }
    }
    std::fprintf(out, " %11s %9s %12ld %11ld %8s %11s %11s %12s %12s %7ld %7s %7s\n", o.op.c_str(),
                 o.impl.c_str(), static_cast<long>(o.size_bytes), static_cast<long>(o.count),
                 o.type.c_str(), time.c_str(), p99.c_str(), alg.c_str(), bus.c_str(),
                 static_cast<long>(o.wrong), vs_none.c_str(), vs_a2a.c_str());
  }
  const std::vector<std::string> dc = {"dispatch", "combine"};
  const double m = SumMedian(r, dc, pol), n = SumMedian(r, dc, "none"), a = SumMedian(r, dc, a2a);
  std::string line = absl::StrFormat("#   => dispatch+combine: %s %.1f us", pol, m);
  const bool self = pol == "none";  // policy none is its own baseline: no ratio to itself
  if (m > 0 && n > 0 && !self) absl::StrAppendFormat(&line, ", none %.1f us (x%.2f)", n, m / n);
  if (m > 0 && a > 0) absl::StrAppendFormat(&line, ", %s %.1f us (x%.2f)", a2a, a, m / a);
  const std::vector<std::string> layer = {"layer-fwd", "layer-bwd"};
  const double lm = SumMedian(r, layer, pol), ln = SumMedian(r, layer, "none");
  if (lm > 0) {
    absl::StrAppendFormat(&line, "; layer fwd+bwd: %s %.1f us", pol, lm);
    if (ln > 0 && !self) absl::StrAppendFormat(&line, ", none %.1f us (x%.2f)", ln, lm / ln);
  }
  std::fprintf(out, "%s\n", line.c_str());
}

void PrintFooter(const std::vector<ConfigResult>& results, std::FILE* out,
                 const std::string& corrupt) {
  double bus = 0;
  int n = 0;
  int64_t wrong = 0;
  for (const ConfigResult& r : results) {
    for (const OpResult& o : r.ops) {
      wrong += o.wrong;
      if ((o.op == "dispatch" || o.op == "combine") && o.impl == PolicyOf(r) && o.wrong == 0) {
        bus += o.busbw_gbps;
        ++n;
      }
    }
  }
  std::fprintf(out, "#\n# Avg bus bandwidth (dispatch and combine, measured policy): %.4f GB/s\n",
               n > 0 ? bus / n : 0.0);
  if (corrupt.empty()) {
    std::fprintf(out, "# #wrong total: %ld %s\n", static_cast<long>(wrong),
                 wrong == 0 ? "OK" : "FAILED");
  } else if (wrong > 0) {
    std::fprintf(out, "# #wrong total: %ld FAILED, as --corrupt=%s asked: the checks caught it\n",
                 static_cast<long>(wrong), corrupt.c_str());
  } else {
    std::fprintf(out, "# #wrong total: 0, but --corrupt=%s: the self-test did not run (below)\n",
                 corrupt.c_str());
  }
}

std::string ToJson(const RunInfo& info, const std::vector<ConfigResult>& results) {
  std::string s = "{\n";
  absl::StrAppendFormat(&s, "  \"benchmark\": \"moonep-bench-dispatch\",\n  \"ranks\": %d,\n",
                        info.num_ranks);
  absl::StrAppendFormat(&s, "  \"hosts\": %d,\n", info.num_hosts);
  std::vector<std::string> be;
  for (const std::string& b : info.backends) be.push_back(JsonString(b));
  absl::StrAppendFormat(&s, "  \"backends_built\": [%s],\n", absl::StrJoin(be, ", "));
  absl::StrAppendFormat(&s, "  \"command\": %s,\n", JsonString(info.command));
  absl::StrAppendFormat(&s, "  \"started_utc\": %s,\n", JsonString(info.started_utc));
  absl::StrAppendFormat(&s, "  \"loadavg_start\": %s,\n  \"loadavg_end\": %s,\n",
                        JsonString(info.load_start), JsonString(info.load_end));
  int64_t wrong_total = 0;
  s += "  \"results\": [";
  for (size_t i = 0; i < results.size(); ++i) {
    const ConfigResult& r = results[i];
    const BenchConfig& c = r.config;
    s += i ? ",\n    {" : "\n    {";
    absl::StrAppendFormat(
        &s,
        "\"backend\": %s, \"policy\": %s, \"dtype\": %s, \"experts\": %d, \"topk\": %d, "
        "\"hidden\": %d, \"intermediate\": %d, \"tokens\": %d, \"slots\": %d, \"pad_multiple\": %d, "
        "\"warmup\": %d, \"iters\": %d, \"seed\": %d, \"threads\": %d,\n     ",
        JsonString(c.backend), JsonString(PolicyOf(r)), JsonString(DTypeName(c.dtype)),
        c.num_experts, c.top_k, c.hidden, c.intermediate, c.tokens, r.slots, c.pad_multiple,
        c.warmup, c.iters, c.seed, c.threads);
    absl::StrAppendFormat(
        &s, "\"skew\": {\"spec\": %s, \"zipf_s\": %s, \"maxvio\": %s},\n     ",
        JsonString(c.skew.Label()), JsonNumber(r.zipf_s), JsonNumber(r.maxvio));
    absl::StrAppendFormat(&s, "\"plan\": %s,\n     \"plan_none\": %s,\n     ",
                          PlanStatsJson(r.plan_stats), PlanStatsJson(r.none_stats));
    if (!r.note.empty()) absl::StrAppendFormat(&s, "\"note\": %s,\n     ", JsonString(r.note));
    absl::StrAppendFormat(&s, "\"recv_capacity_rows\": %d,\n     \"ops\": [", r.recv_capacity_rows);
    for (size_t j = 0; j < r.ops.size(); ++j) {
      const OpResult& o = r.ops[j];
      wrong_total += o.wrong;
      const bool ok = o.wrong == 0;
      auto fig = [&](double v) { return ok ? JsonNumber(v) : std::string("null"); };
      auto bw = [&](double v) { return ok && o.has_bandwidth ? JsonNumber(v) : std::string("null"); };
      std::vector<std::string> iters;
      for (double v : o.iter_us) iters.push_back(ok ? JsonNumber(v) : std::string("null"));
      absl::StrAppendFormat(
          &s,
          "%s\n       {\"op\": %s, \"impl\": %s, \"size_bytes\": %d, \"count\": %d, \"type\": %s, "
          "\"time_us\": {\"median\": %s, \"p99\": %s, \"mean\": %s, \"min\": %s, \"max\": %s}, "
          "\"algbw_gbps\": %s, \"busbw_gbps\": %s, \"wrong\": %d, \"checked\": %d, "
          "\"sent_bytes_max\": %d, \"dedup_rows_max\": %d, \"t_over_none\": %s, "
          "\"t_over_a2av\": %s, \"iter_us\": [%s]}",
          j ? "," : "", JsonString(o.op), JsonString(o.impl), o.size_bytes, o.count,
          JsonString(o.type), fig(o.median_us), fig(o.p99_us), fig(o.mean_us), fig(o.min_us),
          fig(o.max_us), bw(o.algbw_gbps), bw(o.busbw_gbps), o.wrong, o.checked, o.sent_bytes_max,
          o.dedup_rows_max,
          Ratio(r, o.op, o.impl, "none") > 0 && o.impl != "none"
              ? JsonNumber(Ratio(r, o.op, o.impl, "none")) : std::string("null"),
          Ratio(r, o.op, o.impl, A2aImpl(r)) > 0 && o.impl != A2aImpl(r)
              ? JsonNumber(Ratio(r, o.op, o.impl, A2aImpl(r))) : std::string("null"),
          absl::StrJoin(iters, ", "));
    }
    s += "]}";
  }
  absl::StrAppendFormat(&s, "\n  ],\n  \"wrong_total\": %d\n}\n", wrong_total);
  return s;
}

}  // namespace moonep::bench
