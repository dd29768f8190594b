#include "planner/sim/report.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "moonep/core/status.h"

namespace moonep::sim {

namespace {

std::string RoutingDescription(const SimOptions& o) {
  if (!o.trace_path.empty()) return absl::StrCat("trace ", o.trace_path);
  const RoutingParams& p = o.routing;
  switch (p.kind) {
    case RoutingKind::kUniform: return "uniform";
    case RoutingKind::kZipf: return absl::StrFormat("zipf(s=%g)", p.zipf_s);
    case RoutingKind::kHotspot:
      return absl::StrFormat("hotspot(s=%g, hot_experts=%d, hot_factor=%g)", p.zipf_s, p.hot_experts,
                             p.hot_factor);
    case RoutingKind::kDrift:
      return absl::StrFormat("drift(s=%g, sigma=%g, theta=%g)", p.zipf_s, p.drift_sigma, p.drift_theta);
    case RoutingKind::kDomain: return absl::StrFormat("domain(s=%g, domains=%d)", p.zipf_s, p.domains);
    case RoutingKind::kCoactivation:
      return absl::StrFormat("coactivation(s=%g, group=%d, prob=%g)", p.zipf_s, p.coact_group,
                             p.coact_prob);
  }
  return "?";
}

const char* DetailNote(Detail d) {
  switch (d) {
    case Detail::kTokens: return "tokens: loads, replicas and bytes exact";
    case Detail::kCounts: return "counts: loads, replicas and rows exact, dedup estimated";
    case Detail::kTotals: return "totals: loads and replicas exact, locality and dedup estimated";
  }
  return "";
}

}  // namespace

std::string FormatSummary(const SimResult& r, const SimOptions& o) {
  const CostConfig& c = o.cost;
  std::string steps =
      r.layers > 1 ? absl::StrFormat("%d records of %d layers (each layer planned on its own)",
                                     r.steps, r.layers)
                   : absl::StrFormat("%d steps", r.steps);
  if (r.stopped_by_steps) {
    absl::StrAppendFormat(&steps, " (stopped by --steps=%d before the end of the trace)", o.steps);
  }
  std::string out = absl::StrFormat(
      "moonep-sim: R=%d E=%d K=%d T=%d, routing %s, %s, detail %s (%s), %.2f s\n", r.num_ranks,
      r.num_experts, r.topk, r.tokens_per_rank, RoutingDescription(o), steps, DetailName(r.detail),
      DetailNote(r.detail), r.wall_seconds);
  absl::StrAppendFormat(&out,
                        "cost model: H=%d I=%d, %s, %g TFLOP/s per rank, %d ranks/node, intra %g GB/s, "
                        "inter %g GB/s, prefetch %s dispatch\n",
                        c.hidden, c.intermediate, c.training ? "forward+backward" : "forward only",
                        c.tflops, c.ranks_per_node, c.intra_gbps, c.inter_gbps,
                        c.overlap_prefetch ? "overlaps" : "before");
  if (!c.speeds.empty()) {
    absl::StrAppendFormat(&out,
                          "rank speeds %s (the others 1): a rank computes at %g TFLOP/s x its "
                          "speed; moonep, moonep-weighed and moonep-greedy plan with the speeds, "
                          "the others without; imb. counts tokens, not time\n",
                          FormatRankSpeeds(c.speeds), c.tflops);
  }
  out += "\n";
  absl::StrAppendFormat(&out, "%-17s %8s %8s %9s %10s %9s %9s %8s |", "policy", "imb.mean", "imb.p99",
                        "replicas", "MB/step", "step ms", "p99 ms", "speedup");
  for (const std::string& part : StepTimePartNames()) absl::StrAppendFormat(&out, " %8s", part);
  out += "  (mean ms)\n";
  const double base = r.policies.empty() ? 0 : r.policies[0].mean_time();
  for (const PolicySummary& p : r.policies) {
    const double t = p.mean_time();
    absl::StrAppendFormat(&out, "%-17s %8.3f %8.3f %9.1f %10.1f %9.3f %9.3f %7.2fx |", p.name,
                          p.mean_imbalance(), p.imbalance.Quantile(0.99), p.mean(p.sum_replicas),
                          p.mean(p.sum_bytes) / 1e6, t * 1e3, p.step_time.Quantile(0.99) * 1e3,
                          t > 0 ? base / t : 0.0);
    for (size_t i = 0; i < StepTimePartNames().size(); ++i) {
      absl::StrAppendFormat(&out, " %8.3f", p.mean(StepTimePart(p.sum_time, i)) * 1e3);
    }
    out += "\n";
  }
  if (o.lower_bound) {
    out += "\nlower-bound: the planner's load lower bound with free communication (compute + counts only).\n";
    if (!c.speeds.empty()) {
      out += "With rank speeds, its imb. is the least load in tokens (LoadLowerBound without speeds: "
             "it does not depend on them), and its compute the least time of the slowest rank "
             "(the total over the sum of the speeds; each expert over its fastest possible "
             "holders).\n";
    }
  }
  return out;
}

// ---- CSV / JSON -------------------------------------------------------------------------------

namespace {

// a * b (both >= 0) for the byte columns, INT64_MAX when past it.
int64_t SaturatingProduct(int64_t a, int64_t b) {
  int64_t v = 0;
  return __builtin_mul_overflow(a, b, &v) ? INT64_MAX : v;
}

struct Field {
  const char* name;
  std::string value;
  bool is_string;
};

std::vector<Field> Fields(const StepRecord& r) {
  const PlanMetrics& m = r.metrics;
  const int64_t dispatch_rows = m.dispatch_intra + m.dispatch_inter;
  auto num = [](double v) { return absl::StrFormat("%.9g", v); };
  auto i64 = [](int64_t v) { return absl::StrCat(v); };
  return {
      {"step", i64(r.step), false},
      {"layer", i64(r.layer), false},
      {"policy", *r.policy, true},
      {"detail", DetailName(m.detail), true},
      {"total_tokens", i64(m.total_tokens), false},
      {"max_load", i64(m.max_load), false},
      {"mean_load", num(m.mean_load), false},
      {"imbalance", num(m.imbalance()), false},
      {"replicas", i64(m.replicas), false},
      {"prefetch_intra", i64(m.prefetch_intra), false},
      {"prefetch_inter", i64(m.prefetch_inter), false},
      {"rows_local", i64(m.rows_local), false},
      {"rows_intra", i64(m.rows_intra), false},
      {"rows_inter", i64(m.rows_inter), false},
      {"dispatch_rows_intra", i64(m.dispatch_intra), false},
      {"dispatch_rows_inter", i64(m.dispatch_inter), false},
      {"dispatch_bytes", i64(SaturatingProduct(dispatch_rows, r.row_bytes)), false},
      {"prefetch_bytes", i64(SaturatingProduct(m.replicas, r.expert_bytes)), false},
      {"reduce_bytes", i64(SaturatingProduct(m.replicas, r.grad_bytes)), false},
      {"t_counts", num(r.time.counts), false},
      {"t_prefetch", num(r.time.prefetch), false},
      {"t_dispatch", num(r.time.dispatch), false},
      {"t_compute", num(r.time.compute), false},
      {"t_combine", num(r.time.combine), false},
      {"t_reduce", num(r.time.reduce), false},
      {"t_total", num(r.time.total), false},
  };
}

absl::Status WriteAll(std::FILE* f, const std::string& s, const std::string& name) {
  if (std::fwrite(s.data(), 1, s.size(), f) != s.size()) {
    return SystemError("writing %s failed: %s", name, std::strerror(errno));
  }
  return absl::OkStatus();
}

}  // namespace

std::string CsvHeader() {
  StepRecord r;
  static const std::string empty;
  r.policy = &empty;
  std::string out;
  for (const Field& f : Fields(r)) absl::StrAppend(&out, out.empty() ? "" : ",", f.name);
  return out;
}

CsvSink::CsvSink(std::FILE* file, std::string name) : file_(file), name_(std::move(name)) {
  (void)WriteAll(file_, CsvHeader() + "\n", name_);
}

absl::Status CsvSink::OnStep(const StepRecord& r) {
  std::string line;
  for (const Field& f : Fields(r)) absl::StrAppend(&line, line.empty() ? "" : ",", f.value);
  line += "\n";
  return WriteAll(file_, line, name_);
}

JsonSink::JsonSink(std::FILE* file, std::string name) : file_(file), name_(std::move(name)) {
  (void)WriteAll(file_, "[\n", name_);
}

absl::Status JsonSink::OnStep(const StepRecord& r) {
  std::string line = first_ ? "{" : ",\n{";
  first_ = false;
  bool first_field = true;
  for (const Field& f : Fields(r)) {
    absl::StrAppend(&line, first_field ? "" : ", ", "\"", f.name, "\": ");
    first_field = false;
    if (f.is_string) absl::StrAppend(&line, "\"", f.value, "\"");  // names hold no quotes
    else absl::StrAppend(&line, f.value);
  }
  line += "}";
  return WriteAll(file_, line, name_);
}

absl::Status JsonSink::Finish() { return WriteAll(file_, first_ ? "]\n" : "\n]\n", name_); }

absl::Status TeeSink::OnStep(const StepRecord& r) {
  for (StepSink* s : sinks_) MOONEP_RETURN_IF_ERROR(s->OnStep(r));
  return absl::OkStatus();
}

// ---- SVG --------------------------------------------------------------------------------------

namespace {

const char* const kPalette[] = {"#555555", "#1f77b4", "#d62728", "#2ca02c",
                                "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"};

std::string Color(const std::string& policy, size_t index) {
  if (policy == "lower-bound") return "#000000";
  return kPalette[index % (sizeof(kPalette) / sizeof(kPalette[0]))];
}

std::string Escape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    switch (ch) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += ch;
    }
  }
  return out;
}

