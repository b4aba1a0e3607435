#include "master/goodput.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ballast::master {

std::string_view GoodputAccountant::PartName(Part part) {
  switch (part) {
    case kProductive:
      return "productive";
    case kRecompute:
      return "recompute";
    case kRestart:
      return "restart";
    case kRendezvous:
      return "rendezvous";
    case kPrecheck:
      return "precheck";
    case kStartup:
      return "startup";
    case kCheckpoint:
      return "checkpoint";
    case kIdle:
      return "idle";
    case kQueued:
      return "queued";
    case kPreempted:
      return "preempted";
    case kNumParts:
      break;
  }
  return "?";
}

GoodputAccountant::GoodputAccountant(double now) : start_(now), since_(now) {}

void GoodputAccountant::Close(double now, Part tail, Breakdown* b) const {
  const double elapsed = std::max(0.0, now - since_);
  switch (phase_) {
    case Phase::kRendezvous:
      b->seconds[kRendezvous] += elapsed;
      break;
    case Phase::kPrecheck:
      b->seconds[kPrecheck] += elapsed;
      break;
    case Phase::kStarting:
      b->seconds[starting_part_] += elapsed;
      break;
    case Phase::kTraining:
      // [since_, last_advance_) is attributed at each advance.
      b->seconds[tail] += std::max(0.0, now - last_advance_);
      break;
    case Phase::kSuspended:
      b->seconds[kPreempted] += elapsed;
      break;
    case Phase::kDone:
      break;
  }
}

void GoodputAccountant::Enter(double now, Phase phase) {
  phase_ = phase;
  since_ = now;
  if (phase == Phase::kStarting) round_stall_ = pending_stall_ = 0;  // a new round's workers count from 0
}

void GoodputAccountant::Rendezvous(double now) {
  if (phase_ == Phase::kDone || phase_ == Phase::kSuspended || phase_ == Phase::kRendezvous) return;
  Close(now, kRecompute, &totals_);
  Enter(now, Phase::kRendezvous);
}

void GoodputAccountant::Precheck(double now) {
  if (phase_ == Phase::kDone || phase_ == Phase::kSuspended || phase_ == Phase::kPrecheck) return;
  Close(now, kRecompute, &totals_);
  Enter(now, Phase::kPrecheck);
}

void GoodputAccountant::RoundStarted(double now) {
  if (phase_ == Phase::kDone || phase_ == Phase::kSuspended) return;
  if (phase_ == Phase::kStarting && starting_part_ == kRestart) return;  // a failure's restart goes on
  Close(now, kRecompute, &totals_);
  starting_part_ = started_once_ ? kRestart : kStartup;
  started_once_ = true;
  Enter(now, Phase::kStarting);
}

void GoodputAccountant::Failure(double now) {
  if (phase_ != Phase::kTraining && phase_ != Phase::kStarting) return;  // waiting, checking: no workers
  if (phase_ == Phase::kStarting && starting_part_ == kRestart) return;
  Close(now, kRecompute, &totals_);  // the step in progress is lost
  starting_part_ = kRestart;
  started_once_ = true;
  Enter(now, Phase::kStarting);
}

void GoodputAccountant::Progress(double now, const WorldStep& w) {
  if (phase_ == Phase::kDone || w.step < 0) return;
  totals_.steps_seen = true;
  if (phase_ != Phase::kTraining) {
    if (phase_ != Phase::kStarting) return;  // a late report of a stopped round
    if (w.first_step < 0) return;  // the round's first step is not known yet: still starting
    // Startup or restart ends when the round's first step is done.
    const double first_at = std::clamp(w.first_at, since_, now);
    Close(first_at, kIdle, &totals_);
    Enter(first_at, Phase::kTraining);
    last_step_ = w.first_step;
    last_advance_ = first_at;
    totals_.high_water_step = std::max(totals_.high_water_step, w.first_step);
  }
  if (w.ckpt_stall_s > round_stall_) {
    pending_stall_ += w.ckpt_stall_s - round_stall_;
    round_stall_ = w.ckpt_stall_s;
  }
  Advance(std::clamp(w.reached_at, last_advance_, now), w.step);
}

