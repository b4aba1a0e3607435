// Every tunable (timeouts, thresholds, intervals) in one table, each with a doc
// comment and an environment override BALLAST_<NAME> (upper case), in the style
// of Ray's ray_config_def.h. Read once on first use; thread-safe after that.
//
//   double t = ballast::Tunables::Get().heartbeat_timeout_s;
#pragma once

#include <string>
#include <vector>

namespace ballast {

// X(type, name, default, doc)
#define BALLAST_TUNABLES(X)                                                                    \
  X(double, heartbeat_interval_s, 1.0, "Seconds between an agent's heartbeats to the master.") \
  X(double, heartbeat_timeout_s, 5.0,                                                          \
    "A node whose agent sent no heartbeat for this long is dead and leaves the job.")         \
  X(double, disconnect_grace_s, 1.0,                                                          \
    "A node whose agent's decision stream closed and did not reopen within this long is "     \
    "lost (a killed agent closes its connection at once). 0 relies on heartbeats alone.")     \
  X(double, failure_settle_s, 0.1,                                                            \
    "A worker failure is decided this long after its report, so that a node loss behind it "  \
    "is seen first and the failure is not counted as a restart.")                             \
  X(double, last_call_s, 1.0,                                                                  \
    "Once at least MIN nodes joined, a round completes this many seconds after the last "      \
    "join (or at once when MAX nodes joined).")                                                \
  X(double, wait_for_nodes_s, 300.0,                                                           \
    "How long a job below MIN nodes waits for replacements before it fails.")                 \
  X(double, stop_grace_s, 5.0, "Seconds between SIGTERM and SIGKILL when stopping workers.")   \
  X(double, connect_timeout_s, 30.0,                                                           \
    "How long an agent tries to reach the master at start before it gives up.")                \
  X(double, reconnect_timeout_s, 60.0,                                                         \
    "How long an agent keeps reconnecting to a master it lost before it stops its workers "   \
    "and exits.")                                                                              \
  X(double, kv_wait_s, 120.0, "How long an agent waits for the round's MASTER_ADDR/PORT.")     \
  X(double, finish_linger_s, 3.0,                                                              \
    "How long a master keeps serving after the job finished, so every agent hears it.")       \
  X(int, stderr_tail_lines, 20, "Lines of a failed worker's stderr kept for the failure report.") \
  X(int, max_node_replacements, 3,                                                             \
    "`ballast launch` and `ballast slurm`: how many lost nodes are replaced before giving up.") \
  X(double, rpc_timeout_s, 10.0, "Deadline of one ordinary call from an agent to the master.") \
  X(double, ckpt_report_timeout_s, 5.0,                                                        \
    "Deadline of an agent's report that a checkpoint shard is durable (its persister thread).") \
  X(double, ckpt_breakpoint_report_timeout_s, 2.0,                                             \
    "Deadline of that report for the breakpoint save at a restart (on the agent's main loop, " \
    "possibly with the master gone).")                                                         \
  X(double, slurm_node_state_poll_s, 2.0,                                                      \
    "`ballast slurm`: seconds between reads of the job's node states (sinfo).")               \
  X(double, ray_pending_s, 10.0,                                                               \
    "`ballast ray run`: seconds a node waits for a free Ray node before the job is told (it goes on " \
    "with the nodes it has; the node still starts when a Ray node frees up or joins).")         \
  X(double, ray_master_start_s, 60.0,                                                          \
    "`ballast ray run`: seconds for the master's Ray actor to start, or to come back after it died " \
    "(Ray starts a worker process for it; a runtime_env may be installing).")                   \
  X(double, slurm_command_timeout_s, 10.0,                                                     \
    "`ballast slurm`: deadline of one Slurm command (squeue, scancel, sinfo, scontrol).")     \
  X(double, hang_first_step_grace_s, 300.0,                                                    \
    "With --hang-timeout: a worker that reports no step for this long after it started is "   \
    "hung (imports, rendezvous and data loading come first). Never shorter than the timeout.") \
  X(double, hang_checkpoint_grace_s, 600.0,                                                    \
    "With --hang-timeout: a worker inside a checkpoint save is hung only after this long "    \
    "without progress. Never shorter than the timeout.")                                      \
  X(double, hang_exit_grace_s, 120.0,                                                          \
    "With --hang-timeout: a worker whose interpreter is exiting (after its training loop; "   \
    "torch's teardown takes seconds) is hung only after this long. Never shorter than the "  \
    "timeout.")                                                                               \
  X(double, hang_dump_wait_s, 1.0,                                                             \
    "Seconds a hung worker gets to write its Python stacks (SIGUSR1) before it is killed.")   \
  X(double, hang_settle_s, 3.0,                                                                \
    "The master decides a hang report this long after it arrived, so the other nodes' hang "  \
    "reports of the round arrive too and the rank outside a collective is blamed.")           \
  X(double, progress_report_interval_s, 2.0,                                                   \
    "Seconds between an agent's progress reports (min step, step time) to the master.")       \
  X(double, addr_check_timeout_s, 5.0,                                                        \
    "Before a round's workers start, every node connects to the round's MASTER_ADDR (a probe " \
    "port of group rank 0) for up to this long; a node that cannot fails the round.")         \
  X(double, store_connect_timeout_s, 300.0,                                                     \
    "The node of rank 0 fails the round when, this long after its torch store started "        \
    "listening, not every rank has connected to it (the process group did not form).")       \
  X(double, straggler_factor, 2.0,                                                             \
    "A node whose step time exceeds this factor times the median over the round's nodes is "  \
    "a straggler (needs at least 2 reporting nodes).")                                        \
  X(double, precheck_timeout_s, 120.0,                                                         \
    "Pre-flight check: seconds an agent gives one check round (torch import included) before " \
    "it kills the check and reports a failure.")                                              \
  X(double, precheck_grace_s, 30.0,                                                            \
    "Pre-flight check: the master counts a node that sent no result by the timeout + this as " \
    "failed.")                                                                                 \
  X(int, precheck_allreduce_bytes, 16 << 20, "Pre-flight check: allreduce payload per worker.") \
  X(int, precheck_matmul_size, 1024, "Pre-flight check: size of the square matmul.")           \
  X(double, precheck_straggler_min_s, 0.1,                                                     \
    "Pre-flight check: a straggler is also this many seconds slower than the median (below it " \
    "is timing noise of a short benchmark).")                                                  \
  X(int, ckpt_copy_threads, 0,                                                                 \
    "Threads that copy a flash checkpoint into shared memory; 0: one per core, up to 8.")

struct Tunables {
#define BALLAST_TUNABLE_FIELD(type, name, def, doc) type name = def;
  BALLAST_TUNABLES(BALLAST_TUNABLE_FIELD)
#undef BALLAST_TUNABLE_FIELD

  // The process-wide values: defaults overridden by BALLAST_<NAME> env vars.
  static const Tunables& Get();
  // Defaults overridden by the environment. A value that does not parse or is
  // negative (no tunable takes one) is reported in *errors (naming the
  // variable and what to do) and the default kept for it; `ballast` refuses
  // to start with any (main.cc: Validate), so a typo is never ignored.
  static Tunables FromEnv(std::vector<std::string>* errors);
  // The errors FromEnv finds in this process's environment.
  static std::vector<std::string> Validate();
};

}  // namespace ballast
