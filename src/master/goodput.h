// GoodputAccountant: splits a job's wall time into what it was spent on,
// from what the master sees: rounds starting, failures, waiting for nodes,
// pre-flight checks, the world's step from the agents' progress reports
// (`ballast.step`), the end of the job, and, on Kubernetes, the time the job
// waited for its quota. goodput = productive / (wall - queued - preempted):
// the share of the time the job held its nodes that trained the model.
//
// Parts (they add up to the wall time at every moment):
//   productive   time of steps that advanced the model past the highest step
//                reached so far (the interval between two advances of the
//                world's step is split by how many of its steps were new);
//   recompute    time of steps redone after a rollback (below that highest
//                step), and the partial step a failure threw away (from the
//                last advance to the failure);
//   restart      from a failure (or a round change while training) until
//                every node made the new round's first step, unless the job
//                waits for nodes;
//   rendezvous   no round running: waiting for nodes, the rendezvous;
//   precheck     the pre-flight check;
//   startup      the first round's start until every node made its first step;
//   checkpoint   training blocked in checkpoint saves (a blocking save, the
//                wait for an overlapped one): the slowest worker's stall,
//                taken out of the step intervals it fell in;
//   idle         time in a running round not attributed yet: since the last
//                advance of the world's step (a step in progress becomes
//                productive or recompute when it completes);
//   queued       waiting for Kueue to admit the job the first time (before
//                any master ran: the operator measures it, Held() adds it);
//   preempted    from the job's suspension (Kueue evicted it, or
//                spec.suspend) until it was admitted or resumed again.
// What it cannot see: a script that never calls ballast.step() reports no
// steps (then steps_seen is false and goodput is unknown, not guessed);
// checkpoint saves that bypass ballast.checkpoint (torch.save in the script)
// stay inside the step times; a checkpoint load is part of restart/startup.
// Step times are exact (agents report when a step was reached, and report at
// once when a worker fails), not rounded to the report interval.
//
// Times are the master's clock (seconds). Thread safety: none; JobMaster
// calls it under its lock.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ballast/v1/master.pb.h"

namespace ballast::master {

class GoodputAccountant {
 public:
  // New parts go at the end: a journal keeps the seconds by index.
  enum Part {
    kProductive,
    kRecompute,
    kRestart,
    kRendezvous,
    kPrecheck,
    kStartup,
    kCheckpoint,
    kIdle,
    kQueued,
    kPreempted,
    kNumParts
  };
  static std::string_view PartName(Part part);

  explicit GoodputAccountant(double now);

  // No round runs (waiting for nodes, the rendezvous).
  void Rendezvous(double now);
  // The pre-flight check runs.
  void Precheck(double now);
  // A round's workers are being started: the time to its first step is
  // startup (the first round) or restart.
  void RoundStarted(double now);
  // A failure was seen in the running round (the partial step is lost).
  void Failure(double now);
  // The world's step (the lowest over the round's nodes) in the running round.
  struct WorldStep {
    int64_t step = -1;
    double reached_at = 0;    // when the world reached it (<= now)
    int64_t first_step = -1;  // the round's first step (-1: not known yet)
    double first_at = 0;      // when every node had made it
    double ckpt_stall_s = 0;  // the most time one worker was blocked in checkpoint saves this round
  };
  void Progress(double now, const WorldStep& w);
  void Progress(double now, int64_t step) { Progress(now, WorldStep{step, now, step, now}); }
  // The job ended: the wall clock stops.
  void Finished(double now);
  // The job was suspended (Kueue evicted it, or spec.suspend): from now the
  // time is preempted (the step in progress is lost) until the job ends
  // for this master.
  void Suspended(double now);
  struct Breakdown {
    double wall_s = 0;
    std::array<double, kNumParts> seconds{};
    bool steps_seen = false;  // some progress report came (else goodput is unknown)
    int64_t high_water_step = 0;
    int64_t recomputed_steps = 0;
    // Of the time the job held its nodes (not queued, not preempted).
    double held_s() const { return wall_s - seconds[kQueued] - seconds[kPreempted]; }
    double goodput() const { return held_s() > 0 ? seconds[kProductive] / held_s() : 0; }
  };
  // What came before this master (a fresh one, at its start): `before`, the
  // breakdown the job's previous master left (its wall included), as of
  // `before_at`; then the job waited suspended until `admitted_at`, and is
  // starting since (startup, or restart once steps were seen). With no
  // previous master (`before` empty) the job was queued `queued_s` before
  // `admitted_at`. Times are this clock's; the wall grows by all of it.
  void Held(const Breakdown& before, double before_at, double queued_s, double admitted_at);