void GoodputAccountant::Advance(double at, int64_t step) {
  if (step < last_step_) {  // not expected within a round: count again from here
    totals_.seconds[kRecompute] += at - last_advance_;
    last_step_ = step;
    last_advance_ = at;
    return;
  }
  if (step == last_step_) return;
  const int64_t n = step - last_step_;
  const int64_t fresh = std::max<int64_t>(0, step - std::max(last_step_, totals_.high_water_step));
  // The stall reported since the last advance fell in this interval.
  const double stall = std::min(pending_stall_, at - last_advance_);
  pending_stall_ -= stall;
  totals_.seconds[kCheckpoint] += stall;
  const double dt = at - last_advance_ - stall;
  totals_.seconds[kProductive] += dt * static_cast<double>(fresh) / static_cast<double>(n);
  totals_.seconds[kRecompute] += dt * static_cast<double>(n - fresh) / static_cast<double>(n);
  totals_.recomputed_steps += n - fresh;
  totals_.high_water_step = std::max(totals_.high_water_step, step);
  last_step_ = step;
  last_advance_ = at;
}

void GoodputAccountant::Finished(double now) {
  if (phase_ == Phase::kDone) return;
  Close(now, kIdle, &totals_);  // after the last step: the script's teardown
  totals_.wall_s = std::max(0.0, now - start_);
  Enter(now, Phase::kDone);
}

void GoodputAccountant::Suspended(double now) {
  if (phase_ == Phase::kDone || phase_ == Phase::kSuspended) return;
  Close(now, kRecompute, &totals_);  // the step in progress is lost
  Enter(now, Phase::kSuspended);
}

void GoodputAccountant::Held(const Breakdown& before, double before_at, double queued_s, double admitted_at) {
  // A fresh master: nothing is accounted yet, and since_ is its start.
  const double now = since_;
  const bool previous = before.wall_s > 0;
  // When the job was admitted (or resumed) for this master; a previous
  // master's breakdown newer than that was left by a master that ran after
  // it (this one restarts the job without its state).
  const double from = std::min(now, previous ? std::max(before_at, admitted_at) : admitted_at > 0 ? admitted_at : now);
  Breakdown b;
  if (previous) {
    b = before;
    b.seconds[kPreempted] += std::max(0.0, from - before_at);
  } else {
    b.seconds[kQueued] = std::max(0.0, queued_s);
  }
  b.seconds[b.steps_seen ? kRestart : kStartup] += now - from;
  double carried = 0;
  for (double s : b.seconds) carried += s;
  totals_ = b;
  totals_.wall_s = 0;  // Get() and Finished() set it
  start_ = now - carried;
  started_once_ = b.steps_seen || b.high_water_step > 0;
  starting_part_ = started_once_ ? kRestart : kStartup;
}

void GoodputAccountant::Resume(double start, double mark, const Breakdown& b, bool running, bool training,
                               double round_stall_s) {
  // The parts add up to the wall: one that began before this job's master
  // (queued, a previous master's time: Held) moves the start back.
  double carried = 0;
  for (double s : b.seconds) carried += s;
  start_ = std::min(start, mark - carried);
  totals_ = b;
  totals_.wall_s = 0;  // Get() and Finished() set it
  started_once_ = running || b.high_water_step > 0;
  starting_part_ = b.steps_seen ? kRestart : kStartup;
  Enter(mark, !running ? Phase::kRendezvous : training ? Phase::kTraining : Phase::kStarting);
  last_step_ = b.high_water_step;
  last_advance_ = mark;
  round_stall_ = training ? round_stall_s : 0;
}

GoodputAccountant::Breakdown GoodputAccountant::Get(double now) const {
  Breakdown b = totals_;
  if (phase_ == Phase::kDone) return b;
  Close(now, kIdle, &b);
  b.wall_s = std::max(0.0, now - start_);
  return b;
}