// Round tick steps (1, 2, 5 x 10^k) covering [lo, hi] with about `n` ticks.
std::vector<double> Ticks(double lo, double hi, int n) {
  std::vector<double> ticks;
  if (!(hi > lo)) hi = lo + 1;
  const double raw = (hi - lo) / std::max(1, n);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (raw <= m * mag) {
      step = m * mag;
      break;
    }
  }
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) {
    ticks.push_back(std::abs(t) < step * 1e-9 ? 0.0 : t);
  }
  return ticks;
}

std::string Num(double v) { return absl::StrFormat("%.1f", v); }
std::string Label(double v) { return absl::StrFormat("%g", v); }

// A plot area with axes; maps data to pixels.
class Chart {
 public:
  Chart(double width, double height, const std::string& title) : width_(width), height_(height) {
    absl::StrAppendFormat(&body_,
                          "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
                          "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"12\">\n"
                          "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
                          int(width), int(height), int(width), int(height));
    Text(width / 2, 22, title, "middle", 15, "bold");
  }
  void SetArea(double left, double top, double right, double bottom) {
    left_ = left;
    top_ = top;
    right_ = width_ - right;
    bottom_ = height_ - bottom;
  }
  void SetRange(double x0, double x1, double y0, double y1) {
    x0_ = x0;
    x1_ = x1 > x0 ? x1 : x0 + 1;
    y0_ = y0;
    y1_ = y1 > y0 ? y1 : y0 + 1;
  }
  double X(double x) const { return left_ + (x - x0_) / (x1_ - x0_) * (right_ - left_); }
  double Y(double y) const { return bottom_ - (y - y0_) / (y1_ - y0_) * (bottom_ - top_); }

