// ballast status: print a running job's state (job, round, world, nodes,
// restarts, last failure) from its master.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ballast/v1/master.grpc.pb.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/tls_flags.h"
#include "common/tls.h"
#include "common/grpc_util.h"
#include "common/net.h"
#include "master/goodput.h"
#include "master/http_server.h"

namespace ballast::cli {
namespace {

// Each node's last (re)start, stage by stage.
void PrintTimelines(const v1::JobStatus& s) {
  bool header = false;
  for (const auto& n : s.nodes()) {
    if (!n.has_timeline()) continue;
    const v1::StartTimeline& t = n.timeline();
    if (!header) std::printf("last (re)start of each node (ms after the failure it saw, else after the decision):\n");
    header = true;
    auto at = [](double ms) { return absl::StrFormat("+%.0f", ms); };
    std::string stages = t.failure_seen() ? absl::StrCat("failure 0, decision ", at(t.decision_ms())) : "decision 0";
    absl::StrAppend(&stages, ", old workers stopped ", at(t.stopped_ms()), ", started ", at(t.started_ms()));
    if (t.pg_up_ms() > 0) absl::StrAppend(&stages, ", process group up ", at(t.pg_up_ms()));
    absl::StrAppend(&stages, ", first step ", at(t.first_step_ms()));
    std::printf("  %-28s round %ld %s, %s: %s\n", n.node_id().c_str(), static_cast<long>(t.round()),
                t.recovery() ? "restart" : "start", t.start().c_str(), stages.c_str());
  }
}

// Where the ranks' checkpoint replicas are, by holder: "node-1: ranks 0-3 (step 12)".
void PrintReplicas(const v1::JobStatus& s) {
  if (s.replicas().empty()) return;
  struct Held {
    std::vector<int> ranks;
    int64_t min_step = INT64_MAX, max_step = 0;
  };
  std::map<std::string, Held> by_holder;
  for (const auto& r : s.replicas()) {
    Held& h = by_holder[r.holder()];
    h.ranks.push_back(r.rank());
    h.min_step = std::min(h.min_step, r.step());
    h.max_step = std::max(h.max_step, r.step());
  }
  std::printf("checkpoint replicas in memory:\n");
  for (auto& [holder, h] : by_holder) {
    std::sort(h.ranks.begin(), h.ranks.end());
    std::string ranks;
    for (size_t i = 0; i < h.ranks.size();) {
      size_t j = i;
      while (j + 1 < h.ranks.size() && h.ranks[j + 1] == h.ranks[j] + 1) ++j;
      absl::StrAppend(&ranks, ranks.empty() ? "" : ",", h.ranks[i], j > i ? absl::StrCat("-", h.ranks[j]) : "");
      i = j + 1;
    }
    std::string steps = h.min_step == h.max_step ? absl::StrCat("step ", h.max_step)
                                                 : absl::StrCat("steps ", h.min_step, "-", h.max_step);
    std::printf("  %-28s ranks %s (%s)\n", holder.c_str(), ranks.c_str(), steps.c_str());
  }
}

// Every failure the job met, newest last: what broke, how fast it was seen
// and how long until training ran again.
void PrintFailures(const v1::JobStatus& s) {
  if (s.failures().empty()) return;
  std::printf("failures (%d):\n", s.failures_total());
  if (s.failures_total() > s.failures_size()) {
    std::printf("  (the oldest %d not listed)\n", s.failures_total() - s.failures_size());
  }
  for (const auto& f : s.failures()) {
    std::string who = absl::StrCat("node ", f.node_id(), f.node_rank() >= 0 ? absl::StrCat(" (node rank ", f.node_rank(), ")") : "",
                                   f.global_rank() >= 0 ? absl::StrCat(", rank ", f.global_rank()) : "");
    std::string after = f.resumed() ? absl::StrFormat("resumed after %.2f s, %d steps redone", f.resume_s(), f.steps_lost())
                                    : std::string("not resumed yet");
    std::printf("  +%.1fs round %ld: %s: %s -> %s; detected in %.2f s, %s\n", f.at_s(), static_cast<long>(f.round()),
                who.c_str(), f.cause().c_str(), f.action().c_str(), f.detection_s(), after.c_str());
  }
}

void PrintHuman(const v1::JobStatus& s) {
  std::printf("job %s: %s, round %ld, world %d workers, restarts %d/%d, up %.0f s\n", s.job_id().c_str(),
              s.state().c_str(), static_cast<long>(s.round()), s.world_size(), s.restart_count(),
              s.spec().max_restarts(), s.uptime_s());
  std::printf("nodes %d:%d (unit %d)\n", s.spec().min_nodes(), s.spec().max_nodes(), s.spec().node_unit());
  if (s.has_goodput()) std::printf("%s\n", master::FormatGoodput(s.goodput()).c_str());
  if (!s.message().empty()) std::printf("message: %s\n", s.message().c_str());
  std::printf("  %-28s %-16s %-9s %5s %8s %10s %8s %10s\n", "NODE", "HOST", "STATE", "RANK", "WORKERS",
              "HEARTBEAT", "STEP", "STEP TIME");
  std::string stragglers;
  for (const auto& n : s.nodes()) {
    std::string rank = n.group_rank() >= 0 ? std::to_string(n.group_rank()) : "-";
    std::string hb = absl::StrFormat("%.1fs ago", n.last_heartbeat_age_s());
    std::string step = n.last_step() > 0 ? std::to_string(n.last_step()) : "-";
    std::string step_time = n.step_time_s() > 0 ? absl::StrFormat("%.3fs%s", n.step_time_s(), n.straggler() ? "*" : "")
                                                : "-";
    std::printf("  %-28s %-16s %-9s %5s %8d %10s %8s %10s\n", n.node_id().c_str(), n.host().c_str(),
                n.state().c_str(), rank.c_str(), n.local_world_size(), hb.c_str(), step.c_str(), step_time.c_str());
    if (n.straggler()) stragglers += (stragglers.empty() ? "" : ", ") + n.node_id();
  }
  // A straggler's step time exceeds BALLAST_STRAGGLER_FACTOR x the round's median.
  std::printf("stragglers: %s\n", stragglers.empty() ? "none" : stragglers.c_str());
  if (!s.precheck().empty()) std::printf("pre-flight check: %s\n", s.precheck().c_str());
  if (!s.last_failure().node_id().empty()) {
    const auto& f = s.last_failure();
    std::printf("last failure: node %s (%s), rank %d (local %d), %s, round %ld\n", f.node_id().c_str(),
                f.host().c_str(), f.global_rank(), f.local_rank(), f.cause().c_str(), static_cast<long>(f.round()));
    if (!f.stderr_tail().empty()) std::printf("  stderr tail:\n%s\n", f.stderr_tail().c_str());
  } else {
    std::printf("last failure: none\n");
  }
  PrintFailures(s);
  PrintTimelines(s);
  PrintReplicas(s);
}



}  // namespace

int StatusCommand(const Args& args) {
  CLI::App app{"Print the state of a running job from its master.", "status"};
  std::string master_addr, token;
  bool json = false;
  double timeout_s = 5;
  app.add_option("--master,--rdzv-endpoint", master_addr, "The master's HOST:PORT")->required();
  app.add_option("--token", token, "The job token (default: $BALLAST_TOKEN)");
  app.add_flag("--json", json, "Print the status as JSON");
  app.add_option("--timeout", timeout_s, "Seconds to wait for the master")->capture_default_str();
  TlsFlags tls;
  tls.Add(app, /*server=*/false);
  if (int rc = ParseOrExit(app, args); rc >= 0) return rc;
  auto credentials = MasterChannelCredentials(tls.Get());
  if (!credentials.ok()) {
    std::fprintf(stderr, "ballast status: %s\n", std::string(credentials.status().message()).c_str());
    return kUsageExit;
  }
  auto ep = ParseEndpoint(master_addr);
  if (!ep.ok()) {
    std::fprintf(stderr, "ballast status: %s\n", std::string(ep.status().message()).c_str());
    return kUsageExit;
  }
  auto channel = MasterChannel(ep->ToString(), *credentials);
  auto stub = v1::Master::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.AddMetadata(kTokenMetadataKey, TokenFromFlagOrEnv(token));
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  ctx.set_wait_for_ready(true);
  v1::JobStatus status;
  grpc::Status st = stub->GetStatus(&ctx, v1::StatusRequest(), &status);
  if (!st.ok()) {
    if (st.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
      std::fprintf(stderr, "ballast status: the master at %s refused the token: pass the job's token with --token or BALLAST_TOKEN\n",
                   ep->ToString().c_str());
    } else if (st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
               st.error_code() == grpc::StatusCode::UNAVAILABLE) {
      std::fprintf(stderr, "ballast status: no ballast master answered at %s within %.0f s: check the address and that the job is running%s\n",
                   ep->ToString().c_str(), timeout_s, TlsHint(st.error_message()).c_str());
    } else {
      std::fprintf(stderr, "ballast status: %s\n", st.error_message().c_str());
    }
    return 1;
  }
  if (json) {
    std::fputs(master::JobStatusJson(status).c_str(), stdout);
  } else {
    PrintHuman(status);
  }
  return 0;
}

}  // namespace ballast::cli
