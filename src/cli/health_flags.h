// Training-health flags (health/health_policy.h), shared by `ballast master`,
// `ballast launch` and `ballast slurm` (`ballast run` parses the same
// spellings in agent/run_options.cc).
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cli/cli_util.h"
#include "health/health_policy.h"

namespace ballast::cli {

struct HealthFlags {
  std::string on_nan = "rollback";
  int max_rollbacks = 3;
  double loss_spike_z = 0;
  bool no_skip_data = false;
  int replica_check_every = 100;

  void Add(CLI::App& app) {
    app.add_option("--on-nan,--on_nan", on_nan,
                   "What a NaN/Inf loss reported with ballast.step(step, loss=) does: rollback (every rank restarts "
                   "from the newest checkpoint before the bad step, its data skipped), fail, or ignore")
        ->capture_default_str();
    app.add_option("--max-rollbacks,--max_rollbacks", max_rollbacks,
                   "Rollbacks after bad losses before the job fails (they do not use up --max-restarts)")
        ->check(Count())
        ->capture_default_str();
    app.add_option("--loss-spike,--loss_spike", loss_spike_z,
                   "Also roll back a loss this many robust deviations (median/MAD over the rank's last 50 losses) "
                   "above the recent median, e.g. 6 (0: off)");
    app.add_flag("--no-skip-data,--no_skip_data", no_skip_data,
                 "After a rollback, train the bad step's samples again (default: ElasticSampler skips them)");
    app.add_option("--replica-check-every,--replica_check_every", replica_check_every,
                   "Every this many steps, ranks that must hold the same parameters compare fingerprints "
                   "(ballast.step(step, model=)); a rank that disagrees with the majority is excluded and the job "
                   "rolls back (0: off)")
        ->check(Count())
        ->capture_default_str();
  }
  // The policy, or kInvalidArgument naming the flag.
  absl::StatusOr<health::HealthPolicy> Get() const {
    health::HealthPolicy p;
    absl::StatusOr<health::OnNan> mode = health::ParseOnNan(on_nan);
    if (!mode.ok()) return mode.status();
    p.on_nan = *mode;
    p.max_rollbacks = max_rollbacks;
    p.loss_spike_z = loss_spike_z;
    p.skip_data = !no_skip_data;
    p.replica_check_every = replica_check_every;
    if (absl::Status s = health::Validate(p); !s.ok()) return s;
    return p;
  }
  // The same settings as `ballast master` flags (a master in a child process).
  static std::vector<std::string> Argv(const health::HealthPolicy& p) {
    std::vector<std::string> argv = {"--on-nan", health::OnNanName(p.on_nan), "--max-rollbacks",
                                     absl::StrCat(p.max_rollbacks)};
    if (p.loss_spike_z > 0) argv.insert(argv.end(), {"--loss-spike", absl::StrCat(p.loss_spike_z)});
    if (!p.skip_data) argv.push_back("--no-skip-data");
    argv.insert(argv.end(), {"--replica-check-every", absl::StrCat(p.replica_check_every)});
    return argv;
  }
};

}  // namespace ballast::cli