  void Axes(const std::string& xlabel, const std::string& ylabel, bool xticks = true) {
    for (double t : Ticks(y0_, y1_, 6)) {
      Line(left_, Y(t), right_, Y(t), "#e0e0e0", 1);
      Text(left_ - 6, Y(t) + 4, Label(t), "end", 11);
    }
    if (xticks) {
      for (double t : Ticks(x0_, x1_, 8)) {
        Line(X(t), bottom_, X(t), bottom_ + 4, "#000000", 1);
        Text(X(t), bottom_ + 17, Label(t), "middle", 11);
      }
    }
    Line(left_, bottom_, right_, bottom_, "#000000", 1);
    Line(left_, top_, left_, bottom_, "#000000", 1);
    Text((left_ + right_) / 2, height_ - 10, xlabel, "middle", 12);
    absl::StrAppendFormat(&body_,
                          "<text x=\"14\" y=\"%s\" text-anchor=\"middle\" font-size=\"12\" "
                          "transform=\"rotate(-90 14 %s)\">%s</text>\n",
                          Num((top_ + bottom_) / 2), Num((top_ + bottom_) / 2), Escape(ylabel));
  }
  void Line(double x0, double y0, double x1, double y1, const std::string& color, double w,
            const std::string& dash = "") {
    absl::StrAppendFormat(&body_,
                          "<line x1=\"%s\" y1=\"%s\" x2=\"%s\" y2=\"%s\" stroke=\"%s\" "
                          "stroke-width=\"%g\"%s/>\n",
                          Num(x0), Num(y0), Num(x1), Num(y1), color, w,
                          dash.empty() ? "" : absl::StrCat(" stroke-dasharray=\"", dash, "\""));
  }
  void Polyline(const std::vector<std::pair<double, double>>& pts, const std::string& color,
                double w, const std::string& dash = "", const std::string& fill = "none") {
    std::string p;
    for (const auto& [x, y] : pts) absl::StrAppend(&p, Num(X(x)), ",", Num(Y(y)), " ");
    absl::StrAppendFormat(&body_,
                          "<%s points=\"%s\" fill=\"%s\" stroke=\"%s\" stroke-width=\"%g\"%s/>\n",
                          fill == "none" ? "polyline" : "polygon", p, fill, color, w,
                          dash.empty() ? "" : absl::StrCat(" stroke-dasharray=\"", dash, "\""));
  }
  void Rect(double x, double y, double w, double h, const std::string& fill, const std::string& tip) {
    absl::StrAppendFormat(&body_,
                          "<rect x=\"%s\" y=\"%s\" width=\"%s\" height=\"%s\" fill=\"%s\">"
                          "<title>%s</title></rect>\n",
                          Num(x), Num(y), Num(std::max(0.0, w)), Num(std::max(0.0, h)), fill,
                          Escape(tip));
  }
  void Text(double x, double y, const std::string& s, const std::string& anchor, int size,
            const std::string& weight = "normal") {
    absl::StrAppendFormat(&body_,
                          "<text x=\"%s\" y=\"%s\" text-anchor=\"%s\" font-size=\"%d\" "
                          "font-weight=\"%s\">%s</text>\n",
                          Num(x), Num(y), anchor, size, weight, Escape(s));
  }
  // Legend entries at the right of the plot area.
  void Legend(const std::vector<std::pair<std::string, std::string>>& entries, bool boxes = false) {
    double y = top_ + 8;
    for (const auto& [name, color] : entries) {
      if (boxes) Rect(right_ + 14, y - 9, 14, 10, color, name);
      else Line(right_ + 12, y - 4, right_ + 32, y - 4, color, 2.5);
      Text(right_ + 38, y, name, "start", 12);
      y += 18;
    }
  }
  double left() const { return left_; }
  double right() const { return right_; }
  double top() const { return top_; }
  double bottom() const { return bottom_; }
  std::string Finish() { return body_ + "</svg>\n"; }

