// The chaos drills an agent injects (common/chaos.h), each once:
//   kill-agent:node=N,...    this agent SIGKILLs itself (a lost node)
//   kill-worker:rank=R,...   SIGKILL to worker rank R (a crashed worker)
//   hang:rank=R,...          SIGSTOP to worker rank R (a hung worker: its
//                            steps stop and --hang-timeout finds it)
//   partition:node=N,for=D   this node's network interface down for D s
// triggered `after` seconds after the round's workers start (kill-agent: the
// first round's) or when the step reaches at_step (the worker's own step;
// kill-agent: the node's lowest). A worker fault hits the attempt whose
// TORCHELASTIC_RESTART_COUNT is its `restart` (default 0), so the restarted
// workers train on.
//   kill-master:at_step=S    the launcher kills the master once the master's
//                            status shows every training node at step S; the
//                            agent only reports its node's step at once when
//                            its lowest reaches S (kReportStep, once a round),
//                            so the kill does not wait for the periodic
//                            progress report (every 2 s). KillMasterDue is the
//                            launcher's side.
//
// The driver decides; the agent sends the signals (Due returns them), so the
// decisions are unit-tested without processes.
//
// Thread safety: ChaosDriver is not thread-safe (the agent's loop calls it);
// DiskChaos is.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "ballast/v1/master.pb.h"
#include "common/chaos.h"

namespace ballast::agent {

struct ChaosAction {
  enum class Kind { kKillAgent, kKillWorker, kStopWorker, kLinkDown, kLinkUp, kReportStep };
  Kind kind = Kind::kKillWorker;
  pid_t pid = -1;        // the worker's (kKillAgent: -1, this process)
  int global_rank = -1;  // the worker's rank (kKillAgent, kReportStep: -1)
  std::string what;      // for the log: "kill-worker:rank=2,at_step=7 (rank 2 at step 7)"
  double seconds = 0;    // kLinkDown: how long the partition lasts
};

class ChaosDriver {
 public:
  ChaosDriver(ChaosSpec spec, int node_rank);

  // Whether any fault here could ever fire on this node.
  bool armed() const { return !faults_.empty(); }

  // A round's workers started (CLOCK_MONOTONIC ns) in the attempt with
  // this restart count. Re-arms kReportStep (the new round counts its steps
  // from the checkpoint it resumed).
  void RoundStarted(uint64_t now_ns, int restart_count);

  struct Worker {
    int global_rank = 0;
    pid_t pid = -1;
    bool running = true;
    bool stepped = false;  // reported a step this round
    uint64_t step = 0;
  };
  // The faults due now, each returned once.
  std::vector<ChaosAction> Due(uint64_t now_ns, const std::vector<Worker>& workers);

 private:
  struct Pending {
    ChaosFault fault;
    ChaosAction::Kind kind;
    bool fired = false;
    uint64_t restore_ns = 0;  // partition: when the link comes back (0: not down)
  };
  std::string Describe(const ChaosFault& f) const;

  std::vector<Pending> faults_;
  uint64_t first_round_ns_ = 0;
  uint64_t round_ns_ = 0;
  int restart_count_ = 0;
};

// The launcher's side of kill-master (cli/master_process.cc): whether the
// fault is due given the master's status and the seconds since the master
// first started; the reason for the log ("every training node at step 6"),
// or nullopt. By step it counts only the nodes in the world ("training"):
// a hot spare or a waiting node never steps.
std::optional<std::string> KillMasterDue(const ChaosFault& fault, const v1::JobStatus& status,
                                         double since_start_s);

// disk-full / disk-error:node=N (common/chaos.h): the checkpoint persister
// of node N asks before each shard write; `writes` of them fail with ENOSPC
// or EIO from the trigger on (after=T: seconds after the driver was made, as
// the agent joins; at_step=S: a write of step >= S), then the disk is fine
// again.
//
// Thread safety: thread-safe (the persister writes from a thread per store).
class DiskChaos {
 public:
  DiskChaos(const ChaosSpec& spec, int node_rank);
  bool armed() const { return fault_.has_value(); }
  // OK, or the injected error for this write of `step` to `dir`.
  absl::Status BeforeWrite(uint64_t step, const std::string& dir);

 private:
  std::optional<ChaosFault> fault_;
  bool full_ = true;  // disk-full (ENOSPC), else disk-error (EIO)
  uint64_t made_ns_ = 0;
  std::mutex mu_;
  int left_ = 0;
};

}  // namespace ballast::agent