std::string FormatGoodput(const v1::Goodput& g) {
  if (!g.known()) return absl::StrFormat("goodput unknown after %.1f s: %s", g.wall_s(), g.note());
  std::string parts;
  double away = 0;  // queued and preempted: not in goodput's denominator
  for (const auto& p : g.parts()) {
    if (p.part() == "queued" || p.part() == "preempted") away += p.seconds();
    if (p.part() != "productive" && p.seconds() < 0.05) continue;
    absl::StrAppend(&parts, parts.empty() ? "" : ", ", p.part(), " ", absl::StrFormat("%.1f s", p.seconds()));
  }
  std::string line =
      away < 0.05 ? absl::StrFormat("goodput %.1f%% of %.1f s (%s", 100 * g.goodput(), g.wall_s(), parts)
                  : absl::StrFormat("goodput %.1f%% of the %.1f s the job held its nodes (wall %.1f s: %s",
                                    100 * g.goodput(), g.wall_s() - away, g.wall_s(), parts);
  if (g.recomputed_steps() > 0) absl::StrAppend(&line, "; ", g.recomputed_steps(), " steps redone");
  return line + ")";
}

void StepHistory::Add(double at_s, int64_t step) {
  if (!points_.empty() && (step <= points_.back().step || at_s - points_.back().at_s < interval_s_)) return;
  points_.push_back({at_s, step});
  if (points_.size() > kMaxPoints) {
    std::vector<Point> kept;
    for (size_t i = 0; i < points_.size(); i += 2) kept.push_back(points_[i]);
    points_.swap(kept);
    interval_s_ *= 2;
  }
}

std::string FormatFailures(const v1::JobStatus& st) {
  if (st.failures_total() == 0) return "no failures";
  std::map<std::string, int> kinds;
  double resume_sum = 0;
  int resumed = 0;
  for (const auto& f : st.failures()) {
    ++kinds[f.kind()];
    if (f.resumed()) {
      resume_sum += f.resume_s();
      ++resumed;
    }
  }
  std::string by_kind;
  for (const auto& [k, n] : kinds) absl::StrAppend(&by_kind, by_kind.empty() ? "" : ", ", n, " ", k);
  std::string line = absl::StrCat(st.failures_total(), st.failures_total() == 1 ? " failure (" : " failures (", by_kind, ")");
  if (resumed > 0) absl::StrAppend(&line, absl::StrFormat(", training resumed %.2f s after each on average", resume_sum / resumed));
  return line;
}

std::string FormatChaosReport(const std::string& injected, const v1::JobStatus& st) {
  std::string out = absl::StrCat("chaos: injected ", injected, "; the job ",
                                 st.failures_size() == 0 && st.persist_errors_total() == 0 ? "saw no failure"
                                                                                            : "responded:");
  for (const auto& f : st.failures()) {
    absl::StrAppend(&out, absl::StrFormat("\n  %.1f s, round %d: %s, ", f.at_s(), f.round(), f.kind()));
    if (f.global_rank() >= 0) absl::StrAppend(&out, "rank ", f.global_rank(), " on ");
    absl::StrAppend(&out, "node ", f.node_id(), " (node rank ", f.node_rank(), "): ", f.cause(), " -> ", f.action(),
                    absl::StrFormat("; decided %.2f s after it was seen", f.detection_s()));
    if (f.resumed()) {
      absl::StrAppend(&out, absl::StrFormat(", training again %.2f s later, %d step(s) run again", f.resume_s(),
                                            f.steps_lost()));
    }
  }
  if (st.persist_errors_total() > 0) {
    absl::StrAppend(&out, "\n  ", st.persist_errors_total(),
                    " checkpoint write(s) failed (the agents retry them); training went on; the newest: ",
                    st.last_persist_error());
  }
  return out;
}

}  // namespace ballast::master