 private:
  double width_, height_;
  double left_ = 60, top_ = 40, right_ = 0, bottom_ = 0;
  double x0_ = 0, x1_ = 1, y0_ = 0, y1_ = 1;
  std::string body_;
};

}  // namespace

std::string ImbalanceSvg(const SimResult& r) {
  Chart chart(900, 420, "Rank max/mean load per step");
  chart.SetArea(60, 40, 180, 45);
  double ymax = 1.0;
  for (const PolicySummary& p : r.policies) {
    for (const auto& pt : p.imbalance_series.Points()) ymax = std::max(ymax, pt.mean);
  }
  chart.SetRange(0, std::max<double>(1, r.steps - 1), 0.9, ymax * 1.05);
  chart.Axes(r.steps > 512 ? "step (each point: mean over a run of steps)" : "step",
             "max / mean rank load");
  std::vector<std::pair<std::string, std::string>> legend;
  for (size_t i = 0; i < r.policies.size(); ++i) {
    const PolicySummary& p = r.policies[i];
    std::vector<std::pair<double, double>> pts;
    for (const auto& pt : p.imbalance_series.Points()) {
      pts.emplace_back((pt.first_step + pt.last_step) / 2, pt.mean);
    }
    if (pts.size() == 1) pts.emplace_back(pts[0].first + 0.5, pts[0].second);
    const std::string color = Color(p.name, i);
    chart.Polyline(pts, color, 1.6, p.name == "lower-bound" ? "4 3" : "");
    legend.emplace_back(p.name, color);
  }
  chart.Legend(legend);
  return chart.Finish();
}

std::string RankLoadSvg(const SimResult& r) {
  Chart chart(960, 420,
              r.snapshot_step >= 0 ? absl::StrFormat("Per-rank load at step %d", r.snapshot_step)
                                   : std::string("Per-rank load (snapshot step not reached)"));
  chart.SetArea(70, 40, 240, 45);
  const int32_t R = static_cast<int32_t>(r.snapshot_home_load.size());
  double ymax = 1;
  for (int64_t v : r.snapshot_home_load) ymax = std::max<double>(ymax, v);
  double total = 0;
  for (int64_t v : r.snapshot_home_load) total += v;
  chart.SetRange(0, std::max(1, R), 0, ymax * 1.05);
  chart.Axes("rank", "tokens computed (rows)");
  std::vector<std::pair<std::string, std::string>> legend;
  if (R > 0) {
    // Before planning: home placement, as a filled step outline.
    std::vector<std::pair<double, double>> area = {{0, 0}};
    for (int32_t d = 0; d < R; ++d) {
      area.emplace_back(d, r.snapshot_home_load[d]);
      area.emplace_back(d + 1, r.snapshot_home_load[d]);
    }
    area.emplace_back(R, 0);
    chart.Polyline(area, "#bbbbbb", 0.5, "", "#dddddd");
    legend.emplace_back("before (home placement)", "#bbbbbb");
    for (size_t i = 1; i < r.policies.size(); ++i) {
      const PolicySummary& p = r.policies[i];
      if (static_cast<int32_t>(p.snapshot_load.size()) != R) continue;
      std::vector<std::pair<double, double>> pts;
      for (int32_t d = 0; d < R; ++d) {
        pts.emplace_back(d, p.snapshot_load[d]);
        pts.emplace_back(d + 1, p.snapshot_load[d]);
      }
      const std::string color = Color(p.name, i);
      chart.Polyline(pts, color, 1.4);
      legend.emplace_back(absl::StrCat("after: ", p.name), color);
    }
    const double mean = total / R;
    chart.Line(chart.X(0), chart.Y(mean), chart.X(R), chart.Y(mean), "#000000", 1, "4 3");
    legend.emplace_back("mean load", "#000000");
  }
  chart.Legend(legend);
  return chart.Finish();
}

