#include "master/metrics.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ballast::master {
namespace {

std::string Escape(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

std::string Num(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return absl::StrFormat("%.17g", v);
}

class Writer {
 public:
  void Family(const char* name, const char* type, const char* help) {
    absl::StrAppend(&out_, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
  }
  void Sample(const std::string& name, double v, const std::string& labels = "") {
    absl::StrAppend(&out_, name, labels.empty() ? "" : absl::StrCat("{", labels, "}"), " ", Num(v), "\n");
  }
  void Hist(const char* name, const char* help, const Histogram& h) {
    Family(name, "histogram", help);
    for (size_t i = 0; i < h.bounds.size(); ++i) {
      Sample(absl::StrCat(name, "_bucket"), static_cast<double>(h.counts[i]), absl::StrCat("le=\"", Num(h.bounds[i]), "\""));
    }
    Sample(absl::StrCat(name, "_bucket"), static_cast<double>(h.count), "le=\"+Inf\"");
    Sample(absl::StrCat(name, "_sum"), h.sum);
    Sample(absl::StrCat(name, "_count"), static_cast<double>(h.count));
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

std::string Label(const char* key, const std::string& value) { return absl::StrCat(key, "=\"", Escape(value), "\""); }

}  // namespace

std::string PrometheusText(const MetricsInput& in) {
  const v1::JobStatus& st = *in.status;
  Writer w;
  w.Family("ballast_info", "gauge", "The job this master runs (always 1), with its id and state.");
  w.Sample("ballast_info", 1, absl::StrCat(Label("job_id", st.job_id()), ",", Label("state", st.state())));
  w.Family("ballast_up_seconds", "gauge", "Seconds since the master started the job.");
  w.Sample("ballast_up_seconds", st.uptime_s());
  const v1::Goodput& g = st.goodput();
  if (g.known()) {  // absent until the workers report steps (ballast.step)
    w.Family("ballast_goodput_ratio", "gauge",
             "Share of the time the job held its nodes that trained the model for the first time "
             "(productive / (wall - queued - preempted)).");
    w.Sample("ballast_goodput_ratio", g.goodput());
  }
  w.Family("ballast_time_seconds_total", "counter",
           "The job's wall time by what it was spent on (docs/observability.md); the parts add up to the wall time. "
           "idle is the time since the world's last step, which moves to productive or recompute when the step completes.");
  for (const auto& p : g.parts()) w.Sample("ballast_time_seconds_total", p.seconds(), Label("part", p.part()));
  w.Family("ballast_recomputed_steps_total", "counter", "Steps run again after rollbacks.");
  w.Sample("ballast_recomputed_steps_total", static_cast<double>(g.recomputed_steps()));
  w.Family("ballast_restarts_total", "counter",
           "Recoveries of the workers (in-place restarts and re-formed worlds after a node loss), by failure cause.");
  if (in.restarts != nullptr) {
    for (const auto& [cause, n] : *in.restarts) w.Sample("ballast_restarts_total", n, Label("cause", cause));
  }
  w.Family("ballast_rollbacks_total", "counter",
           "Rollbacks after bad losses (ballast.step(step, loss=)): NaN/Inf (reason=\"nan\") and spikes "
           "(reason=\"loss-spike\"); they are also in ballast_restarts_total.");
  for (const char* reason : {"nan", "loss-spike"}) {
    int n = 0;
    if (in.restarts != nullptr) {
      if (auto it = in.restarts->find(reason); it != in.restarts->end()) n = it->second;
    }
    w.Sample("ballast_rollbacks_total", n, Label("reason", reason));
  }
  w.Family("ballast_checkpoint_write_errors_total", "counter",
           "Checkpoint shard writes that failed on the nodes (disk full, I/O errors); the agents retry them.");
  w.Sample("ballast_checkpoint_write_errors_total", st.persist_errors_total());
  w.Family("ballast_failures_total", "counter", "Failures the master decided on (survived or not).");
  w.Sample("ballast_failures_total", st.failures_total());
  std::map<std::string, int> states;
  for (const char* s : kNodeStates) states[s] = 0;
  int stragglers = 0;
  for (const auto& n : st.nodes()) {
    ++states[n.state()];
    stragglers += n.straggler() ? 1 : 0;
  }
  w.Family("ballast_nodes", "gauge", "Nodes the master knows, by state.");
  for (const auto& [s, n] : states) w.Sample("ballast_nodes", n, Label("state", s));
  w.Family("ballast_stragglers", "gauge", "Nodes of the current round slower than the straggler factor x the median.");
  w.Sample("ballast_stragglers", stragglers);
  w.Family("ballast_round", "gauge", "The current rendezvous round (0 before the first).");
  w.Sample("ballast_round", static_cast<double>(st.round()));
  w.Family("ballast_world_size", "gauge", "Workers in the current round.");
  w.Sample("ballast_world_size", st.world_size());
  w.Family("ballast_step", "gauge", "The highest training step the world reached (ballast.step).");
  w.Sample("ballast_step", static_cast<double>(g.high_water_step()));
  if (in.recovery != nullptr) {
    w.Hist("ballast_recovery_seconds",
           "Seconds from a failure decision until every node made the next round's first step.", *in.recovery);
  }
  if (in.ckpt_save != nullptr) {
    w.Hist("ballast_ckpt_save_seconds",
           "Seconds each flash checkpoint save blocked a worker's training (ballast.checkpoint).", *in.ckpt_save);
  }
  return w.Take();
}

}  // namespace ballast::master