  Breakdown Get(double now) const;
  int64_t high_water_step() const { return totals_.high_water_step; }
  // The checkpoint stall the running round's slowest worker reported so far.
  double round_stall_s() const { return round_stall_; }
  bool training() const { return phase_ == Phase::kTraining; }
  // Carries on from a breakdown a restarted master read from its journal:
  // `b` as of `mark`, the job's start at `start` (this clock's times). When a
  // round was training the time since the mark is attributed at the next
  // advance of the world's step like any step interval; when one was starting
  // it goes on starting; else the job waits for nodes.
  void Resume(double start, double mark, const Breakdown& b, bool running, bool training, double round_stall_s);

 private:
  enum class Phase { kRendezvous, kPrecheck, kStarting, kTraining, kSuspended, kDone };
  // Adds the current phase's time up to `now` to `b`; in training, the time
  // since the last advance goes to `tail`.
  void Close(double now, Part tail, Breakdown* b) const;
  void Enter(double now, Phase phase);
  // The world's step moved to `step` at time `at` (training).
  void Advance(double at, int64_t step);

  double start_;
  Phase phase_ = Phase::kRendezvous;
  double since_;                // when phase_ began
  bool started_once_ = false;   // a round started before (the next start is a restart)
  Part starting_part_ = kStartup;
  // Training.
  int64_t last_step_ = -1;      // the world's step at the last advance (-1: none yet this round)
  double last_advance_ = 0;
  double round_stall_ = 0;      // WorldStep::ckpt_stall_s seen this round
  double pending_stall_ = 0;    // stall not yet taken out of a step interval
  Breakdown totals_;
};

// What came before a fresh master, for its goodput (Held()): on Kubernetes
// the job's status (status.time, status.queuedSeconds, status.admittedAt).
struct GoodputBefore {
  GoodputAccountant::Breakdown breakdown;  // the job's previous master's (wall_s 0: none)
  double at_unix_s = 0;                    // when that breakdown was taken
  double queued_s = 0;                     // queued before the first admission
  double admitted_unix_s = 0;              // admitted (or resumed) for this master; 0: unknown
  bool empty() const { return breakdown.wall_s <= 0 && queued_s <= 0; }
};

// The world's step over the whole job for a step-rate chart, in at most
// kMaxPoints points: a point at most every interval, and when full every
// other point goes and the interval doubles (so it always spans the job).
class StepHistory {
 public:
  static constexpr size_t kMaxPoints = 240;
  void Add(double at_s, int64_t step);
  struct Point {
    double at_s;
    int64_t step;
  };
  const std::vector<Point>& points() const { return points_; }

 private:
  std::vector<Point> points_;
  double interval_s_ = 1;
};

// "goodput 94.4% of 190.6 s (productive 180.0 s, restart 0.8 s, ...; 2 steps
// redone)", or why it is unknown: for `ballast status` and job summaries.
std::string FormatGoodput(const v1::Goodput& g);
// "3 failures (2 killed, 1 node-lost), training resumed 0.41 s after each on
// average": what a job survived, for its summary.
std::string FormatFailures(const v1::JobStatus& st);
// A chaos drill's report (`ballast launch --chaos`): the faults injected and,
// per failure the master decided, what it saw and did, e.g.
// "chaos: injected nan:rank=1,at_step=6\n  12.3 s, round 1: nan, rank 1 on
// node node-0 (node rank 0): non-finite loss (nan) at step 6 -> rollback;
// decided 0.10 s after it was seen, training again 1.25 s later, 1 step(s)
// run again".
std::string FormatChaosReport(const std::string& injected, const v1::JobStatus& st);

}  // namespace ballast::master