std::string StepTimeSvg(const SimResult& r) {
  const double row_h = 26;
  const double height = 90 + row_h * r.policies.size() + 30;
  Chart chart(900, height, "Estimated MoE layer step time by part (mean per step)");
  chart.SetArea(130, 40, 170, 50);
  double xmax = 0;
  for (const PolicySummary& p : r.policies) xmax = std::max(xmax, p.mean(p.sum_time.total) * 1e3);
  chart.SetRange(0, xmax > 0 ? xmax * 1.05 : 1, 0, 1);
  for (double t : Ticks(0, xmax * 1.05, 8)) {
    chart.Line(chart.X(t), chart.top(), chart.X(t), chart.bottom(), "#e0e0e0", 1);
    chart.Text(chart.X(t), chart.bottom() + 16, Label(t), "middle", 11);
  }
  chart.Line(chart.left(), chart.bottom(), chart.right(), chart.bottom(), "#000000", 1);
  chart.Text((chart.left() + chart.right()) / 2, height - 12, "milliseconds", "middle", 12);
  static const char* const kPartColors[] = {"#8c8c8c", "#9467bd", "#1f77b4",
                                            "#2ca02c", "#ff7f0e", "#d62728"};
  const std::vector<std::string>& parts = StepTimePartNames();
  for (size_t i = 0; i < r.policies.size(); ++i) {
    const PolicySummary& p = r.policies[i];
    const double y = chart.top() + 8 + i * row_h;
    chart.Text(chart.left() - 8, y + row_h * 0.5, p.name, "end", 12);
    double x = 0;
    for (size_t k = 0; k < parts.size(); ++k) {
      const double ms = p.mean(StepTimePart(p.sum_time, k)) * 1e3;
      chart.Rect(chart.X(x), y, chart.X(x + ms) - chart.X(x), row_h * 0.7, kPartColors[k],
                 absl::StrFormat("%s %s: %.3f ms", p.name, parts[k], ms));
      x += ms;
    }
    chart.Text(chart.X(x) + 4, y + row_h * 0.5, absl::StrFormat("%.2f", x), "start", 11);
  }
  std::vector<std::pair<std::string, std::string>> legend;
  for (size_t k = 0; k < parts.size(); ++k) legend.emplace_back(parts[k], kPartColors[k]);
  chart.Legend(legend, /*boxes=*/true);
  return chart.Finish();
}

absl::Status PrepareSvgDir(const std::string& dir) {
  MOONEP_CHECK_ARG(!dir.empty(), "svg directory is empty");
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return InvalidArgument("cannot create svg directory '%s': %s", dir, std::strerror(errno));
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return InvalidArgument("svg path '%s' is not a directory", dir);
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return InvalidArgument("cannot write into svg directory '%s': %s", dir, std::strerror(errno));
  }
  return absl::OkStatus();
}

absl::Status WriteSvgs(const SimResult& result, const std::string& dir) {
  MOONEP_RETURN_IF_ERROR(PrepareSvgDir(dir));
  const std::pair<const char*, std::string> files[] = {
      {"imbalance.svg", ImbalanceSvg(result)},
      {"rank_load.svg", RankLoadSvg(result)},
      {"step_time.svg", StepTimeSvg(result)},
  };
  for (const auto& [name, text] : files) {
    const std::string path = dir + "/" + name;
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (!f) return InvalidArgument("cannot write '%s': %s", path, std::strerror(errno));
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    if (std::fclose(f) != 0 || !ok) return SystemError("writing '%s' failed", path);
  }
  return absl::OkStatus();
}

}  // namespace moonep::sim
