// FailureLog: one record per failure the job met (cause, node, rank, how long
// detecting it took, how long until training resumed, steps run again), for
// `ballast status`, GET /api/v1/job and the metrics. A record is opened when
// the master decides on the failure and completed when a later round makes
// its first step.
//
// Thread safety: none; JobMaster calls it under its lock.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "ballast/v1/master.pb.h"

namespace ballast::master {

// A cumulative histogram with fixed upper bounds (Prometheus semantics:
// counts[i] is the observations <= bounds[i]; count includes +Inf).
struct Histogram {
  explicit Histogram(std::vector<double> upper_bounds);
  void Observe(double v, uint64_t n = 1);  // n observations of v
  std::vector<double> bounds;
  std::vector<uint64_t> counts;  // cumulative, one per bound
  uint64_t count = 0;
  double sum = 0;
};

class FailureLog {
 public:
  static constexpr size_t kMaxRecords = 1000;  // the newest are kept; total() counts all

  FailureLog();

  // A failure decided `at_s` seconds after the job's start. `r` carries the
  // rest but the resume fields.
  void Add(v1::FailureRecord r);
  // Round `round` made its first step `first_step` `first_at_s` seconds after
  // the job's start; `high_water` was the highest step reached before. Completes
  // the open records of earlier rounds (copied to *completed when given).
  void Resumed(int64_t round, double first_at_s, int64_t first_step, int64_t high_water,
               std::vector<v1::FailureRecord>* completed = nullptr);

  // Back from the master's journal: the newest records and the total; the
  // recovery histogram and counts by kind are rebuilt from the records.
  void Restore(const google::protobuf::RepeatedPtrField<v1::FailureRecord>& records, int total);

  const std::deque<v1::FailureRecord>& records() const { return records_; }
  int total() const { return total_; }
  // Failures the job recovered from (all but those that failed it), by kind,
  // also those no longer in records(): ballast_restarts_total{cause}.
  const std::map<std::string, int>& recovered_by_kind() const { return recovered_by_kind_; }
  // Seconds from the decision to the next round's first step, per resumed failure.
  const Histogram& recovery() const { return recovery_; }

 private:
  std::deque<v1::FailureRecord> records_;
  size_t open_from_ = 0;  // records_[open_from_..] are not resumed yet
  int total_ = 0;
  std::map<std::string, int> recovered_by_kind_;
  Histogram recovery_;
};

}  // namespace ballast::master
