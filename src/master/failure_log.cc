#include "master/failure_log.h"

#include <algorithm>

namespace ballast::master {

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds(std::move(upper_bounds)), counts(bounds.size(), 0) {}

void Histogram::Observe(double v, uint64_t n) {
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (v <= bounds[i]) counts[i] += n;
  }
  count += n;
  sum += v * static_cast<double>(n);
}

// Recovery takes from a fraction of a second (warm restart) to minutes (a
// replacement node).
FailureLog::FailureLog() : recovery_({0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600}) {}

void FailureLog::Add(v1::FailureRecord r) {
  ++total_;
  if (r.action() != "job failed") ++recovered_by_kind_[r.kind().empty() ? std::string("unknown") : r.kind()];
  records_.push_back(std::move(r));
  if (records_.size() > kMaxRecords) {
    records_.pop_front();
    if (open_from_ > 0) --open_from_;
  }
}

void FailureLog::Resumed(int64_t round, double first_at_s, int64_t first_step, int64_t high_water,
                         std::vector<v1::FailureRecord>* completed) {
  while (open_from_ < records_.size() && records_[open_from_].round() < round) {
    v1::FailureRecord& r = records_[open_from_++];
    r.set_resumed(true);
    r.set_resume_s(std::max(0.0, first_at_s - r.at_s()));
    r.set_steps_lost(std::max<int64_t>(0, high_water - first_step + 1));
    recovery_.Observe(r.resume_s());
    if (completed != nullptr) completed->push_back(r);
  }
}

void FailureLog::Restore(const google::protobuf::RepeatedPtrField<v1::FailureRecord>& records, int total) {
  records_.assign(records.begin(), records.end());
  total_ = std::max(total, static_cast<int>(records_.size()));
  recovered_by_kind_.clear();
  recovery_ = Histogram(recovery_.bounds);
  open_from_ = records_.size();
  for (size_t i = 0; i < records_.size(); ++i) {
    const v1::FailureRecord& r = records_[i];
    if (r.action() != "job failed") ++recovered_by_kind_[r.kind().empty() ? std::string("unknown") : r.kind()];
    if (r.resumed()) {
      recovery_.Observe(r.resume_s());
    } else if (open_from_ == records_.size()) {
      open_from_ = i;
    }
  }
}

}  // namespace ballast::master
